"""install --docker in a Debian 12 node: the bundle's llmgw-docker-proxy.service runs the one-file
binary as its own dynamic user and serves the agent's group only, the agent's drop-in points it
there, the agent never joins docker; then the ways back (install without --docker,
--docker-group with its warning) and purge. dockerd itself is not in the node: a stand-in
docker.service satisfies the unit, and calls the proxy lets through get its 502."""

from __future__ import annotations

import json

from tests.packaging.pkgcheck import systemd_image_of

from .lab import Lab

NODE = "dry-docker"
PROXY = "llmgw-docker-proxy.service"
SOCKET = "/run/llmgw-docker-proxy/docker.sock"
DROPIN = "/etc/systemd/system/llmgw-agent.service.d/20-docker.conf"


def test_install_docker_gives_the_agent_the_proxy_not_the_docker_group(lab: Lab) -> None:
    node = lab.boot(systemd_image_of("bookworm"), NODE)
    folder = lab.unpack(lab.bundle_n, "docker-unpacked")
    installer = f"sh {folder}/install-agent.sh"

    refused = node.sh(f"{installer} install --docker", check=False)
    assert refused.returncode == 1
    assert "this host has no docker group; install Docker" in refused.stderr

    node.sh("groupadd --system docker")
    node.sh(
        "printf '[Service]\\nExecStart=/bin/sleep infinity\\n' >/etc/systemd/system/docker.service"
    )
    node.sh("systemctl daemon-reload")
    result = node.sh(f"{installer} install --docker")
    assert f"docker: {PROXY} serves {SOCKET} to llmgw-agent" in result.stderr
    assert "docker" not in node.out("id -nG llmgw-agent").split()
    assert node.out(f"systemctl is-active {PROXY}") == "active"
    assert node.out(f"systemctl is-enabled {PROXY}") == "enabled"
    assert node.out(f"stat -c '%G %a' {SOCKET}") == "llmgw-agent 660"
    # Its own user, not root, in docker's and the agent's groups.
    pid = node.out(f"systemctl show -p MainPID --value {PROXY}")
    assert node.out(f"ps -o uid= -p {pid}") != "0"
    assert f"DOCKER_HOST=unix://{SOCKET}" in node.out(f"cat {DROPIN}")
    assert f"DOCKER_HOST=unix://{SOCKET}" in node.out(
        "systemctl show -p Environment --value llmgw-agent.service"
    )
    assert f"through {PROXY} ({SOCKET}): active" in node.out(f"{installer} status")

    def curl(who: str, *args: str) -> tuple[int, str]:
        creds = (
            "--reuid llmgw-agent --regid llmgw-agent --init-groups"
            if who == "agent"
            else "--reuid nobody --regid nogroup --clear-groups"
        )
        done = node.sh(
            f"setpriv {creds} curl -sS --unix-socket {SOCKET} {' '.join(args)}", check=False
        )
        return done.returncode, done.stdout + done.stderr

    code, said = curl("agent", "-X POST http://docker/v1.41/containers/x/exec")
    assert code == 0 and "is not a call llmgw's docker runtime makes" in json.loads(said)["message"]
    code, said = curl("agent", "http://docker/version")
    assert code == 0 and "cannot reach dockerd at /var/run/docker.sock" in said
    code, said = curl("other", "http://docker/version")
    assert code == 7, said

    # The same install again restarts nothing.
    since = node.out(f"systemctl show -p ActiveEnterTimestampMonotonic --value {PROXY}")
    again = node.sh(f"{installer} install --docker")
    assert "serves" not in again.stderr
    assert node.out(f"systemctl show -p ActiveEnterTimestampMonotonic --value {PROXY}") == since

    # Without --docker: no access at all.
    off = node.sh(f"{installer} install")
    assert f"docker: {PROXY} off" in off.stderr
    assert node.out(f"systemctl is-active {PROXY} || true") == "inactive"
    assert node.sh(f"test -e /etc/systemd/system/{PROXY}", check=False).returncode == 1
    assert node.sh(f"test -e {DROPIN}", check=False).returncode == 1
    assert "docker:     no access" in node.out(f"{installer} status")

    # --docker-group: as asked, with what it grants said plainly; a plain install undoes it.
    group = node.sh(f"{installer} install --docker-group")
    assert "which is root on this host" in group.stderr
    assert "docker" in node.out("id -nG llmgw-agent").split()
    back = node.sh(f"{installer} install")
    assert "removing llmgw-agent from the docker group (root on this host)" in back.stderr
    assert "docker" not in node.out("id -nG llmgw-agent").split()

    node.sh(f"{installer} install --docker")
    node.sh(f"{installer} uninstall --purge")
    assert node.out(f"systemctl is-active {PROXY} || true") == "inactive"
    left = node.out("find /etc /var/lib /usr/local -name '*llmgw*' 2>/dev/null || true")
    assert left == "", left
