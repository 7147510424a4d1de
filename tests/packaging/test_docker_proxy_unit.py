"""llmgw-docker-proxy.service under a real systemd (a Debian 12 container) in front of this
machine's dockerd: its dynamic user (in docker's and the agent's groups, not root) serves the
socket as llmgw-agent 0660; the agent's user reaches dockerd through it, other users do not,
and what the policy refuses is refused. The program is this checkout run by this test's own
interpreter, mounted read-only at the same paths (the unit's other lines are the shipped ones).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.agent.dockerproxy import DEFAULT_LISTEN
from tests.ci import unavailable

from .pkgcheck import COMMON_RUN, PRIVILEGE_VARIANTS, ROOT, RUN_LABEL, Container

pytestmark = pytest.mark.timeout(300)

UNIT = "llmgw-docker-proxy.service"
DOCKER_SOCK = Path("/var/run/docker.sock")
UPSTREAM = "/hostdocker/docker.sock"


def mounts() -> list[Path]:
    """This checkout, the virtual environment, and the interpreter's own tree unless it is the
    system's /usr (the image's Debian 12 python3.11 is then the same one)."""
    paths = [ROOT, Path(sys.prefix)]
    base = Path(sys.base_prefix)
    if base != Path("/usr"):
        paths.append(base)
    return paths


# The unit's DynamicUser= implies PrivateTmp=: a checkout (or its .venv) in /tmp or /var/tmp is
# mounted elsewhere in the container, where the service can see it.
MOVED = Path("/srv/llmgw-test")


def inside(path: Path) -> Path:
    """Where ``path`` of this machine is in the container."""
    if path.parts[1:2] == ("tmp",) or path.parts[1:3] == ("var", "tmp"):
        return MOVED / path.relative_to("/")
    return path


@pytest.fixture
def node(systemd_image: str) -> Iterator[Container]:
    if not DOCKER_SOCK.exists():
        unavailable(f"no {DOCKER_SOCK}: start dockerd (dockerd >/var/log/dockerd.log 2>&1 &)")
    volumes = [f"{DOCKER_SOCK}:{UPSTREAM}"]
    volumes += [f"{p}:{inside(p)}:ro" for p in mounts()]
    errors = []
    for variant in PRIVILEGE_VARIANTS:
        name = f"llmgw-pkgtest-{int(time.time())}-{uuid.uuid4().hex[:8]}"
        run = ["docker", "run", "-d", "--name", name, "--label", RUN_LABEL, *variant, *COMMON_RUN]
        started = subprocess.run(
            [*run, "--network", "none", *(f"-v{v}" for v in volumes), systemd_image, "/sbin/init"],
            capture_output=True,
            text=True,
            check=False,
        )
        if started.returncode == 0:
            booted = Container(name)
            if booted.wait_booted():
                break
            errors.append(f"{variant[0]}: systemd did not come up: {booted.journal()}")
            booted.remove()
        else:
            errors.append(f"{variant[0]}: {started.stderr.strip()}")
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
    else:
        raise AssertionError("no systemd container could start:\n" + "\n".join(errors))
    try:
        yield booted
    finally:
        booted.remove()


def test_the_proxy_unit_serves_the_agent_s_group_only(node: Container) -> None:
    c = node
    docker_gid = DOCKER_SOCK.stat().st_gid
    # The socket's group here is the image's group of that gid, if it has one: named docker.
    c.sh(
        f"taken=$(getent group {docker_gid} | cut -d: -f1); "
        f'if [ -n "$taken" ]; then groupmod -n docker "$taken"; else groupadd -g {docker_gid} docker; fi'
    )
    c.sh("groupadd --system llmgw-agent && useradd --system --gid llmgw-agent llmgw-agent")
    # The unit needs docker.service; dockerd itself is this machine's, behind UPSTREAM.
    c.sh(
        "printf '[Service]\\nExecStart=/bin/sleep infinity\\n' >/etc/systemd/system/docker.service"
    )
    # Every directory above the mounts must let the dynamic user through (/root is 0700).
    # One that already does is left alone: it may be a read-only mount itself (a checkout
    # whose .venv is mounted below it).
    for path in mounts():
        for parent in inside(path).parents:
            c.sh(
                f"[ ! -d {parent} ] || case $(stat -c %A {parent}) in *x) ;; "
                f"*) chmod o+x {parent} ;; esac"
            )
    shipped = (ROOT / "systemd" / UNIT).read_text()
    program = f"{inside(Path(sys.executable))} -m llmgw"
    installed = shipped.replace("ExecStart=/usr/bin/llmgw ", f"ExecStart={program} ").replace(
        "--group llmgw-agent", f"--group llmgw-agent --upstream {UPSTREAM}"
    )
    assert installed.count(program) == 1 and installed.count(UPSTREAM) == 1
    c.sh(f"cat >/etc/systemd/system/{UNIT} <<'EOF'\n{installed}EOF")
    dropin = ["[Service]", f"Environment=PYTHONPATH={inside(ROOT)}"]
    if any(str(p).startswith(("/root", "/home")) for p in mounts()):
        dropin.append("ProtectHome=no")  # this machine's interpreter lives there
    c.sh(f"mkdir -p /etc/systemd/system/{UNIT}.d")
    c.sh(
        f"printf '%s\\n' {' '.join(shlex.quote(x) for x in dropin)} "
        f">/etc/systemd/system/{UNIT}.d/test.conf"
    )
    c.sh("systemctl daemon-reload")
    started = c.sh(f"systemctl start {UNIT}", check=False)
    assert started.returncode == 0, c.out(f"journalctl -u {UNIT} --no-pager | tail -20")
    assert c.out(f"systemctl is-active {UNIT}") == "active"

    # The socket: the agent's group, 0660, owned by the unit's dynamic user (not root).
    owner, group, mode = c.out(f"stat -c '%u %G %a' {DEFAULT_LISTEN}").split()
    assert (group, mode) == ("llmgw-agent", "660")
    assert owner != "0"
    pid = c.out(f"systemctl show -p MainPID --value {UNIT}")
    uid, groups = c.out(f"ps -o uid=,supgid= -p {pid}").split()
    assert uid == owner
    assert {str(docker_gid), c.out("getent group llmgw-agent | cut -d: -f3")} <= set(
        groups.split(",")
    )

    def curl(user: str, *args: str) -> subprocess.CompletedProcess[str]:
        who = (
            "--reuid llmgw-agent --regid llmgw-agent --init-groups"
            if user == "llmgw-agent"
            else "--reuid nobody --regid nogroup --clear-groups"
        )
        words = " ".join(shlex.quote(a) for a in args)
        return c.sh(f"setpriv {who} curl -sS --unix-socket {DEFAULT_LISTEN} {words}", check=False)

    version = curl("llmgw-agent", "http://docker/version")
    assert version.returncode == 0, version.stderr
    assert "ApiVersion" in json.loads(version.stdout)
    # Nobody else may connect.
    other = curl("nobody", "http://docker/version")
    assert other.returncode == 7 and "Couldn't connect" in other.stderr, other
    # Through it, the policy holds.
    refused = curl("llmgw-agent", "-X", "POST", "http://docker/v1.41/containers/x/exec")
    assert "is not a call llmgw's docker runtime makes" in json.loads(refused.stdout)["message"]
    body = json.dumps(
        {
            "Image": "x",
            "Labels": {"llmgw.node": "n", "llmgw.shard": "s"},
            "HostConfig": {"Privileged": True, "Binds": ["/:/h"]},
        }
    )
    privileged = curl(
        "llmgw-agent",
        "-X",
        "POST",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        "http://docker/v1.41/containers/create",
    )
    assert "a privileged container is root on the host" in json.loads(privileged.stdout)["message"]
    # A stop ends it cleanly and takes the socket away.
    c.sh(f"systemctl stop {UNIT}")
    assert c.sh(f"test -e {DEFAULT_LISTEN}", check=False).returncode == 1
    assert os.path.exists(DOCKER_SOCK)  # this machine's dockerd is untouched
