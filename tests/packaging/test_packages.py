"""The llmgw-agent and llmgw-server packages (scripts/packages.sh, packaging/): what they hold,
and how they install, upgrade, are removed and purged under systemd.

The payload is the stand-in program (conftest), except in the last two tests, which package
the real one-folder build when ``dist/`` holds one: a whole node on SQLite, and the control
plane on PostgreSQL.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from llmgw.agent.config import load_agent_config
from llmgw.cli import main as llmgw_main
from llmgw.contracts.paths import PACKAGED_BUNDLE_DIR
from llmgw.errors import ConfigError
from llmgw.server.common.config import load_server_config
from llmgw.server.joining.bundles import BundleStore
from tests.ci import require_tools, unavailable
from tests.pg import PASSWORD as PG_PASSWORD
from tests.pg import ROLE as PG_ROLE
from tests.pg import Cluster

from .distcheck import DIST, Dist, version
from .pkgcheck import (
    CURRENT,
    PREVIOUS,
    ROOT,
    Container,
    Packages,
    build_packages,
    make_standin,
    run,
)

# The first container test may build the systemd image (debootstrap: 1 to 4 minutes).
pytestmark = pytest.mark.timeout(900)

# (package, its conffile, its service user, its unit)
KINDS = {
    "llmgw-agent": ("/etc/llmgw/agent.yaml", "llmgw-agent", "llmgw-agent.service"),
    "llmgw-server": ("/etc/llmgw/server.yaml", "llmgw", "llmgw-server.service"),
}
PLACEHOLDER = re.compile(r"@[A-Z_]+@")
UPDATE_UNITS = ("llmgw-agent-update.path", "llmgw-agent-update.service")
LINGER_FILE = "/var/lib/systemd/linger/llmgw-agent"
GLIBC_VERSION = re.compile(rb"GLIBC_(2\.[0-9]+(?:\.[0-9]+)?)")
AGENT_STATE = "/var/lib/llmgw-agent"
EDIT = "# edited by the package test"
ONEDIR_ENV = "LLMGW_TEST_ONEDIR"


# ---------------------------------------------------------------------------- helpers


def deb_field(deb: Path, field: str) -> str:
    return run("dpkg-deb", "--field", deb, field).stdout.strip()


def deb_listing(deb: Path) -> dict[str, tuple[str, str, str]]:
    """Path -> (mode, owner/group, symlink target) of every entry of the data archive."""
    entries = {}
    for line in run("dpkg-deb", "--contents", deb).stdout.splitlines():
        mode, owner, _size, _date, _time, rest = line.split(None, 5)
        path, _, target = rest.partition(" -> ")
        entries[path.removeprefix(".").rstrip("/") or "/"] = (mode, owner, target)
    return entries


def deb_control(deb: Path, into: Path) -> Path:
    run("dpkg-deb", "--control", deb, into)
    return into


def rpm_query(rpm: Path, *args: str) -> str:
    return run("rpm", "-qp", *args, rpm).stdout


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def glibc_floor(payload: Path) -> str | None:
    """The highest GLIBC_ symbol version any ELF file of ``payload`` refers to."""
    found: set[str] = set()
    for path in payload.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            if data[:4] == b"\x7fELF":
                found.update(m.decode() for m in GLIBC_VERSION.findall(data))
    return max(found, key=version_key) if found else None


def unit_state(c: Container, unit: str) -> tuple[str, str]:
    """(is-enabled, is-active) as systemctl prints them."""
    enabled = c.sh(f"systemctl is-enabled {unit}", check=False).stdout.strip()
    active = c.sh(f"systemctl is-active {unit}", check=False).stdout.strip()
    return enabled, active


def standin_run(c: Container, state: str, *, newer_than: int | None = None) -> dict[str, int]:
    """What the stand-in service wrote at its last start (waiting for a new pid)."""
    record = f"{state}/standin-run.json"
    c.wait_for(f"test -s {record}", f"{record} written")
    if newer_than is not None:
        c.wait_for(f"! grep -q '\"pid\": {newer_than},' {record}", f"a restart rewriting {record}")
    data: dict[str, int] = json.loads(c.out(f"cat {record}"))
    return data


def alive(c: Container, pid: int) -> bool:
    return c.sh(f"kill -0 {pid}", check=False).returncode == 0


def fake_join(c: Container) -> None:
    """What 'llmgw agent join' leaves for the unit's condition: node.crt, written as root."""
    c.sh(f"install -d -m 0700 {AGENT_STATE} && echo stand-in >{AGENT_STATE}/node.crt")


# ----------------------------------------------------------------- package contents


@pytest.mark.parametrize("name", list(KINDS))
def test_deb_holds_its_unit_and_only_its_etc_file_as_conffile(
    name: str, standin_packages: dict[str, Packages], tmp_path: Path
) -> None:
    conffile, user, unit = KINDS[name]
    deb = standin_packages[CURRENT].path(name, "deb")
    control = deb_control(deb, tmp_path / "control")
    assert (control / "conffiles").read_text().split() == [conffile]
    listing = deb_listing(deb)
    etc_files = sorted(p for p, (mode, _, _) in listing.items() if p.startswith("/etc/"))
    assert [p for p in etc_files if not listing[p][0].startswith("d")] == [conffile]
    assert listing[conffile][:2] == ("-rw-r-----", f"root/{user}")
    assert listing[f"/lib/systemd/system/{unit}"][:2] == ("-rw-r--r--", "root/root")
    run("dpkg-deb", "--extract", deb, tmp_path / "root")
    shipped = (tmp_path / "root" / "lib/systemd/system" / unit).read_text()
    assert shipped == (ROOT / "systemd" / unit).read_text()
    assert deb_field(deb, "Version") == CURRENT
    assert deb_field(deb, "Architecture") == "amd64"
    assert deb_field(deb, "Pre-Depends") == "passwd"
    sysusers = (tmp_path / "root" / "usr/lib/sysusers.d" / f"{user}.conf").read_text()
    assert f"\nu {user} - " in sysusers
    if name == "llmgw-agent":
        # The update helper's units: as in systemd/, but the helper runs the package's program.
        for helper in UPDATE_UNITS:
            assert listing[f"/lib/systemd/system/{helper}"][:2] == ("-rw-r--r--", "root/root")
        units = tmp_path / "root" / "lib/systemd/system"
        path_unit = (units / "llmgw-agent-update.path").read_text()
        assert path_unit == (ROOT / "systemd" / "llmgw-agent-update.path").read_text()
        source = (ROOT / "systemd" / "llmgw-agent-update.service").read_text()
        assert "\nExecStart=/usr/local/lib/llmgw-agent/llmgw agent " in source
        assert (units / "llmgw-agent-update.service").read_text() == source.replace(
            "\nExecStart=/usr/local/lib/llmgw-agent/llmgw ", "\nExecStart=/usr/bin/llmgw "
        )
        assert listing["/usr/lib/llmgw/llmgw"][0] == "-rwxr-xr-x"
        assert listing["/usr/bin/llmgw"][0].startswith("l")
        assert listing["/usr/bin/llmgw"][2] == "../lib/llmgw/llmgw"  # relative (Debian policy 10.5)
        # The stand-in needs no C library; the engines' sandbox is bubblewrap's.
        assert deb_field(deb, "Depends") == "bubblewrap"
    else:
        assert not any(p.startswith("/usr/lib/llmgw") for p in listing)
        assert not any("update" in p for p in listing)
        assert deb_field(deb, "Depends") == f"llmgw-agent (= {CURRENT})"


