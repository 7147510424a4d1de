"""install-agent.sh's Docker access (--docker, --docker-group, neither), run for real: the
installer's own functions, sourced into sh with its paths pointed into a temporary directory
and the commands that would change the host (systemctl, usermod, gpasswd, getent, id)
replaced by stand-ins that record their calls. The whole path, in systemd containers, is the
dry run's."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from llmgw.agent.dockerproxy import DEFAULT_LISTEN
from tests.ci import require_tools

from .pkgcheck import ROOT

INSTALLER = ROOT / "installer" / "install-agent.sh"


def run_installer(
    tmp_path: Path,
    args: str,
    *,
    groups: str = "llmgw-agent",
    docker_group: bool = True,
    mode: str = "tarball",
) -> subprocess.CompletedProcess[str]:
    """parse_args ARGS, then configure_docker and start_docker_proxy, as configure_and_start
    calls them; prints what configure_docker changed as 'changed=yes|no restart=yes|no'."""
    require_tools("sh")
    body = INSTALLER.read_text().rsplit("\nmain ", 1)[0]  # everything but the call of main
    calls = tmp_path / "calls"
    script = f"""
{body}
UNIT_DIR={tmp_path}/units
DROPIN_DIR=$UNIT_DIR/llmgw-agent.service.d
DOCKER_DROPIN=$DROPIN_DIR/20-docker.conf
INSTALL_STATE={tmp_path}/install-state
LIB_DIR={tmp_path}/lib
STAGE={tmp_path}/stage
BUNDLE={ROOT}
mkdir -p "$STAGE" "$UNIT_DIR" "$LIB_DIR"
record() {{ printf '%s\\n' "$*" >>{calls}; }}
systemctl() {{ record systemctl "$@"; [ "$1" != is-active ] || echo inactive; }}
usermod() {{ record usermod "$@"; }}
gpasswd() {{ record gpasswd "$@"; }}
getent() {{ [ "$2" != docker ] || {"true" if docker_group else "false"}; }}
id() {{ echo {shlex.quote(groups)}; }}
mode_recorded() {{ echo {mode}; }}
parse_args {args}
RESTART=no DOCKER_CHANGED=no
configure_docker
echo "changed=$DOCKER_CHANGED restart=$RESTART"
start_docker_proxy
"""
    return subprocess.run(
        ["sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )


def calls_of(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(autouse=True)
def as_root() -> None:
    if os.geteuid() != 0:
        from tests.ci import unavailable

        unavailable("the installer's put_file chowns to root: run the tests as root")


def test_docker_gives_the_proxy_s_socket_not_the_docker_group(tmp_path: Path) -> None:
    result = run_installer(tmp_path, "install --docker")
    assert result.returncode == 0, result.stderr
    assert "changed=yes restart=yes" in result.stdout
    dropin = (tmp_path / "units" / "llmgw-agent.service.d" / "20-docker.conf").read_text()
    assert f"Environment=DOCKER_HOST=unix://{DEFAULT_LISTEN}" in dropin
    assert "Wants=llmgw-docker-proxy.service" in dropin
    assert "After=llmgw-docker-proxy.service" in dropin
    unit = (tmp_path / "units" / "llmgw-docker-proxy.service").read_text()
    # Pointed at the installed binary, like the agent's unit.
    assert f"ExecStart={tmp_path}/lib/llmgw agent docker-proxy --listen {DEFAULT_LISTEN}" in unit
    assert (tmp_path / "install-state" / "docker").read_text() == "proxy\n"
    calls = calls_of(tmp_path)
    assert not [c for c in calls if c.startswith(("usermod", "gpasswd"))], calls
    assert "systemctl enable llmgw-docker-proxy.service" in calls
    assert "systemctl restart llmgw-docker-proxy.service" in calls
    assert "serves /run/llmgw-docker-proxy/docker.sock to llmgw-agent" in result.stderr

    # The same install again changes nothing (the proxy is not restarted when it runs).
    (tmp_path / "calls").unlink()
    again = run_installer(tmp_path, "install --docker")
    assert again.returncode == 0 and "changed=no restart=no" in again.stdout, again.stderr


def test_docker_takes_the_agent_out_of_the_docker_group(tmp_path: Path) -> None:
    # An earlier installer (before --docker) put the agent in the docker group.
    result = run_installer(tmp_path, "install --docker", groups="llmgw-agent docker")
    assert result.returncode == 0, result.stderr
    assert "gpasswd -d llmgw-agent docker" in calls_of(tmp_path)
    assert "removing llmgw-agent from the docker group (root on this host)" in result.stderr


def test_without_docker_the_agent_has_no_docker_access(tmp_path: Path) -> None:
    first = run_installer(tmp_path, "install --docker")
    assert first.returncode == 0, first.stderr
    (tmp_path / "calls").unlink()
    result = run_installer(tmp_path, "install", groups="llmgw-agent docker")
    assert result.returncode == 0, result.stderr
    assert "changed=yes restart=yes" in result.stdout
    calls = calls_of(tmp_path)
    assert "gpasswd -d llmgw-agent docker" in calls
    assert "systemctl disable --now llmgw-docker-proxy.service" in calls
    assert not [c for c in calls if c.startswith("usermod")], calls
    assert not (tmp_path / "units" / "llmgw-agent.service.d" / "20-docker.conf").exists()
    assert not (tmp_path / "units" / "llmgw-docker-proxy.service").exists()
    assert (tmp_path / "install-state" / "docker").read_text() == "none\n"
    assert "give --docker for Docker engines through llmgw-docker-proxy" in result.stderr
    # Nothing to undo: nothing changes, nothing is called but the checks.
    (tmp_path / "calls").unlink()
    quiet = run_installer(tmp_path, "install")
    assert quiet.returncode == 0 and "changed=no restart=no" in quiet.stdout, quiet.stderr
    assert not [c for c in calls_of(tmp_path) if not c.startswith("systemctl is-")]


def test_docker_group_is_opt_in_and_says_what_it_grants(tmp_path: Path) -> None:
    result = run_installer(tmp_path, "install --docker-group")
    assert result.returncode == 0, result.stderr
    assert "usermod -aG docker llmgw-agent" in calls_of(tmp_path)
    assert "which is root on this host" in result.stderr
    assert "docker run --privileged -v /:/h" in result.stderr
    assert not (tmp_path / "units" / "llmgw-docker-proxy.service").exists()
    assert (tmp_path / "install-state" / "docker").read_text() == "group\n"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ("install --docker --docker-group", "--docker and --docker-group exclude each other"),
        ("rekey --enroll-url u --ca-hash h --docker", "go with 'install' and 'package' only"),
        ("upgrade --docker", "'upgrade' takes no options but --ca-hash"),
    ],
)
def test_docker_option_misuse_is_refused(tmp_path: Path, args: str, words: str) -> None:
    result = run_installer(tmp_path, args)
    assert result.returncode == 1
    assert words in result.stderr
    assert calls_of(tmp_path) == []


def test_docker_without_docker_installed_says_to_install_it(tmp_path: Path) -> None:
    result = run_installer(tmp_path, "install --docker", docker_group=False)
    assert result.returncode == 1
    assert "this host has no docker group; install Docker (apt-get install -y docker.io)" in (
        result.stderr
    )
    assert calls_of(tmp_path) == []


def test_package_docker_uses_the_package_s_unit(tmp_path: Path) -> None:
    result = run_installer(
        tmp_path, "package --repo-url http://r --repo-key k --docker", mode="package"
    )
    assert result.returncode == 0, result.stderr
    # The package ships the unit in the vendor directory: none is written here.
    assert not (tmp_path / "units" / "llmgw-docker-proxy.service").exists()
    dropin = (tmp_path / "units" / "llmgw-agent.service.d" / "20-docker.conf").read_text()
    assert f"Environment=DOCKER_HOST=unix://{DEFAULT_LISTEN}" in dropin
    calls = calls_of(tmp_path)
    assert "systemctl enable llmgw-docker-proxy.service" in calls
    assert not [c for c in calls if c.startswith(("usermod", "gpasswd"))], calls


def run_status(tmp_path: Path, groups: str, recorded: str | None) -> str:
    """verb_status's 'docker:' line, the host's commands replaced by stand-ins."""
    require_tools("sh")
    body = INSTALLER.read_text().rsplit("\nmain ", 1)[0]
    state = tmp_path / "install-state"
    state.mkdir(exist_ok=True)
    if recorded is not None:
        (state / "docker").write_text(recorded + "\n")
    script = f"""
{body}
INSTALL_STATE={state}
LIB_DIR={tmp_path}/lib
PREVIOUS_DIR={tmp_path}/previous
STATE_DIR={tmp_path}/state
systemctl() {{ echo inactive; }}
is_listening() {{ return 1; }}
id() {{ echo {shlex.quote(groups)}; }}
verb_status
"""
    result = subprocess.run(
        ["sh", "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return next(line for line in result.stdout.splitlines() if line.startswith("docker:"))


def test_status_says_when_an_older_install_left_the_agent_in_the_docker_group(
    tmp_path: Path,
) -> None:
    # An installer older than --docker recorded nothing and put the agent in the group; an
    # upgrade keeps it there. Status said "no access" on such a node, which is root-equivalent.
    line = run_status(tmp_path, "llmgw-agent docker", None)
    assert "in the docker group (root on this host)" in line, line
    assert "install --docker" in line
    assert "no access" in run_status(tmp_path, "llmgw-agent", None)
    assert "older install" not in run_status(tmp_path, "llmgw-agent docker", "group")
    assert "through llmgw-docker-proxy" in run_status(tmp_path, "llmgw-agent", "proxy")


def test_an_upgrade_warns_of_a_docker_group_no_option_asked_for() -> None:
    # The signed update runs 'upgrade', which changes no access: its journal says so.
    body = INSTALLER.read_text()
    upgrade = body.split("\nverb_upgrade() {", 1)[1].split("\n}\n", 1)[0]
    assert "warn_docker_group" in upgrade
