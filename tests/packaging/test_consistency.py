"""The agent's units, its installer and its packages against the agent's code: the port the
installer waits on and opens in the firewall is the agent's data-plane port; the service
user, the state directory and the configuration path agree everywhere; the unit may write
the configured model and cache roots; the update helper's spool and trust directory are the
ones the root helper (llmgw/updater/) uses, and the agent cannot write the trust directory.

Read from the files themselves (no build, no root): installer/install-agent.sh (its
``NAME=value`` settings near the top), systemd/*.service|path, packaging/sysusers.d,
packaging/nfpm-agent.yaml, the maintainer scripts as scripts/packages.sh renders them, and
the defaults in llmgw/agent/config.py, llmgw/contracts/update_order.py and llmgw/updater/.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

import pytest
import yaml

from llmgw.agent import config as agent_config
from llmgw.agent.config import load_agent_config
from llmgw.agent.dockerproxy import DEFAULT_LISTEN
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG, DEFAULT_AGENT_STATE_DIR
from llmgw.contracts.ports import DEFAULT_DATA_PORT

ROOT = Path(__file__).resolve().parents[2]
INSTALLER = ROOT / "installer" / "install-agent.sh"
INSTALLER_NAME = "installer/install-agent.sh"
UNITS = ROOT / "systemd"
AGENT_UNIT = UNITS / "llmgw-agent.service"
PATH_UNIT = UNITS / "llmgw-agent-update.path"
HELPER_UNIT = UNITS / "llmgw-agent-update.service"
UPDATER = ROOT / "llmgw" / "updater"
PACKAGES_SH = ROOT / "scripts" / "packages.sh"
NFPM_AGENT = ROOT / "packaging" / "nfpm-agent.yaml"
SYSUSERS = ROOT / "packaging" / "sysusers.d" / "llmgw-agent.conf"
SPEC = ROOT / "packaging" / "llmgw.spec"
INSTALLER_SETTINGS = (
    "AGENT_PORT",
    "SERVICE_USER",
    "CONFIG",
    "STATE_DIR",
    "LIB_DIR",
    "UNIT_DIR",
    "UPDATE_TRUST_DIR",
    "MODELS_ROOT",
    "CACHE_ROOT",
)
# The positional arguments of packages.sh's render_scripts, in order.
RENDER_ARGS = (
    "package",
    "user",
    "gecos",
    "unit",
    "config",
    "state_dir",
    "data_dirs",
    "path_units",
    "extra_groups",
    "linger",
    "purge_dirs",
    "companion_units",
)
NO_LOGIN = ("/nonexistent", "/usr/sbin/nologin", "llmgw node agent")


# ---------------------------------------------------------------------------- readers


def installer_text() -> str:
    """The installer; its absence fails (it is part of what ships), naming the file."""
    if not INSTALLER.is_file():
        pytest.fail(
            f"{INSTALLER_NAME} does not exist: the bundle, the packages' "
            "documentation and these checks need it (issue 7, item 1)"
        )
    return INSTALLER.read_text()


def installer_settings() -> dict[str, str]:
    """The installer's top-level ``NAME=value`` assignments (quotes removed)."""
    found: dict[str, str] = {}
    for line in installer_text().splitlines():
        match = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(\S*)", line)
        if match and match.group(1) not in found:
            (value,) = shlex.split(match.group(2)) or [""]
            found[match.group(1)] = value
    absent = [name for name in INSTALLER_SETTINGS if name not in found]
    assert not absent, (
        f"{INSTALLER_NAME} has no top-level {', '.join(absent)}=... line; these "
        "checks read the installer's settings from those assignments"
    )
    return found


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> every value (in order) of a unit file; continuation lines joined."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    text = re.sub(r"\\\n", " ", path.read_text())
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path}: {line!r} outside a section"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(values: list[str] | None, what: str) -> str:
    assert values is not None and len(values) == 1, f"{what}: expected one value, got {values}"
    return values[0]


def words(values: Iterable[str]) -> list[str]:
    return [word for value in values for word in value.split()]