@pytest.mark.parametrize("name", list(KINDS))
def test_deb_maintainer_scripts_branch_on_their_argument(
    name: str, standin_packages: dict[str, Packages], tmp_path: Path
) -> None:
    require_tools("shellcheck")
    control = deb_control(standin_packages[CURRENT].path(name, "deb"), tmp_path / "control")
    verbs = {
        "preinst": ("install | upgrade)", "abort-upgrade)"),
        "postinst": ("configure)", "abort-upgrade | abort-remove | abort-deconfigure)"),
        "prerm": ("remove)", "upgrade | deconfigure | failed-upgrade)"),
        "postrm": ("remove)", "purge)", "upgrade | failed-upgrade"),
    }
    for script, expected in verbs.items():
        path = control / script
        text = path.read_text()
        assert path.stat().st_mode & 0o111, f"{script} is not executable"
        assert text.startswith("#!/bin/sh\n") and "set -eu" in text
        assert not PLACEHOLDER.search(text), f"{script} has an unrendered placeholder"
        assert "userdel" not in text and "deluser" not in text, "the user is never deleted"
        for verb in expected:
            assert verb in text, f"{script} does not handle {verb!r}"
        run("shellcheck", "--shell=sh", path)
        # An argument dpkg never gives is refused before anything is done.
        bogus = subprocess.run(["sh", str(path), "bogus"], capture_output=True, text=True)
        assert bogus.returncode == 1 and "unknown argument 'bogus'" in bogus.stderr
    # systemctl starts or restarts only where systemd runs; the service is never enabled or
    # started by a script, only restarted on an upgrade when it ran. The path units are
    # enabled and started on the first install (configure without a previous version).
    unit = KINDS[name][2]
    for script in ("postinst", "prerm", "postrm"):
        text = (control / script).read_text()
        assert "[ -d /run/systemd/system ] || return 0" in text
        assert not re.search(rf"systemctl (--no-reload )?(enable|start) .*{unit}", text)
    postinst = (control / "postinst").read_text()
    assert f"invoke try-restart {unit}" in postinst
    # Through init-system-helpers (policy-rc.d honoured); systemctl itself, but for
    # daemon-reload, only in the fallback function (lintian's maintainer-script-calls-systemctl
    # rule, which the package's override names).
    assert "deb-systemd-invoke" in postinst and "deb-systemd-helper enable" in postinst
    for script in ("postinst", "prerm", "postrm"):
        calls = [
            line
            for line in (control / script).read_text().splitlines()
            if re.match(r"^(?:.+;)?\s*systemctl\b", line) and "daemon-reload" not in line
        ]
        assert calls in ([], ['    systemctl "$@"']), f"{script} calls systemctl: {calls}"
    assert '[ -n "$previous" ] || enable_path_units' in postinst
    expected = "llmgw-agent-update.path" if name == "llmgw-agent" else ""
    for script in ("postinst", "prerm", "postrm"):
        assert f'PATH_UNITS="{expected}"\n' in (control / script).read_text()
    assert f"LINGER={'yes' if name == 'llmgw-agent' else 'no'}\n" in postinst


@pytest.mark.parametrize("name", list(KINDS))
def test_rpm_holds_its_unit_and_only_its_etc_file_as_conffile(
    name: str, standin_packages: dict[str, Packages], tmp_path: Path
) -> None:
    require_tools("rpm", "shellcheck")
    conffile, user, unit = KINDS[name]
    rpm = standin_packages[CURRENT].path(name, "rpm")
    assert rpm_query(rpm, "--configfiles").split() == [conffile]
    files = {}
    for line in rpm_query(
        rpm,
        "--queryformat",
        "[%{FILEMODES:perms} %{FILEUSERNAME}/%{FILEGROUPNAME} %{FILEFLAGS:fflags}. %{FILENAMES}\n]",
    ).splitlines():
        mode, owner, flags, path = line.split()
        files[path] = (mode, owner, flags.rstrip("."))
    assert files[conffile] == ("-rw-r-----", f"root/{user}", "cn")  # config(noreplace)
    assert files[f"/usr/lib/systemd/system/{unit}"] == ("-rw-r--r--", "root/root", "")
    assert not any(p.startswith("/lib/") for p in files)
    scripts = rpm_query(rpm, "--scripts")
    for scriptlet in ("preinstall", "postinstall", "preuninstall", "postuninstall"):
        assert f"{scriptlet} scriptlet (using /bin/sh)" in scripts
    assert not PLACEHOLDER.search(scripts)
    assert "userdel" not in scripts
    for tag in ("PREIN", "POSTIN", "PREUN", "POSTUN"):
        scriptlet_file = tmp_path / tag
        scriptlet_file.write_text(rpm_query(rpm, "--queryformat", f"%{{{tag}}}"))
        run("shellcheck", "--shell=sh", scriptlet_file)
    postun = rpm_query(rpm, "--queryformat", "%{POSTUN}")
    # The old package's %postun runs after the new package is in: it restarts (if running),
    # after the units that run the same program (the Docker proxy the agent reaches).
    upgrade = postun.split('if [ "$1" -ge 1 ]; then\n', 1)[1].split("\n    fi\n", 1)[0]
    assert upgrade.rstrip().splitlines()[-2].strip() == f"systemctl try-restart {unit} \\"
    requires = rpm_query(rpm, "--requires").splitlines()
    assert "shadow-utils" in requires
    if name == "llmgw-server":
        assert f"llmgw-agent = {CURRENT}" in requires
    else:
        for helper in UPDATE_UNITS:
            assert files[f"/usr/lib/systemd/system/{helper}"] == ("-rw-r--r--", "root/root", "")
        assert files["/usr/bin/llmgw"][0].startswith("l")
        assert not any(r.startswith("glibc") for r in requires)
        assert "bubblewrap" in requires


