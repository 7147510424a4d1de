"""The agent's container form as files (packaging/compose/): the compose file's structure and
the promises it keeps (no privilege, dockerd's socket only for the proxy, state and
configuration as volumes), the example agent.yaml, and the seccomp profile, which must be the
agent unit's own system call filter with bubblewrap's namespaces (packaging/seccomp.py).

``docker compose config`` cannot check the file here (Debian 12 has no docker-compose-plugin;
docker-compose 1.x is deprecated), so its structure is checked key by key; the container
test (test_agent_image.py) runs what it describes.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from llmgw.agent.config import load_agent_config
from llmgw.agent.service import DRAIN_TIMEOUT
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG, DEFAULT_AGENT_STATE_DIR
from tests.ci import unavailable

from .composefile import COMPOSE, KNOWN, TOP_KEYS, Overrides, load, run_argv
from .distcheck import load_packaging_module
from .pkgcheck import ROOT

FOLDER = COMPOSE.parent
PROFILE = FOLDER / "seccomp-agent.json"
UNIT = ROOT / "systemd" / "llmgw-agent.service"
AGENT_UID = 17443  # scripts/agent-image.sh's AGENT_UID
CLONE = {"user": 0x10000000, "mnt": 0x00020000, "pid": 0x20000000, "ipc": 0x08000000}
CLONE_NEWNET, CLONE_NEWUTS, CLONE_NEWCGROUP = 0x40000000, 0x04000000, 0x02000000


@pytest.fixture(scope="module")
def seccomp() -> ModuleType:
    return load_packaging_module("seccomp")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load()


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Target -> (source, options) of a service's volumes."""
    out = {}
    for spec in service.get("volumes", []):
        source, target, *options = spec.split(":")
        out[target] = (source, ":".join(options))
    return out


def test_the_file_holds_only_what_compose_and_the_container_test_know(
    compose: dict[str, Any],
) -> None:
    assert set(compose) <= TOP_KEYS, set(compose) - TOP_KEYS
    assert set(compose["services"]) == {"agent", "docker-proxy"}
    for name, service in compose["services"].items():
        assert set(service) <= KNOWN, f"{name}: {set(service) - KNOWN}"
        for key in ("cap_drop", "security_opt", "tmpfs", "volumes", "command"):
            value = service.get(key, [])
            assert isinstance(value, list) and all(isinstance(v, str) for v in value), (name, key)
        for spec in service["volumes"]:
            source, target, *options = spec.split(":")
            assert target.startswith("/") and options in ([], ["ro"]), (name, spec)
            if not source.startswith(("/", ".")):
                assert source in compose["volumes"], f"{name}: volume {source} is not declared"
    # The docker proxy only with its profile: `docker compose up` alone starts the agent.
    assert compose["services"]["docker-proxy"]["profiles"] == ["docker"]
    assert "profiles" not in compose["services"]["agent"]