def read_write_paths(values: Iterable[str]) -> list[PurePosixPath]:
    """ReadWritePaths= entries without their '-' (ignore if missing) prefix."""
    return [PurePosixPath(word.removeprefix("-")) for word in words(values)]


def covered(path: Path | PurePosixPath, roots: Iterable[PurePosixPath]) -> bool:
    target = PurePosixPath(str(path))
    return any(target == root or root in target.parents for root in roots)


def render_calls() -> dict[str, dict[str, str]]:
    """packages.sh's ``render_scripts`` calls: package -> its named arguments."""
    text = re.sub(r"\\\n\s*", " ", PACKAGES_SH.read_text())
    calls = {}
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("render_scripts ") and "()" not in stripped:
            args = shlex.split(stripped)[1:]
            assert len(args) == len(RENDER_ARGS), f"render_scripts takes {RENDER_ARGS}: {args}"
            calls[args[0]] = dict(zip(RENDER_ARGS, args, strict=True))
    assert set(calls) == {"llmgw-agent", "llmgw-server"}, calls
    return calls


def state_directory(unit_service: dict[str, list[str]]) -> PurePosixPath:
    """The first StateDirectory= entry, as a path under /var/lib."""
    first = words(unit_service["StateDirectory"])[0]
    return PurePosixPath("/var/lib") / first


def exec_start(unit_service: dict[str, list[str]]) -> list[str]:
    return shlex.split(one(unit_service.get("ExecStart"), "ExecStart").lstrip("-+!@:"))


# -------------------------------------------------------------------------- the port


def test_installer_waits_on_and_opens_the_agents_data_plane_port(tmp_path: Path) -> None:
    settings = installer_settings()
    port = int(settings["AGENT_PORT"])
    assert port == DEFAULT_DATA_PORT
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("server: cp-1:7443\nnode_id: n1\n")
    listen = load_agent_config(cfg).listen
    assert listen.rsplit(":", 1)[1] == str(port), f"the agent listens on {listen} by default"

    text = installer_text()
    # The port is written once: every other use goes through $AGENT_PORT.
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    literal = [line for line in code if re.search(rf"(?<![0-9]){port}(?![0-9])", line)]
    assert literal == [f"AGENT_PORT={port}"], f"the port written out elsewhere: {literal}"
    # What it waits on (ss) and what each firewall back-end opens.
    # The port (or the multi-node range) a rule opens is its third argument, PORTS; the
    # port goes into the wanted rules once per --firewall-from source.
    expected = {
        "waits until it listens (ss)": r"ss .*sport = :\$AGENT_PORT",
        "a rule for the port from each --firewall-from source": r'echo "\$source \$AGENT_PORT"',
        "ufw": r'ufw allow .*port "\$\(ufw_ports "\$3"\)"',
        "firewalld": r"port port=\$3 protocol=tcp accept",
        "nft": r'nft (insert|add) rule .*tcp dport "\$3" accept',
    }
    for what, pattern in expected.items():
        assert any(re.search(pattern, line) for line in code), f"{what}: no match for {pattern}"


# ----------------------------------------------------------- user, state, configuration