def test_packages_depend_on_the_c_library_the_build_needs(tmp_path: Path) -> None:
    """An ELF file in the build sets the glibc floor (and zlib when it links it)."""
    require_tools("dpkg-deb", "rpm")
    elf = Path("/usr/bin/gpgv")
    if not elf.exists():
        unavailable("no /usr/bin/gpgv (an ELF program to stand in for the build's libraries)")
    payload = make_standin(tmp_path / "payload", CURRENT)
    (payload / "_internal").mkdir()
    (payload / "_internal" / "helper").write_bytes(elf.read_bytes())
    build_packages(payload, tmp_path / "out")
    floor = glibc_floor(payload)
    assert floor is not None
    packages = Packages(CURRENT, tmp_path / "out")
    depends = deb_field(packages.path("llmgw-agent", "deb"), "Depends").split(", ")
    requires = rpm_query(packages.path("llmgw-agent", "rpm"), "--requires").splitlines()
    assert f"libc6 (>= {floor})" in depends
    assert f"glibc >= {floor}" in requires
    links_zlib = b"libz.so.1" in elf.read_bytes()
    assert ("zlib1g" in depends) == links_zlib
    assert ("zlib" in requires) == links_zlib


def test_packages_sh_refuses_a_version_the_program_does_not_say(tmp_path: Path) -> None:
    payload = make_standin(tmp_path / "payload", CURRENT)
    script = str(ROOT / "scripts" / "packages.sh")
    wrong = subprocess.run(
        [script, "--binary", str(payload), "--version", "9.9.9", "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 1
    assert f"is llmgw {CURRENT}, not 9.9.9" in wrong.stderr
    missing = subprocess.run(
        [script, "--binary", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1
    assert "run 'make dist' first" in missing.stderr
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------ llmgw-agent-bundles

BUNDLES = "llmgw-agent-bundles"


def served_from(directory: Path) -> dict[str, str]:
    """rid -> SHA-256 of what a control plane serves from ``directory`` as the package's."""
    return {
        b.rid: b.sha256 for b in BundleStore(directory.parent / "no-bundle-dir", directory).scan()
    }


def test_bundles_package_carries_every_bundle_where_the_control_plane_serves_them(
    standin_packages: dict[str, Packages], packages_root: Path, tmp_path: Path
) -> None:
    """llmgw-agent-bundles: arch all (noarch), no script, no conffile, the bundles beside the
    build byte for byte in PACKAGED_BUNDLE_DIR; llmgw-server recommends it, of its version."""
    require_tools("dpkg-deb", "rpm")
    current = standin_packages[CURRENT]
    deb = current.path(BUNDLES, "deb")
    assert deb_field(deb, "Architecture") == "all"
    assert deb_field(deb, "Version") == CURRENT
    assert deb_field(deb, "Depends") == ""
    assert "(linux-x64, linux-arm64)" in deb_field(deb, "Description")
    control = deb_control(deb, tmp_path / "control")
    assert sorted(p.name for p in control.iterdir()) == ["control", "md5sums"]
    names = [f"llmgw-agent-{CURRENT}-linux-{arch}.tar.gz" for arch in ("arm64", "x64")]
    listing = deb_listing(deb)
    shipped = sorted(p for p in listing if p.startswith(f"{PACKAGED_BUNDLE_DIR}/"))
    assert shipped == [f"{PACKAGED_BUNDLE_DIR}/{name}" for name in names]
    assert {listing[p][:2] for p in shipped} == {("-rw-r--r--", "root/root")}
    run("dpkg-deb", "--extract", deb, tmp_path / "root")
    packaged = tmp_path / "root" / PACKAGED_BUNDLE_DIR.relative_to("/")
    for name in names:
        assert (packaged / name).read_bytes() == (packages_root / name).read_bytes()
    # What the control plane then serves: each architecture's, with its own SHA-256.
    assert served_from(packaged) == {
        f"linux-{arch}": hashlib.sha256(
            (packages_root / f"llmgw-agent-{CURRENT}-linux-{arch}.tar.gz").read_bytes()
        ).hexdigest()
        for arch in ("x64", "arm64")
    }
    server = current.path("llmgw-server", "deb")
    assert deb_field(server, "Recommends") == f"{BUNDLES} (= {CURRENT})"

    rpm = current.path(BUNDLES, "rpm")
    assert rpm.name == f"{BUNDLES}-{CURRENT}-1.noarch.rpm"
    files = rpm_query(rpm, "--list").split()
    assert [f for f in files if f.startswith(f"{PACKAGED_BUNDLE_DIR}/")] == [
        f"{PACKAGED_BUNDLE_DIR}/{name}" for name in names
    ]
    assert rpm_query(rpm, "--scripts").strip() == ""
    assert rpm_query(rpm, "--configfiles").strip() == ""
    recommends = rpm_query(current.path("llmgw-server", "rpm"), "--recommends").split("\n")
    assert f"{BUNDLES} = {CURRENT}" in recommends


def test_packages_sh_refuses_a_missing_or_wrong_bundle_and_packages_those_asked_for(
    tmp_path: Path,
) -> None:
    """Without an architecture's bundle nothing is built, and the error names the file and
    how to build it; a bundle that SHA256SUMS does not vouch for, or that is not a bundle of
    this version, is refused; --bundle-archs packages the bundles named."""
    payload = make_standin(tmp_path / "standin", CURRENT)
    out = tmp_path / "out"
    script = [str(ROOT / "scripts" / "packages.sh"), "--binary", str(payload), "--out", str(out)]

    def packages(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*script, *args], capture_output=True, text=True, timeout=300)

    arm64 = tmp_path / f"llmgw-agent-{CURRENT}-linux-arm64.tar.gz"
    arm64.rename(tmp_path / "aside.tar.gz")
    refused = packages()
    assert refused.returncode == 1
    assert f"{arm64} (sudo make dist ARCH=arm64)" in refused.stderr, refused.stderr
    assert "--bundle-archs (make packages BUNDLE_ARCHS=x64)" in refused.stderr
    assert not out.exists()

    x64 = tmp_path / f"llmgw-agent-{CURRENT}-linux-x64.tar.gz"
    (tmp_path / "SHA256SUMS").write_text(f"{'0' * 64}  {x64.name}\n")
    refused = packages("--bundle-archs", "x64")
    assert refused.returncode == 1
    assert f"{x64} does not match its line in {tmp_path}/SHA256SUMS" in refused.stderr
    (tmp_path / "SHA256SUMS").unlink()
    (tmp_path / "aside.tar.gz").rename(arm64)
    with tarfile.open(arm64, "w:gz") as tar:
        tar.add(payload / "llmgw", "something-else/llmgw")
    refused = packages()
    assert refused.returncode == 1
    assert f"{arm64} is not an agent bundle of llmgw {CURRENT} for linux-arm64" in refused.stderr
    assert packages("--bundle-archs", "riscv64").returncode == 1
    assert not out.exists()

    made = packages("--bundle-archs", "x64")
    assert made.returncode == 0, made.stderr
    deb = Packages(CURRENT, out).path(BUNDLES, "deb")
    assert "(linux-x64)" in deb_field(deb, "Description")
    shipped = [p for p in deb_listing(deb) if p.startswith(f"{PACKAGED_BUNDLE_DIR}/")]
    assert shipped == [f"{PACKAGED_BUNDLE_DIR}/{x64.name}"]


def test_release_bundles_package_carries_both_architectures_of_make_dist(
    dist_x64: Dist, dist_arm64: Dist, tmp_path: Path
) -> None:
    """make packages from make dist's builds (x64 and arm64): the bundles package carries both
    bundles, the very files dist/SHA256SUMS lists, and a control plane serves both. One
    copyright file and SBOM cover both: the two builds bundle the same components."""
    require_tools("dpkg-deb")
    out = tmp_path / "out"
    build_packages(dist_x64.onedir, out)
    deb = Packages(version(), out).path(BUNDLES, "deb")
    run("dpkg-deb", "--extract", deb, tmp_path / "root")
    packaged = tmp_path / "root" / PACKAGED_BUNDLE_DIR.relative_to("/")
    sums = dict(
        reversed(line.split("  ", 1)) for line in (DIST / "SHA256SUMS").read_text().splitlines()
    )
    assert served_from(packaged) == {
        f"linux-{d.arch}": sums[d.bundle.name] for d in (dist_x64, dist_arm64)
    }

    def components(arch: str) -> set[tuple[str, str, str]]:
        inventory = json.loads((DIST / f".contents-{arch}.json").read_text())
        return {(c["kind"], c["name"], c["version"]) for c in inventory["components"]}

    assert components("x64") == components("arm64")


def test_shipped_agent_yaml_is_valid_once_server_is_set(tmp_path: Path) -> None:
    shipped = ROOT / "packaging" / "config" / "agent.yaml"
    with pytest.raises(ConfigError, match=r"server: is required"):
        load_agent_config(shipped)
    text = shipped.read_text()
    assert text.count("\n# server: ") == 1
    edited = tmp_path / "agent.yaml"
    edited.write_text(text.replace("\n# server: ", "\nserver: ", 1))
    result = CliRunner().invoke(llmgw_main, ["agent", "--config", str(edited), "--check"])
    assert result.exit_code == 0, result.output
    assert "ok (node " in result.output and "servers cp-1.example.net:7443" in result.output
    cfg = load_agent_config(edited)
    assert str(cfg.state_dir) == AGENT_STATE


def test_shipped_server_yaml_says_the_defaults() -> None:
    shipped = load_server_config(ROOT / "packaging" / "config" / "server.yaml")
    defaults = load_server_config(None)
    assert {**vars(shipped), "source": None} == {**vars(defaults), "source": None}


def uncommented(text: str, first: str) -> str:
    """``text`` with the commented block that starts with the line ``# FIRST`` (and goes on
    with lines indented under it) uncommented."""
    block = re.search(rf"^# {re.escape(first)}\n(?:#   .*\n)*", text, re.MULTILINE)
    assert block, f"no commented '{first}' in the shipped server.yaml"
    lines = [line.removeprefix("# ") for line in block[0].splitlines(keepends=True)]
    return text.replace(block[0], "".join(lines))


def test_shipped_server_yaml_database_lines(tmp_path: Path) -> None:
    """Its database: lines uncommented: the SQLite one is the default, the PostgreSQL one a
    control plane on PostgreSQL whose password is in a file; the lease's lines the defaults."""
    text = (ROOT / "packaging" / "config" / "server.yaml").read_text()
    defaults = load_server_config(None)
    edited = tmp_path / "server.yaml"

    edited.write_text(uncommented(text, "database: sqlite:///var/lib/llmgw/llmgw.db"))
    assert load_server_config(edited).database_location == defaults.database_location

    for first in ("database:", "lease: 8", "lease_renew: 2", "resync_interval: 5"):
        text = uncommented(text, first)
    edited.write_text(text)
    cfg = load_server_config(edited)
    assert cfg.shared_database
    assert cfg.database_location.password_file == Path("/etc/llmgw/db-password")
    assert cfg.database_location.hosts() == ["db1.example.net:5432", "db2.example.net:5432"]
    assert "password" not in cfg.database_location.conninfo
    assert (cfg.lease, cfg.lease_renew, cfg.resync_interval) == (
        defaults.lease,
        defaults.lease_renew,
        defaults.resync_interval,
    )


# ------------------------------------------------------------- under systemd (Docker)


def test_deb_install_upgrade_remove_purge(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    c = container
    previous, current = standin_packages[PREVIOUS], standin_packages[CURRENT]
    unit = "llmgw-agent.service"

    # 1. install: the user, the unit, the conffile; nothing starts without an identity
    c.sh(f"dpkg -i {previous.mounted('llmgw-agent', 'deb')}")
    user = c.out("getent passwd llmgw-agent").split(":")
    assert user[5:] == ["/nonexistent", "/usr/sbin/nologin"]
    assert c.out("stat -c '%U:%G %a' /etc/llmgw/agent.yaml") == "root:llmgw-agent 640"
    assert (
        c.out("stat -c '%U %a' /srv/llmgw/models /srv/llmgw/cache").split("\n")
        == ["llmgw-agent 755"] * 2
    )
    assert c.out("readlink -f /usr/bin/llmgw") == "/usr/lib/llmgw/llmgw"
    assert c.out("llmgw --version") == f"llmgw {PREVIOUS}"
    assert c.out(f"test -f /lib/systemd/system/{unit} && echo yes") == "yes"
    assert unit_state(c, unit) == ("disabled", "inactive")
    c.sh(f"systemctl start {unit}")
    assert unit_state(c, unit) == ("disabled", "inactive")
    assert c.out(f"systemctl show -p ConditionResult --value {unit}") == "no"

    # 2. joined and started: it runs as llmgw-agent, which now owns the state directory
    fake_join(c)
    c.sh(f"systemctl enable --now {unit}")
    first = standin_run(c, AGENT_STATE)
    assert first["version"] == PREVIOUS
    assert first["uid"] == int(user[2])
    assert first["tmpdir"] == f"{AGENT_STATE}-tmp"  # beside the state tree, not in it
    assert c.out(f"stat -c '%U %a' {AGENT_STATE} {AGENT_STATE}/node.crt").split("\n") == [
        "llmgw-agent 700",
        "llmgw-agent 644",
    ]
    engine = first["engine_pid"]
    assert alive(c, engine)
    c.sh(f"echo '{EDIT}' >>/etc/llmgw/agent.yaml")

    # 3. upgrade N-1 -> N: the edit kept, still enabled, restarted, the engine untouched
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert c.out("tail -n 1 /etc/llmgw/agent.yaml") == EDIT
    assert c.out("ls /etc/llmgw") == "agent.yaml"
    assert unit_state(c, unit) == ("enabled", "active")
    second = standin_run(c, AGENT_STATE, newer_than=first["pid"])
    assert second["version"] == CURRENT and second["pid"] != first["pid"]
    assert second["engine_pid"] == engine and alive(c, engine)

    # 4. an upgrade never starts or enables what was stopped or disabled
    c.sh(f"systemctl stop {unit}")
    assert alive(c, engine), "KillMode=process: a stop leaves the engines running"
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert unit_state(c, unit) == ("enabled", "inactive")
    c.sh(f"systemctl disable {unit}")
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert unit_state(c, unit) == ("disabled", "inactive")

    # 5. remove: stopped, its engines ended; config, state, user and enablement kept
    c.sh(f"systemctl enable --now {unit}")
    standin_run(c, AGENT_STATE, newer_than=second["pid"])
    c.sh("dpkg -r llmgw-agent")
    assert c.sh(f"systemctl is-active {unit}", check=False).stdout.strip() == "inactive"
    c.wait_for(f"! kill -0 {engine}", "the engine ended by the removal")
    assert c.out("tail -n 1 /etc/llmgw/agent.yaml") == EDIT
    assert c.out(f"ls {AGENT_STATE}/node.crt /etc/systemd/system/multi-user.target.wants/{unit}")
    assert c.out("getent passwd llmgw-agent")
    assert c.sh("test -e /usr/bin/llmgw", check=False).returncode == 1

    # 6. purge: configuration, state and enablement gone; the user stays
    c.sh("dpkg -P llmgw-agent")
    for gone in ("/etc/llmgw", AGENT_STATE, f"/etc/systemd/system/multi-user.target.wants/{unit}"):
        assert c.sh(f"test -e {gone}", check=False).returncode == 1, f"{gone} is left"
    assert c.out("getent passwd llmgw-agent").startswith("llmgw-agent:")
    assert c.out("ls -d /srv/llmgw/models") == "/srv/llmgw/models"  # data is never removed


def groups_of(c: Container, user: str) -> list[str]:
    return c.out(f"id -nG {user}").split()


def test_deb_agent_update_path_unit_no_docker_group_and_linger(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    """With a docker group and logind: the user does not join docker (root on the host; the
    proxy's unit is shipped, disabled), lingers (logind's record), and
    the update path unit is enabled, watches the spool and starts the helper; upgrades keep
    the path unit's state; remove keeps lingering and the membership, purge ends lingering."""
    c = container
    previous, current = standin_packages[PREVIOUS], standin_packages[CURRENT]
    path_unit, helper = UPDATE_UNITS
    c.sh("groupadd --system docker")
    c.wait_for("systemctl is-active --quiet systemd-logind", "systemd-logind running")

    c.sh(f"dpkg -i {previous.mounted('llmgw-agent', 'deb')}")
    assert "docker" not in groups_of(c, "llmgw-agent")
    assert unit_state(c, "llmgw-docker-proxy.service") == ("disabled", "inactive")
    assert c.out(f"test -f {LINGER_FILE} && echo yes") == "yes"
    assert c.out("loginctl show-user llmgw-agent -p Linger --value") == "yes"
    assert unit_state(c, path_unit) == ("enabled", "active")
    assert unit_state(c, helper) == ("static", "inactive")
    assert c.out(f"systemctl show -p ExecStart --value {helper}").startswith(
        "{ path=/usr/bin/llmgw ; argv[]=/usr/bin/llmgw agent update-apply ;"
    )
    assert unit_state(c, "llmgw-agent.service") == ("disabled", "inactive")

    # The path unit fires on a spooled request (the stand-in cannot apply one: a drop-in makes
    # the helper move it aside, as the real helper does first).
    c.sh(
        f"mkdir -p /etc/systemd/system/{helper}.d && printf '%s\\n' '[Service]' 'ExecStart=' "
        "'ExecStart=/bin/mv /var/lib/llmgw-agent/update/request /var/lib/llmgw-agent/update/seen' "
        f">/etc/systemd/system/{helper}.d/test.conf && systemctl daemon-reload"
    )
    c.sh("install -d -m 0700 /var/lib/llmgw-agent/update && mkdir /var/lib/llmgw-agent/update/.new")
    c.sh("mv /var/lib/llmgw-agent/update/.new /var/lib/llmgw-agent/update/request")
    c.wait_for("test -d /var/lib/llmgw-agent/update/seen", "the helper started by the path unit")
    assert c.sh("test -e /var/lib/llmgw-agent/update/request", check=False).returncode == 1
    assert unit_state(c, path_unit) == ("enabled", "active")

    # Upgrades: the path unit stays as it was, enabled and watching or disabled and stopped.
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert unit_state(c, path_unit) == ("enabled", "active")
    c.sh(f"systemctl disable --now {path_unit}")
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert unit_state(c, path_unit) == ("disabled", "inactive")
    c.sh(f"systemctl enable --now {path_unit}")

    # Remove: the path unit stopped but still enabled; lingering and membership kept.
    c.sh("dpkg -r llmgw-agent")
    assert c.sh(f"systemctl is-active {path_unit}", check=False).stdout.strip() == "inactive"
    assert c.out(f"ls /etc/systemd/system/paths.target.wants/{path_unit}")
    assert c.out(f"test -f {LINGER_FILE} && echo yes") == "yes"
    assert "docker" not in groups_of(c, "llmgw-agent")

    # Purge: lingering off, the path unit's enablement and the helper's state gone.
    c.sh("install -d -m 0700 /var/lib/llmgw-update /etc/llmgw/update")
    c.sh("dpkg -P llmgw-agent")
    for gone in (
        LINGER_FILE,
        f"/etc/systemd/system/paths.target.wants/{path_unit}",
        "/var/lib/llmgw-update",
        "/etc/llmgw",
    ):
        assert c.sh(f"test -e {gone}", check=False).returncode == 1, f"{gone} is left"
    assert c.out("loginctl show-user llmgw-agent -p Linger --value 2>/dev/null || echo no") == "no"
    assert c.out("getent passwd llmgw-agent").startswith("llmgw-agent:")


def test_deb_agent_without_docker_group_or_logind(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    """No docker group: the user joins none (nor once one exists and the package is configured
    again: docker is root on the host); no logind: lingering is its file under
    /var/lib/systemd/linger."""
    c = container
    current = standin_packages[CURRENT]
    c.sh("systemctl mask --now systemd-logind.service")
    assert c.sh("getent group docker", check=False).returncode == 2
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert groups_of(c, "llmgw-agent") == ["llmgw-agent"]
    assert c.out(f"stat -c '%U %a' {LINGER_FILE}") == "root 644"
    assert unit_state(c, UPDATE_UNITS[0]) == ("enabled", "active")

    c.sh("groupadd --system docker")
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert groups_of(c, "llmgw-agent") == ["llmgw-agent"]

    c.sh("dpkg -P llmgw-agent")
    assert c.sh(f"test -e {LINGER_FILE}", check=False).returncode == 1


def test_deb_server_upgrade_and_purge(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    c = container
    previous, current = standin_packages[PREVIOUS], standin_packages[CURRENT]
    unit = "llmgw-server.service"
    c.sh(
        f"dpkg -i {previous.mounted('llmgw-agent', 'deb')} "
        f"{previous.mounted('llmgw-server', 'deb')}"
    )
    uid = c.out("id -u llmgw")
    assert c.out("stat -c '%U:%G %a' /etc/llmgw/server.yaml") == "root:llmgw 640"
    assert unit_state(c, unit) == ("disabled", "inactive")
    c.sh(f"systemctl enable --now {unit}")
    first = standin_run(c, "/var/lib/llmgw")
    assert (first["version"], first["uid"]) == (PREVIOUS, int(uid))
    assert c.out("stat -c '%U %a' /var/lib/llmgw") == "llmgw 700"
    c.sh(f"echo '{EDIT}' >>/etc/llmgw/server.yaml")

    c.sh(
        f"dpkg -i {current.mounted('llmgw-agent', 'deb')} {current.mounted('llmgw-server', 'deb')}"
    )
    assert unit_state(c, unit) == ("enabled", "active")
    assert standin_run(c, "/var/lib/llmgw", newer_than=first["pid"])["version"] == CURRENT
    assert c.out("tail -n 1 /etc/llmgw/server.yaml") == EDIT

    c.sh("dpkg -P llmgw-server")
    assert unit_state(c, unit)[1] == "inactive"
    assert c.out("ls /etc/llmgw") == "agent.yaml"  # the agent's conffile is not the server's
    assert c.sh("test -e /var/lib/llmgw", check=False).returncode == 1
    assert c.out("getent passwd llmgw").startswith("llmgw:")


def test_rpm_install_upgrade_erase(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    """rpm's scriptlets, run by rpm itself (Debian's rpm, without dependencies)."""
    c = container
    previous, current = standin_packages[PREVIOUS], standin_packages[CURRENT]
    unit = "llmgw-agent.service"
    rpm = "rpm --nodeps --force-debian"

    c.sh(f"{rpm} -i {previous.mounted('llmgw-agent', 'rpm')}")
    assert c.out("getent passwd llmgw-agent").endswith(":/nonexistent:/usr/sbin/nologin")
    assert c.out("stat -c '%U:%G %a' /etc/llmgw/agent.yaml") == "root:llmgw-agent 640"
    assert c.out(f"test -f /usr/lib/systemd/system/{unit} && echo yes") == "yes"
    assert unit_state(c, unit) == ("disabled", "inactive")
    assert unit_state(c, UPDATE_UNITS[0]) == ("enabled", "active")
    assert c.out(f"test -f {LINGER_FILE} && echo yes") == "yes"

    fake_join(c)
    c.sh(f"systemctl enable --now {unit}")
    first = standin_run(c, AGENT_STATE)
    c.sh(f"echo '{EDIT}' >>/etc/llmgw/agent.yaml")

    # The old %postun restarts the new version, after the new package is in.
    c.sh(f"{rpm} -U {current.mounted('llmgw-agent', 'rpm')}")
    assert unit_state(c, unit) == ("enabled", "active")
    second = standin_run(c, AGENT_STATE, newer_than=first["pid"])
    assert second["version"] == CURRENT
    assert second["engine_pid"] == first["engine_pid"] and alive(c, first["engine_pid"])
    assert c.out("tail -n 1 /etc/llmgw/agent.yaml") == EDIT

    c.sh(f"systemctl stop {unit}")
    c.sh(f"{rpm} -U --replacepkgs {current.mounted('llmgw-agent', 'rpm')}")
    assert unit_state(c, unit) == ("enabled", "inactive")

    # Erase: disabled, stopped, engines ended; the edited config kept as .rpmsave.
    c.sh(f"systemctl start {unit}")
    c.sh("rpm -e llmgw-agent")
    assert c.sh(f"systemctl is-active {unit}", check=False).stdout.strip() == "inactive"
    assert c.sh(
        f"test -e /etc/systemd/system/multi-user.target.wants/{unit}", check=False
    ).returncode
    c.wait_for(f"! kill -0 {first['engine_pid']}", "the engine ended by the erase")
    assert c.sh(f"systemctl is-enabled {UPDATE_UNITS[0]}", check=False).returncode != 0
    assert c.sh(f"systemctl is-active {UPDATE_UNITS[0]}", check=False).stdout.strip() != "active"
    assert c.out("tail -n 1 /etc/llmgw/agent.yaml.rpmsave") == EDIT
    assert c.out("getent passwd llmgw-agent").startswith("llmgw-agent:")


def test_rpm_first_install_follows_the_preset_policy(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    """%post applies presets, not an unconditional enable: the package's own preset enables
    the update trigger, and an administrator's preset that disables it wins."""
    c = container
    current = standin_packages[CURRENT]
    rpm = "rpm --nodeps --force-debian"
    c.sh("mkdir -p /etc/systemd/system-preset")
    c.sh(f"echo 'disable {UPDATE_UNITS[0]}' >/etc/systemd/system-preset/10-site.preset")
    c.sh(f"{rpm} -i {current.mounted('llmgw-agent', 'rpm')}")
    assert c.out("ls /usr/lib/systemd/system-preset/80-llmgw-agent.preset")
    assert unit_state(c, UPDATE_UNITS[0]) == ("disabled", "inactive")
    assert unit_state(c, "llmgw-agent.service") == ("disabled", "inactive")
    c.sh("rpm -e llmgw-agent && rm /etc/systemd/system-preset/10-site.preset")
    # Debian's own default policy is 'enable *': the package's preset keeps the service off.
    c.sh(f"{rpm} -i {current.mounted('llmgw-agent', 'rpm')}")
    assert unit_state(c, UPDATE_UNITS[0]) == ("enabled", "active")
    assert unit_state(c, "llmgw-agent.service") == ("disabled", "inactive")
    assert unit_state(c, "llmgw-docker-proxy.service")[0] == "disabled"


HELPER_STATE = "/var/lib/systemd/deb-systemd-helper-enabled"


def test_deb_policy_rc_d_101_installs_without_starting_anything(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    """An image build's policy-rc.d (exit 101) keeps every unit stopped during the install;
    the enablement is in place for the machine that boots the image."""
    c = container
    current = standin_packages[CURRENT]
    c.sh(
        "printf '#!/bin/sh\\nexit 101\\n' >/usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d"
    )
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert unit_state(c, UPDATE_UNITS[0]) == ("enabled", "inactive")
    assert unit_state(c, "llmgw-agent.service") == ("disabled", "inactive")
    # deb-systemd-helper recorded what it enabled (purge removes exactly that).
    assert UPDATE_UNITS[0] in c.out(f"ls {HELPER_STATE}")
    c.sh("rm /usr/sbin/policy-rc.d")
    c.sh(f"systemctl start {UPDATE_UNITS[0]}")
    assert unit_state(c, UPDATE_UNITS[0]) == ("enabled", "active")
    c.sh("dpkg -P llmgw-agent")
    assert "llmgw" not in c.sh(f"ls -R {HELPER_STATE}", check=False).stdout
    assert c.sh(f"ls /etc/systemd/system/*.wants/{UPDATE_UNITS[0]}", check=False).returncode != 0


def test_deb_without_init_system_helpers_falls_back_to_systemctl(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    """Where init-system-helpers is missing, the scripts do the same with systemctl."""
    c = container
    current = standin_packages[CURRENT]
    for helper in ("deb-systemd-helper", "deb-systemd-invoke"):
        c.sh(f"mv /usr/bin/{helper} /usr/bin/{helper}.away")
    c.sh(f"dpkg -i {current.mounted('llmgw-agent', 'deb')}")
    assert unit_state(c, UPDATE_UNITS[0]) == ("enabled", "active")
    assert unit_state(c, "llmgw-agent.service") == ("disabled", "inactive")
    c.sh("dpkg -r llmgw-agent")
    assert c.sh(f"systemctl is-active {UPDATE_UNITS[0]}", check=False).stdout.strip() != "active"
    c.sh("dpkg -P llmgw-agent")
    assert c.sh(f"ls /etc/systemd/system/*.wants/{UPDATE_UNITS[0]}", check=False).returncode != 0


# ------------------------------------------------------------ the real one-folder build


def real_onedir() -> Path:
    """$LLMGW_TEST_ONEDIR, else dist/llmgw-onedir-ARCH: the one-folder build 'make dist' makes."""
    arch = {"x86_64": "x64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    given = os.environ.get(ONEDIR_ENV)
    onedir = Path(given) if given else ROOT / "dist" / f"llmgw-onedir-{arch}"
    if not (onedir / "llmgw").is_file():
        if given:
            pytest.fail(f"${ONEDIR_ENV} is {given}, which holds no llmgw program")
        unavailable(f"no one-folder build at {onedir}; 'make dist' makes it")
    return onedir


@pytest.fixture(scope="module")
def real_packages(packages_root: Path) -> tuple[Path, Packages]:
    """The one-folder build, and its packages (built once for the tests that install them)."""
    onedir = real_onedir()
    out = packages_root / "real"
    build_packages(onedir, out, bundle_archs="x64")
    said = run(onedir / "llmgw", "--version").stdout.strip()
    return onedir, Packages(said.removeprefix("llmgw "), out)


def test_real_onedir_build_packages_and_runs_under_the_units(
    container: Container, real_packages: tuple[Path, Packages]
) -> None:
    """The real program, packaged: its glibc floor, then a whole node in the container: the
    control plane under llmgw-server.service, a node joined the way agent.yaml says, its
    agent READY under the hardened llmgw-agent.service, a sim engine answering through the
    gateway, and the engine kept across an agent restart."""
    onedir, packages = real_packages
    said = f"llmgw {packages.version}"
    floor = glibc_floor(onedir)
    assert floor is not None, "a PyInstaller build links the C library"
    depends = deb_field(packages.path("llmgw-agent", "deb"), "Depends").split(", ")
    assert f"libc6 (>= {floor})" in depends

    c = container
    c.sh(
        f"dpkg -i {packages.mounted('llmgw-agent', 'deb')} "
        f"{packages.mounted('llmgw-server', 'deb')}"
    )
    assert c.out("llmgw --version") == said
    verify = c.sh(
        "systemd-analyze verify /lib/systemd/system/llmgw-agent.service "
        "/lib/systemd/system/llmgw-server.service 2>&1"
    )
    assert verify.stdout == ""

    # The control plane, under its unit.
    c.sh("systemctl enable --now llmgw-server.service")
    c.wait_for(python_get("http://127.0.0.1:8080/healthz"), "llmgw server /healthz", 60)
    assert c.out("stat -c '%U %a' /var/lib/llmgw") == "llmgw 700"

    # The node: step 1 of agent.yaml (server), then the join command ctl prints.
    c.sh(
        "sed -i -e 's/^# server: .*/server: 127.0.0.1:7443/' "
        "-e 's/^# node_id: .*/node_id: pkg-node/' /etc/llmgw/agent.yaml"
    )
    c.sh("llmgw agent --check")
    command = json.loads(
        c.out("llmgw ctl --json join-command --node pkg-node --address 127.0.0.1")
    )["command"]
    c.sh(command)
    c.sh("systemctl enable --now llmgw-agent.service")  # returns once READY=1 came
    assert unit_state(c, "llmgw-agent.service") == ("enabled", "active")
    assert c.out(f"stat -c '%U' {AGENT_STATE}/node.key") == "llmgw-agent"
    status = c.out("systemctl show -p StatusText --value llmgw-agent.service")
    assert status.startswith("connected to 127.0.0.1:7443")

    # Work: approved, a sim replica, one chat completion through the gateway.
    (node,) = json.loads(c.out("llmgw ctl --json nodes"))
    c.sh(f"llmgw ctl approve pkg-node --fingerprint {node['fingerprint']}")
    c.sh("llmgw ctl deploy m1 --engine sim --replicas 1")
    c.wait_for('llmgw ctl --json replicas m1 | grep -q \'"state": "ready"\'', "m1 ready", 60)
    (replica,) = json.loads(c.out("llmgw ctl --json replicas m1"))
    key = json.loads(c.out("llmgw ctl --json keys create package-test"))["key"]
    c.sh(python_chat(key, "m1"))

    # The engine outlives an agent restart (KillMode=process) and is adopted.
    c.sh("systemctl restart llmgw-agent.service")
    c.wait_for('llmgw ctl --json replicas m1 | grep -q \'"state": "ready"\'', "m1 adopted", 60)
    (after,) = json.loads(c.out("llmgw ctl --json replicas m1"))
    assert (after["pid"], after["restarts"]) == (replica["pid"], 0)
    c.sh(python_chat(key, "m1"))


def test_real_onedir_package_runs_the_control_plane_on_postgresql(
    systemd_image: str,
    packages_root: Path,
    real_packages: tuple[Path, Packages],
    pg_cluster: Cluster,
) -> None:
    """The same unit, unchanged, with server.yaml's database: on PostgreSQL: the packaged
    program leads on a database of the session's cluster (tests/pg.py) under the hardened
    llmgw-server.service, and gives the lease up when the unit stops. The container has no
    network but its loopback: it reaches the cluster through its Unix socket, mounted in."""
    _onedir, packages = real_packages
    database = pg_cluster.fresh_database()
    socket_dir = "/srv/llmgw-test-pg"
    url = f"postgresql://{PG_ROLE}@/{database}?host={socket_dir}&port={pg_cluster.port}"
    config = {
        "instance_id": "pkg-1",
        "database": {"url": url, "password_file": "/etc/llmgw/db-password"},
    }

    c = Container.boot(systemd_image, packages_root, also=[(pg_cluster.sockets, socket_dir)])
    try:
        c.sh(
            f"dpkg -i {packages.mounted('llmgw-agent', 'deb')} "
            f"{packages.mounted('llmgw-server', 'deb')}"
        )
        c.sh(f"printf '%s\\n' {shlex.quote(PG_PASSWORD)} >/etc/llmgw/db-password")
        c.sh("chown root:llmgw /etc/llmgw/db-password && chmod 0640 /etc/llmgw/db-password")
        c.sh(f"printf '%s' {shlex.quote(yaml.safe_dump(config))} >/etc/llmgw/server.yaml")
        c.sh("systemctl enable --now llmgw-server.service")
        c.wait_for(python_get("http://127.0.0.1:8080/healthz"), "llmgw server /healthz", 60)
        journal = c.out("journalctl --no-pager -o cat -u llmgw-server.service")
        assert "control plane started" in journal, journal
        assert "standby" not in journal, journal
        lease = "SELECT holder, epoch, expires_at > 0 FROM leader_lease"
        assert pg_cluster.psql(lease, database).strip() == "pkg-1|1|t"
        # Stopped, it gives the lease up (expired at once) for a standby to take.
        c.sh("systemctl stop llmgw-server.service")
        assert pg_cluster.psql(lease, database).strip() == "pkg-1|1|f"
        assert c.sh("systemctl is-failed llmgw-server.service", check=False).returncode != 0
    finally:
        c.remove()


def python_get(url: str) -> str:
    return f"python3 -c \"import urllib.request as u; u.urlopen('{url}', timeout=2)\""


def python_chat(key: str, model: str) -> str:
    """A shell command: one chat completion through the gateway, failing unless answered."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}]})
    code = (
        "import json, sys, urllib.request as u; "
        "r = u.Request('http://127.0.0.1:8080/v1/chat/completions', data=sys.argv[2].encode(), "
        "headers={'Authorization': 'Bearer ' + sys.argv[1], 'Content-Type': 'application/json'}); "
        "assert json.load(u.urlopen(r, timeout=10))['choices'][0]['message']['content']"
    )
    return f"python3 -c {shlex.quote(code)} {shlex.quote(key)} {shlex.quote(body)}"