def test_the_agent_runs_without_privilege(compose: dict[str, Any]) -> None:
    agent = compose["services"]["agent"]
    assert agent["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in agent["security_opt"]
    assert "user" not in agent, "the image's own user (llmgw-agent, uid 17443), never root"
    assert agent["read_only"] is True
    # Its seccomp profile is the one shipped beside it, never 'unconfined'.
    seccomp = [o for o in agent["security_opt"] if o.startswith("seccomp")]
    assert seccomp == ["seccomp=./seccomp-agent.json"] and PROFILE.is_file()
    # docker-default's AppArmor profile denies the mounts bwrap makes in its namespaces.
    assert "apparmor=unconfined" in agent["security_opt"]
    assert not {"privileged", "cap_add", "pid", "ipc", "devices"} & set(agent)
    proxy = compose["services"]["docker-proxy"]
    assert proxy["cap_drop"] == ["ALL"] and "no-new-privileges:true" in proxy["security_opt"]
    assert proxy["user"] == "llmgw-docker-proxy" and proxy["network_mode"] == "none"


def test_only_the_proxy_holds_dockerds_socket(compose: dict[str, Any]) -> None:
    agent, proxy = compose["services"]["agent"], compose["services"]["docker-proxy"]
    assert not any("docker.sock" in spec for spec in agent["volumes"])
    assert mounts(proxy)["/var/run/docker.sock"][0] == "/var/run/docker.sock"
    # They share the proxy's socket folder, where the proxy listens.
    listen = Path(proxy["command"][proxy["command"].index("--listen") + 1])
    assert mounts(agent)[str(listen.parent)][0] == mounts(proxy)[str(listen.parent)][0]
    # The proxy checks binds against the models folder as the agent's engines name it.
    root = proxy["command"][proxy["command"].index("--bind-root") + 1]
    assert mounts(agent)[root] == (root, "ro") and mounts(proxy)[root] == (root, "ro")


def test_state_and_configuration_are_volumes(compose: dict[str, Any]) -> None:
    agent = compose["services"]["agent"]
    seen = mounts(agent)
    assert seen[str(DEFAULT_AGENT_CONFIG)] == ("./agent.yaml", "ro")
    state, options = seen[str(DEFAULT_AGENT_STATE_DIR)]
    assert state in compose["volumes"] and options == ""
    # TMPDIR (the image's) on an exec tmpfs that only the agent's user can enter.
    tmpdir = [t for t in agent["tmpfs"] if t.startswith("/var/lib/llmgw-agent-tmp:")]
    assert len(tmpdir) == 1
    options_of = set(tmpdir[0].split(":", 1)[1].split(","))
    assert {"exec", "mode=0700", f"uid={AGENT_UID}", f"gid={AGENT_UID}"} <= options_of
    assert agent["init"] is True and agent["network_mode"] == "host"


def test_a_stop_leaves_the_agent_its_drain(compose: dict[str, Any]) -> None:
    """As long as the unit's TimeoutStopSec=: the drain, then the engines' own stop."""
    unit_stop = int(re.search(r"^TimeoutStopSec=(\d+)$", UNIT.read_text(), re.M).group(1))  # type: ignore[union-attr]
    grace = compose["services"]["agent"]["stop_grace_period"]
    assert grace == f"{unit_stop}s" and unit_stop > DRAIN_TIMEOUT


def test_the_example_agent_yaml_is_valid_and_keeps_the_sandbox() -> None:
    cfg = load_agent_config(FOLDER / "agent.yaml")
    assert cfg.sandbox == "required"
    assert cfg.stop_shards_on_exit is True
    assert cfg.state_dir == DEFAULT_AGENT_STATE_DIR


def test_run_argv_is_the_agent_service_as_docker_run(tmp_path: Path) -> None:
    argv = run_argv(
        "agent",
        name="x",
        overrides=Overrides(
            volumes={"state": "vol-1"},
            binds={"./agent.yaml": "/t/a.yaml"},
            env={"LLMGW_AGENT_IMAGE": ""},  # unset or empty: the file's default
        ),
    )
    pairs = list(itertools.pairwise(argv))
    assert ("--security-opt", f"seccomp={PROFILE}") in pairs
    assert ("--security-opt", "systempaths=unconfined") in pairs
    assert ("-v", "vol-1:/var/lib/llmgw-agent") in pairs
    assert ("-v", "/t/a.yaml:/etc/llmgw/agent.yaml:ro") in pairs
    assert ("-v", "llmgw-agent_docker-proxy:/run/llmgw-docker-proxy") in pairs
    assert ("--gpus", "all") in pairs and ("--stop-timeout", "45") in pairs
    assert argv[-5:] == [
        "llmgw-agent:latest",
        "llmgw",
        "agent",
        "--config",
        "/etc/llmgw/agent.yaml",
    ]
    proxy = run_argv(
        "docker-proxy",
        name="y",
        overrides=Overrides(env={"LLMGW_DOCKER_GID": "989", "LLMGW_AGENT_IMAGE": "img:1"}),
    )
    assert "img:1" in proxy
    assert ("--group-add", "989") in list(itertools.pairwise(proxy))


# -- the seccomp profile ---------------------------------------------------------------------


def allowed(profile: dict[str, Any]) -> set[str]:
    return {
        name
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("args")
        for name in rule["names"]
    }


def masked(profile: dict[str, Any], call: str) -> int:
    (rule,) = [r for r in profile["syscalls"] if r["names"] == [call]]
    (arg,) = rule["args"]
    assert arg["op"] == "SCMP_CMP_MASKED_EQ" and arg["index"] == 0 and arg["valueTwo"] == 0
    return int(arg["value"])


def test_the_profile_lets_bubblewrap_make_its_namespaces_and_no_other() -> None:
    profile = json.loads(PROFILE.read_text())
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["defaultErrnoRet"] == 1
    # Native calls only (SystemCallArchitectures=native): no x32 or i386 entry points.
    assert all(a["subArchitectures"] == [] for a in profile["archMap"])
    calls = allowed(profile)
    # What bwrap does inside the namespaces it makes, as the unit allows it.
    assert {"mount", "umount2", "pivot_root", "chroot", "capset", "pidfd_getfd"} <= calls
    # What ~@privileged and the rest of the unit's filter keep out.
    assert not {"setuid", "setgroups", "bpf", "init_module", "kexec_load", "ptrace"} & calls
    # Namespace calls only through their filters: clone and unshare may not make a network,
    # UTS or cgroup namespace; setns never; clone3 says ENOSYS (glibc falls back to clone).
    assert not {"clone", "clone3", "unshare", "setns"} & calls
    for call in ("clone", "unshare"):
        mask = masked(profile, call)
        assert mask & (CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWCGROUP) == (
            CLONE_NEWNET | CLONE_NEWUTS | CLONE_NEWCGROUP
        )
        assert not mask & sum(CLONE.values()), f"{call} may not make bwrap's namespaces"
    (clone3,) = [r for r in profile["syscalls"] if r["names"] == ["clone3"]]
    assert clone3["action"] == "SCMP_ACT_ERRNO" and clone3["errnoRet"] == 38


def test_the_profile_is_the_units_filter(seccomp: ModuleType) -> None:
    """packaging/seccomp.py --check with Debian 12's systemd, whose groups made the file."""
    if shutil.which("systemd-analyze") is None:
        unavailable("no systemd-analyze; apt-get install -y systemd")
    version = subprocess.run(
        ["systemd-analyze", "--version"], capture_output=True, text=True, check=True
    ).stdout
    if f"systemd {seccomp.GENERATED_WITH} " not in version:
        unavailable(f"the profile is made with systemd {seccomp.GENERATED_WITH}; this is {version}")
    assert seccomp.main(["--check"]) == 0


GROUPS = """@default
    # always
    execve
    exit

@mount
    mount
    pivot_root

@privileged
    # root's
    @chown
    pivot_root
    setuid

@chown
    chown

@system-service
    @default
    @chown
    clone
    unshare
    setns
    clone3
    read
"""


def unit(*lines: str) -> str:
    return "[Service]\n" + "\n".join(lines) + "\nSystemCallArchitectures=native\n"


def test_the_generator_reads_the_filter_as_systemd_does(seccomp: ModuleType) -> None:
    groups = seccomp.read_groups(GROUPS)
    assert groups["@chown"] == ["chown"] and "# root's" not in groups["@privileged"]
    profile = seccomp.profile(
        unit(
            "SystemCallFilter=@system-service @mount",
            "SystemCallFilter=~@privileged",
            "SystemCallFilter=pivot_root",
            "RestrictNamespaces=user mnt",
            "SystemCallErrorNumber=EPERM",
        ),
        groups,
    )
    # The first line allows, '~' takes away (chown with @chown), a later line adds back.
    assert allowed(profile) == {"execve", "exit", "read", "mount", "pivot_root"}
    assert masked(profile, "clone") == sum(
        flag for kind, flag in seccomp.CLONE_FLAGS.items() if kind not in ("user", "mnt")
    )
    assert masked(profile, "unshare") == masked(profile, "clone") | 0x80  # CLONE_NEWTIME


@pytest.mark.parametrize(
    ("lines", "says"),
    [
        (("RestrictNamespaces=user", "SystemCallErrorNumber=EPERM"), "no SystemCallFilter="),
        (
            ("SystemCallFilter=~@mount", "RestrictNamespaces=user", "SystemCallErrorNumber=EPERM"),
            "deny list",
        ),
        (
            (
                "SystemCallFilter=read",
                "RestrictNamespaces=user time",
                "SystemCallErrorNumber=EPERM",
            ),
            "'time'",
        ),
        (
            ("SystemCallFilter=@nosuch", "RestrictNamespaces=user", "SystemCallErrorNumber=EPERM"),
            "no syscall group @nosuch",
        ),
        (
            ("SystemCallFilter=read", "RestrictNamespaces=user", "SystemCallErrorNumber=EIO"),
            "EIO",
        ),
    ],
)
def test_the_generator_refuses_what_it_cannot_translate(
    seccomp: ModuleType, lines: tuple[str, ...], says: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        seccomp.profile(unit(*lines), seccomp.read_groups(GROUPS))