def test_the_service_user_is_the_same_everywhere() -> None:
    user = installer_settings()["SERVICE_USER"]
    service = unit(AGENT_UNIT)["Service"]
    assert one(service.get("User"), "User") == user
    assert one(service.get("Group"), "Group") == user

    # sysusers.d: no login, no home, the same description the scripts give.
    (entry,) = [
        shlex.split(line)
        for line in SYSUSERS.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert entry[:2] == ["u", user]
    assert (entry[4], entry[5], entry[3]) == NO_LOGIN

    agent = render_calls()["llmgw-agent"]
    assert agent["user"] == user and agent["gecos"] == NO_LOGIN[2]
    # The installer creates the very same user.
    text = installer_text()
    assert re.search(
        r"useradd --system --gid \"\$SERVICE_USER\" --no-create-home --home-dir /nonexistent"
        r" \\?\s*--shell /usr/sbin/nologin --comment \"llmgw node agent\" \"\$SERVICE_USER\"",
        text,
    ), "install-agent.sh's useradd differs from the packages' (home, shell, description)"
    # The maintainer scripts are templates: the user comes from packages.sh only.
    for template in (ROOT / "packaging" / "deb").iterdir():
        assert user not in template.read_text(), f"{template} names {user} instead of @USER@"
    for template in (ROOT / "packaging" / "rpm").iterdir():
        assert user not in template.read_text(), f"{template} names {user} instead of @USER@"
    # The shipped configuration belongs to that user's group.
    recipe = yaml.safe_load(NFPM_AGENT.read_text())
    (conffile,) = [c for c in recipe["contents"] if c.get("type") == "config|noreplace"]
    assert conffile["file_info"]["group"] == user


def test_the_state_directory_is_the_same_everywhere() -> None:
    state = installer_settings()["STATE_DIR"]
    assert PurePosixPath(state) == PurePosixPath(DEFAULT_AGENT_STATE_DIR)
    sections = unit(AGENT_UNIT)
    service = sections["Service"]
    assert state_directory(service) == PurePosixPath(state)
    assert covered(PurePosixPath(state), read_write_paths(service["ReadWritePaths"]))
    # The unit waits for the identity `llmgw agent join` writes there.
    condition = PurePosixPath(one(sections["Unit"].get("ConditionPathExists"), "Condition"))
    assert condition.parent == PurePosixPath(state)
    # TMPDIR, where a one-file build unpacks, is a sibling of the state directory (never
    # inside it: root manages no path in a tree the agent owns), a StateDirectory= of its
    # own, the installer's TMP_DIR, and the first fixed place the bootloader looks.
    tmpdir = PurePosixPath(installer_settings()["TMP_DIR"])
    assert tmpdir == PurePosixPath(f"{state}-tmp")
    assert tmpdir.parent == PurePosixPath(state).parent
    assert f"TMPDIR={tmpdir}" in service["Environment"]
    assert tmpdir.name in words(service["StateDirectory"])
    assert not any("/" in word for word in words(service["StateDirectory"]))
    assert covered(tmpdir, read_write_paths(service["ReadWritePaths"]))
    assert f":?{tmpdir}:" in SPEC.read_text()
    # No path of the installer's or of the spec names anything under the old nested tmp/.
    for text in (installer_text(), SPEC.read_text()):
        assert f"{state}/tmp" not in text and "STATE_DIR/tmp" not in text
    assert render_calls()["llmgw-agent"]["state_dir"] == state


def test_the_configuration_path_is_the_same_everywhere() -> None:
    config = installer_settings()["CONFIG"]
    assert PurePosixPath(config) == PurePosixPath(DEFAULT_AGENT_CONFIG)
    argv = exec_start(unit(AGENT_UNIT)["Service"])
    assert argv[1:] == ["agent", "--config", config], argv
    assert render_calls()["llmgw-agent"]["config"] == config
    recipe = yaml.safe_load(NFPM_AGENT.read_text())
    (conffile,) = [c for c in recipe["contents"] if c.get("type") == "config|noreplace"]
    assert conffile["dst"] == config
    assert conffile["file_info"]["mode"] == 0o640


def test_the_unit_may_write_the_configured_model_and_cache_roots() -> None:
    """The unit alone (package installs) and with the installer's 10-install.conf drop-in
    (tarball installs, default roots) covers models_root and cache_root."""
    settings = installer_settings()
    models = agent_config.DEFAULT_MODELS_ROOT
    cache = agent_config.DEFAULT_CACHE_ROOT
    assert PurePosixPath(settings["MODELS_ROOT"]) == PurePosixPath(models)
    assert PurePosixPath(settings["CACHE_ROOT"]) == PurePosixPath(cache)
    unit_paths = read_write_paths(unit(AGENT_UNIT)["Service"]["ReadWritePaths"])
    for root in (models, cache):
        assert covered(root, unit_paths), f"{AGENT_UNIT.name}'s ReadWritePaths miss {root}"

    # The drop-in the installer writes, with its default roots filled in.
    text = installer_text()
    match = re.search(r'echo "(ReadWritePaths=[^"]*)"', text)
    assert match, "install-agent.sh writes no ReadWritePaths= line into 10-install.conf"
    assert "10-install.conf" in text
    line = match.group(1)
    variables = sorted(set(re.findall(r"\$\{?([A-Z_]+)\}?", line)))
    assert variables == ["CACHE", "MODELS"], f"the drop-in's line uses {variables}"
    # Given, else remembered, else the default (resolve_root's last argument).
    assert re.search(r'\bMODELS=\$\(resolve_root models_root .*"\$MODELS_ROOT"\)', text) and (
        re.search(r'\bCACHE=\$\(resolve_root cache_root .*"\$CACHE_ROOT"\)', text)
    ), "the installer's --models-root/--cache-root do not default to MODELS_ROOT/CACHE_ROOT"
    rendered = line.replace("$MODELS", str(models)).replace("$CACHE", str(cache))
    dropin_paths = read_write_paths([rendered.removeprefix("ReadWritePaths=")])
    for root in (models, cache):
        assert covered(root, dropin_paths), f"10-install.conf ({rendered}) misses {root}"
    # What the packages create for data is the same pair.
    data_dirs = render_calls()["llmgw-agent"]["data_dirs"].split()
    assert data_dirs == [str(models), str(cache)]


# ------------------------------------------------------------------- the update helper


def update_defaults() -> tuple[PurePosixPath, PurePosixPath, PurePosixPath, PurePosixPath]:
    """(spool, trust, helper state, installed binary) of the update order's contract and the
    root helper."""
    if not UPDATER.is_dir() or not PATH_UNIT.is_file() or not HELPER_UNIT.is_file():
        pytest.fail(
            "the update helper is incomplete: llmgw/updater/, "
            "systemd/llmgw-agent-update.path and .service must all exist (issue 7, item 3)"
        )
    from llmgw.contracts.update_order import DEFAULT_SPOOL
    from llmgw.updater.apply import DEFAULT_INSTALLED_BINARY, DEFAULT_STATE
    from llmgw.updater.trust import DEFAULT_TRUST

    return (
        PurePosixPath(DEFAULT_SPOOL),
        PurePosixPath(DEFAULT_TRUST),
        PurePosixPath(DEFAULT_STATE),
        PurePosixPath(DEFAULT_INSTALLED_BINARY),
    )


def test_the_update_helper_units_use_the_code_s_paths() -> None:
    spool, trust, helper_state, binary = update_defaults()
    request = spool / "request"
    path_unit = unit(PATH_UNIT)
    assert PurePosixPath(one(path_unit["Path"].get("PathExists"), "PathExists")) == request
    assert one(path_unit["Path"].get("Unit"), "Unit") == HELPER_UNIT.name
    helper = unit(HELPER_UNIT)
    assert PurePosixPath(one(helper["Unit"].get("ConditionPathExists"), "Condition")) == request
    service = helper["Service"]
    assert "User" not in service, "the helper runs as root"
    if "StateDirectory" in service:
        assert state_directory(service) == helper_state
    writable = read_write_paths(service["ReadWritePaths"])
    for path in (spool, trust, helper_state, binary.parent):
        assert covered(path, writable), f"the helper cannot write {path}"
    argv = exec_start(service)
    assert PurePosixPath(argv[0]) == binary and argv[1:3] == ["agent", "update-apply"]


def test_the_installer_and_the_packages_agree_with_the_update_code() -> None:
    spool, trust, helper_state, binary = update_defaults()
    settings = installer_settings()
    assert PurePosixPath(settings["UPDATE_TRUST_DIR"]) == trust
    assert PurePosixPath(settings["LIB_DIR"]) / "llmgw" == binary
    assert spool.parent == PurePosixPath(settings["STATE_DIR"])
    if "UPDATE_STATE" in settings:
        assert PurePosixPath(settings["UPDATE_STATE"]) == helper_state
    assert settings["UNIT_DIR"] == "/etc/systemd/system"
    text = installer_text()
    for name in (PATH_UNIT.name, HELPER_UNIT.name):
        assert name in text, f"install-agent.sh does not install {name}"
    # The packages ship both units, enable the path unit, and purge the helper's state and
    # the agent's temporary directory (the sibling of its state directory).
    agent = render_calls()["llmgw-agent"]
    assert agent["path_units"] == PATH_UNIT.name
    # (and the Docker proxy's: its dynamic user's state directory, where the one-file build
    # unpacks itself; test_installer_docker.py ties it to the unit)
    assert set(agent["purge_dirs"].split()) - {
        "/var/lib/llmgw-docker-proxy",
        "/var/lib/private/llmgw-docker-proxy",
    } == {str(helper_state), str(trust), settings["TMP_DIR"]}
    recipe = yaml.safe_load(NFPM_AGENT.read_text())
    shipped = {PurePosixPath(c["dst"]).name for c in recipe["contents"] if "src" in c}
    assert {AGENT_UNIT.name, PATH_UNIT.name, HELPER_UNIT.name} <= shipped


def test_the_agent_may_write_its_spool_but_never_the_trusted_ca() -> None:
    spool, trust, helper_state, binary = update_defaults()
    service = unit(AGENT_UNIT)["Service"]
    writable = read_write_paths(service["ReadWritePaths"])
    states = [PurePosixPath("/var/lib") / word for word in words(service["StateDirectory"])]
    assert covered(spool, writable)
    for path in (trust, helper_state, binary):
        assert not covered(path, writable), f"the agent's unit may write {path}"
        assert not covered(path, states), f"{path} is under the agent's StateDirectory="
    config_dir = PurePosixPath(str(DEFAULT_AGENT_CONFIG)).parent
    assert not covered(config_dir, writable), "the agent may rewrite its own configuration"


def test_the_proxy_is_named_alike_everywhere_and_no_package_joins_docker() -> None:
    settings = installer_settings()
    assert settings["PROXY_SOCKET"] == str(DEFAULT_LISTEN)
    # What uninstall (and the packages' purge) remove: the unit's state directory, where a
    # one-file build unpacks itself, as DynamicUser= keeps it.
    unit_text = (ROOT / "systemd" / settings["PROXY_UNIT"]).read_text()
    state = unit_text.split("\nStateDirectory=", 1)[1].split()[0]
    expected = {f"/var/lib/{state}", f"/var/lib/private/{state}"}
    (proxy_state,) = re.findall(r'^PROXY_STATE="([^"]*)"$', INSTALLER.read_text(), re.M)
    assert set(proxy_state.split()) == expected
    assert expected <= set(render_calls()["llmgw-agent"]["purge_dirs"].split())
    unit = settings["PROXY_UNIT"]
    assert (ROOT / "systemd" / unit).is_file()
    # The packages ship the unit (not enabled) and never put the agent in the docker group.
    agent = render_calls()["llmgw-agent"]
    assert "docker" not in agent["extra_groups"].split()
    # Restarted on upgrades (it runs the package's program) and stopped on removal.
    assert agent["companion_units"] == unit
    for script in ("deb/postinst", "deb/prerm", "rpm/preun", "rpm/postun"):
        assert "$COMPANION_UNITS" in (ROOT / "packaging" / script).read_text(), script
    recipe = (ROOT / "packaging" / "nfpm-agent.yaml").read_text()
    for vendor_dir in ("/lib/systemd/system", "/usr/lib/systemd/system"):
        assert f"dst: {vendor_dir}/{unit}" in recipe
    packages_sh = (ROOT / "scripts" / "packages.sh").read_text()
    (loop,) = [line for line in packages_sh.split("\n    for unit in ")[1:2]]
    assert unit in loop.split("; do")[0]
    # The one place the installer adds the agent to docker is --docker-group's.
    text = INSTALLER.read_text()
    assert text.count("usermod -aG docker") == 1
    group_branch = text.split('if [ "$DOCKER" = group ]; then', 1)[1].split("elif", 1)[0]
    assert "usermod -aG docker" in group_branch
