"""The systemd units (systemd/): the settings llmgw relies on, tied to the code's own defaults;
``systemd-analyze verify`` without a word of output; the ``security`` exposure they reach.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llmgw.agent.config import DEFAULT_CACHE_ROOT, DEFAULT_MODELS_ROOT
from llmgw.agent.service import DRAIN_TIMEOUT
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG, DEFAULT_SERVER_CONFIG
from llmgw.contracts.paths import DEFAULT_AGENT_STATE_DIR as AGENT_STATE_DIR
from llmgw.contracts.paths import DEFAULT_SERVER_STATE_DIR as SERVER_STATE_DIR
from llmgw.server.common.config import DEFAULT_DRAIN_GRACE, DEFAULT_DRAIN_TIMEOUT
from tests.ci import require_tools

from .pkgcheck import CURRENT, UNITS, Container, Packages, run, stand_in_units, unit_files

# The worst exposure each unit may reach (systemd-analyze security: 0 best, 10 worst); the
# agent pays for GPU devices, JIT engines, engines that outlive it, and the namespaces and
# mounts of the engines' bubblewrap sandbox (issue 36: it must stay at or below 3.0).
MAX_EXPOSURE = {
    "llmgw-agent.service": 3.0,
    "llmgw-server.service": 1.5,
    # Root, and runs the installer: it writes the binary, units and configuration.
    "llmgw-agent-update.service": 3.0,
    # A unix socket in, one out; its user is made at start.
    "llmgw-docker-proxy.service": 1.0,
}
HARDENING = {
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "ProtectSystem": "strict",
    "PrivateTmp": "yes",
    "PrivateMounts": "yes",
    "ProtectHome": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectHostname": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "SystemCallArchitectures": "native",
    "SystemCallErrorNumber": "EPERM",
}
# What GPU engines rule out in the agent's unit, each with the reason its comment gives.
AGENT_WITHOUT = {
    "PrivateDevices": "PrivateDevices= hides them",
    "DeviceAllow": "a DeviceAllow= list",
    "DevicePolicy": "DevicePolicy=",
    "ProtectClock": "ProtectClock= is left out",
    "MemoryDenyWriteExecute": "generate code at run time",
    "RemoveIPC": "POSIX shared memory",
    "PrivateUsers": "need the real user",
    "ProcSubset": "/proc/meminfo",
}


def parse_unit(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` -> its values in order (a key may be given more than once)."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"{path.name}: keep settings on one line: {line}"
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a setting: {line}"
        settings.setdefault(f"{section}.{key}", []).append(value)
    return settings


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key)
    assert values is not None and len(values) == 1, f"{key}: {values}"
    return values[0]


def test_every_service_has_an_exposure_budget() -> None:
    services = {p.name for p in unit_files() if p.suffix == ".service"}
    assert {"llmgw-agent.service", "llmgw-server.service"} <= services
    missing = services - set(MAX_EXPOSURE)
    assert not missing, f"give {sorted(missing)} a budget in MAX_EXPOSURE"


def test_agent_unit() -> None:
    unit = UNITS / "llmgw-agent.service"
    s = parse_unit(unit)
    text = unit.read_text()
    assert one(s, "Service.Type") == "notify"
    assert one(s, "Service.NotifyAccess") == "all"  # a one-file build's child notifies
    assert one(s, "Service.User") == one(s, "Service.Group") == "llmgw-agent"
    assert one(s, "Service.ExecStart") == f"/usr/bin/llmgw agent --config {DEFAULT_AGENT_CONFIG}"
    assert one(s, "Unit.ConditionPathExists") == str(AGENT_STATE_DIR / "node.crt")
    assert one(s, "Service.KillMode") == "process"
    assert one(s, "Service.Restart") == "on-failure"
    assert int(one(s, "Service.WatchdogSec")) > 0
    assert float(one(s, "Service.TimeoutStopSec")) > DRAIN_TIMEOUT
    state_dirs = one(s, "Service.StateDirectory").split()
    assert Path("/var/lib", state_dirs[0]) == AGENT_STATE_DIR
    assert one(s, "Service.StateDirectoryMode") == "0700"
    tmpdir = one(s, "Service.Environment").removeprefix("TMPDIR=")
    assert Path(tmpdir).relative_to("/var/lib").as_posix() in state_dirs
    # The temporary directory is a sibling, not inside the state directory (root manages no
    # path inside a tree the agent owns).
    assert Path(tmpdir).parent == AGENT_STATE_DIR.parent
    assert one(s, "Service.LimitMEMLOCK") == "infinity"
    writable = " ".join(s["Service.ReadWritePaths"]).split()
    assert str(AGENT_STATE_DIR) in writable
    data_root = DEFAULT_MODELS_ROOT.parent
    assert DEFAULT_CACHE_ROOT.parent == data_root
    assert f"-{data_root}" in writable  # optional: a node may keep its models elsewhere
    # bubblewrap, the engines' sandbox, needs four namespaces and its mount calls, no more.
    sandbox = {"RestrictNamespaces": "user mnt pid ipc"}
    for key, value in {**HARDENING, **sandbox}.items():
        assert one(s, f"Service.{key}") == value, key
    assert s["Service.SystemCallFilter"] == [
        "@system-service @mount pidfd_getfd",
        "~@privileged",
        "capset chroot pivot_root",
    ]
    # An uncovered proc mount, so that bwrap may mount each sandbox a fresh /proc, and the
    # user.* limits it sets in each sandbox's user namespace (--disable-userns).
    assert one(s, "Service.BindPaths") == "/proc:/run/llmgw-agent/proc:norbind"
    assert s["Service.ReadWritePaths"][1:] == ["/proc/sys/user"]
    for words in ("bubblewrap", "RestrictNamespaces=user mnt pid ipc", "uncovered"):
        assert words in text, words
    for key, reason in AGENT_WITHOUT.items():
        assert f"Service.{key}" not in s, f"{key}= would break GPU engines"
        assert reason in text, f"the unit does not say why it has no {key}="
    assert one(s, "Install.WantedBy") == "multi-user.target"


def test_server_unit() -> None:
    unit = UNITS / "llmgw-server.service"
    s = parse_unit(unit)
    # 'llmgw server' sends no READY=1: notify would time out the start.
    assert one(s, "Service.Type") == "exec"
    assert one(s, "Service.User") == one(s, "Service.Group") == "llmgw"
    assert one(s, "Service.ExecStart") == f"/usr/bin/llmgw server --config {DEFAULT_SERVER_CONFIG}"
    state_dirs = one(s, "Service.StateDirectory").split()
    assert Path("/var/lib", state_dirs[0]) == SERVER_STATE_DIR
    assert one(s, "Service.StateDirectoryMode") == "0700"
    tmpdir = one(s, "Service.Environment").removeprefix("TMPDIR=")
    assert Path(tmpdir).relative_to("/var/lib").as_posix() in state_dirs
    assert one(s, "Service.ReadWritePaths") == str(SERVER_STATE_DIR)
    for key, value in {
        **HARDENING,
        "PrivateDevices": "yes",
        "ProtectClock": "yes",
        "RemoveIPC": "yes",
    }.items():
        assert one(s, f"Service.{key}") == value, key
    assert s["Service.SystemCallFilter"] == ["@system-service", "~@privileged @resources"]
    assert one(s, "Install.WantedBy") == "multi-user.target"
    # A stop's drain (llmgw.server.ha.drain) ends before systemd's SIGKILL.
    assert float(one(s, "Service.TimeoutStopSec")) > DEFAULT_DRAIN_GRACE + DEFAULT_DRAIN_TIMEOUT
    # Either store: the network for a remote PostgreSQL, after a local one (ordering only:
    # nothing that would pull PostgreSQL into a machine on SQLite, or fail without it).
    assert one(s, "Unit.Wants") == "network-online.target"
    assert one(s, "Unit.After").split() == ["network-online.target", "postgresql.service"]
    for key in ("Requires", "Requisite", "BindsTo", "PartOf"):
        assert f"Unit.{key}" not in s, key


def test_update_helper_units() -> None:
    from llmgw.contracts.update_order import DEFAULT_SPOOL, REQUEST
    from llmgw.updater.apply import DEFAULT_INSTALLED_BINARY, DEFAULT_STATE

    path = parse_unit(UNITS / "llmgw-agent-update.path")
    request = DEFAULT_SPOOL / REQUEST
    assert DEFAULT_SPOOL.parent == AGENT_STATE_DIR
    assert one(path, "Path.PathExists") == str(request)
    assert one(path, "Path.Unit") == "llmgw-agent-update.service"
    assert one(path, "Install.WantedBy") in ("paths.target", "multi-user.target")
    # A flood of spooled requests must not trip a start limit and leave the path unit failed
    # (updates blocked until the next install): no start limit on either unit.
    assert one(path, "Unit.StartLimitIntervalSec") == "0"

    s = parse_unit(UNITS / "llmgw-agent-update.service")
    assert one(s, "Service.Type") == "oneshot"
    assert "Service.User" not in s  # root: it replaces the agent's binary and units
    assert one(s, "Service.ExecStart") == f"{DEFAULT_INSTALLED_BINARY} agent update-apply"
    assert one(s, "Unit.ConditionPathExists") == str(request)
    assert one(s, "Unit.StartLimitIntervalSec") == "0"
    # The helper renames the request from the agent's spool into its own state: both must
    # be on one mount inside the unit's namespace (rename(2) fails across mount points), so
    # no StateDirectory= (a mount of its own) and one writable path above both.
    assert "Service.StateDirectory" not in s
    writable = {p.lstrip("-") for p in one(s, "Service.ReadWritePaths").split()}
    assert writable == {
        str(DEFAULT_INSTALLED_BINARY.parent),
        "/etc/systemd/system",
        "/etc/llmgw",
        "/var/lib",
    }
    assert DEFAULT_STATE.parent == DEFAULT_SPOOL.parent.parent == Path("/var/lib")
    # The installer waits up to 180 s for the new agent, then maybe as long for a rollback.
    assert int(one(s, "Service.TimeoutStartSec")) > 2 * 180
    for key, value in {**HARDENING, "PrivateDevices": "yes", "ProtectClock": "yes"}.items():
        if key == "CapabilityBoundingSet":
            continue
        assert one(s, f"Service.{key}") == value, key
    caps = set(one(s, "Service.CapabilityBoundingSet").split())
    assert caps and not caps & {
        "CAP_SYS_ADMIN",
        "CAP_NET_ADMIN",
        "CAP_SYS_MODULE",
        "CAP_SYS_PTRACE",
    }
    assert one(s, "Service.SystemCallFilter") == "@system-service"


def test_docker_proxy_unit() -> None:
    from llmgw.agent.dockerproxy import DEFAULT_LISTEN

    s = parse_unit(UNITS / "llmgw-docker-proxy.service")
    assert one(s, "Service.Type") == "notify"
    assert one(s, "Service.NotifyAccess") == "all"
    assert one(s, "Service.ExecStart") == (
        f"/usr/bin/llmgw agent docker-proxy --listen {DEFAULT_LISTEN} --group llmgw-agent"
    )
    # Not root and not the agent: a user of its own, in docker's group and the agent's (to
    # give the socket to that group).
    assert one(s, "Service.DynamicUser") == "yes"
    assert "Service.User" not in s
    assert one(s, "Service.SupplementaryGroups").split() == ["docker", "llmgw-agent"]
    assert Path("/run", one(s, "Service.RuntimeDirectory")) == DEFAULT_LISTEN.parent
    tmpdir = one(s, "Service.Environment").removeprefix("TMPDIR=")
    assert Path(tmpdir) == Path("/var/lib", one(s, "Service.StateDirectory"))
    assert one(s, "Unit.Requires") == one(s, "Unit.After") == "docker.service"
    assert one(s, "Unit.Before") == "llmgw-agent.service"
    for key, value in {
        **HARDENING,
        "RestrictAddressFamilies": "AF_UNIX",
        "PrivateDevices": "yes",
        "PrivateNetwork": "yes",
        "IPAddressDeny": "any",
        "ProcSubset": "pid",
    }.items():
        assert one(s, f"Service.{key}") == value, key
    assert s["Service.SystemCallFilter"] == [
        "@system-service",
        "~@privileged @resources",
        "chown fchownat",  # the socket's group (test_docker_proxy_unit.py fails without it)
    ]
    assert one(s, "Install.WantedBy") == "multi-user.target"


def test_systemd_analyze_verify_says_nothing(tmp_path: Path) -> None:
    require_tools("systemd-analyze")
    # verify exits 0 on unknown keys and bad values: any output is a failure.
    result = run("systemd-analyze", "verify", *stand_in_units(tmp_path))
    assert result.stdout + result.stderr == ""


def test_security_exposure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_tools("systemd-analyze")
    for copy in stand_in_units(tmp_path):
        if copy.suffix != ".service":
            continue
        report = run("systemd-analyze", "security", "--offline=true", "--no-pager", copy).stdout
        match = re.search(rf"Overall exposure level for {re.escape(copy.name)}: ([0-9.]+)", report)
        assert match, report
        exposure = float(match.group(1))
        with capsys.disabled():
            print(f"\nsystemd-analyze security --offline=true {copy.name}: exposure {exposure}")
        assert exposure <= MAX_EXPOSURE[copy.name], report


@pytest.mark.timeout(900)
def test_installed_units_verify_with_the_packaged_program(
    container: Container, standin_packages: dict[str, Packages]
) -> None:
    """The units as packages install them, with /usr/bin/llmgw in place: not a word."""
    current = standin_packages[CURRENT]
    container.sh(
        f"dpkg -i {current.mounted('llmgw-agent', 'deb')} {current.mounted('llmgw-server', 'deb')}"
    )
    result = container.sh(
        "systemd-analyze verify /lib/systemd/system/llmgw-agent.service "
        "/lib/systemd/system/llmgw-server.service 2>&1"
    )
    assert result.stdout == ""
