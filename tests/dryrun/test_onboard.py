"""``llmgw ctl onboard`` over real ssh (Debian 12 containers running sshd, a key pair made
here, each container's host key pinned in a known_hosts of this test's own), against the
lab's control plane, in order:

1. one host (a user with passwordless sudo): installed, joined, approved by the key read back
   over ssh, online with its inventory; the join token on no process's command line on
   either side while it ran (every /proc/*/cmdline sampled) and in no file left behind;
2. the same command again changes nothing (no token, no restart);
3. a host whose key changed is refused before anything runs there (no login, no token);
4. a failure mid-install (the bundle URL unreachable from the host; then the enrolment
   port, so that the installer's join fails and it rolls back what it created) leaves the
   host clean and the token revoked;
5. ``--hosts`` with three hosts, one unreachable: two online, one reported with its error,
   exit status non-zero; a re-run skips the two;
6. ``--package`` from the signed apt repository (served on the host's loopback): its join
   failing after the package went in leaves no package, user or folder and the token
   revoked; then the same command brings the host online from the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.ci import require_tools
from tests.integration.harness import LLMGW, wait_for

from .lab import Lab, Node, OrderedSteps, systemd_image

SSH_IMAGE_ENV = "LLMGW_TEST_SYSTEMD_SSH_IMAGE"
SSH_IMAGE = "llmgw-test-systemd-ssh:local"
# Where a node keeps what the installer puts there: none of it may be left by a failed install.
INSTALLED = (
    "/usr/local/lib/llmgw-agent /usr/local/bin/llmgw /etc/llmgw /var/lib/llmgw-agent "
    "/var/lib/llmgw-agent-install /etc/systemd/system/llmgw-agent.service"
)
# What the llmgw-agent package and its repository put on a node besides those.
PACKAGED = (
    "/usr/bin/llmgw /usr/lib/llmgw /lib/systemd/system/llmgw-agent.service "
    "/etc/apt/sources.list.d/llmgw.list /usr/share/keyrings/llmgw.gpg /srv/llmgw"
)
# Every process's command line, collected until the stop file appears (python3 is in the
# image); printed once at the end, one per line, NULs as spaces.
SAMPLER = r"""
import os, sys, time
seen = set()
end = time.time() + 900
while time.time() < end and not os.path.exists("/run/stop-sampler"):
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    seen.add(f.read().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
sys.stdout.write("\n".join(sorted(seen)))
"""

pytestmark = pytest.mark.usefixtures("in_order")


def ssh_image() -> str:
    """The Debian 12 systemd image with sshd (``scripts/systemd-test-image.sh --ssh``)."""
    return systemd_image(SSH_IMAGE_ENV, SSH_IMAGE, "--ssh")


class Steps(OrderedSteps):
    """The ssh side of the steps: the key pair, the known_hosts, the hosts booted."""

    def __init__(self, lab: Lab, tmp: Path) -> None:
        super().__init__(lab)
        require_tools("ssh", "ssh-keygen")
        self.image = ssh_image()
        self.tmp = tmp
        self.key = tmp / "id_ed25519"
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "llmgw-test",
                "-f",
                str(self.key),
            ],
            check=True,
        )
        self.known_hosts = tmp / "known_hosts"
        self.known_hosts.write_text("")
        self.hosts: dict[str, Node] = {}

    def boot(self, node_id: str) -> Node:
        """A container running sshd that lets this test's key in as root and as ops (with
        passwordless sudo), its host key pinned, read through docker: out of band."""
        node = self.lab.boot(self.image, node_id)
        wait_for(
            lambda: node.sh("systemctl is-active ssh", check=False).stdout.strip() == "active",
            what=f"sshd on {node_id}",
            timeout=60,
        )
        public = self.key.with_suffix(".pub").read_text().strip()
        node.sh(
            "set -e; useradd -m -s /bin/sh ops; for h in /root /home/ops; do "
            'mkdir -p "$h/.ssh"; printf "%s\\n" "$KEY" >"$h/.ssh/authorized_keys"; done; '
            "chown -R ops: /home/ops/.ssh; chmod 700 /root/.ssh /home/ops/.ssh; "
            "echo 'ops ALL=(ALL) NOPASSWD: ALL' >/etc/sudoers.d/ops; chmod 440 /etc/sudoers.d/ops".replace(
                "$KEY", public
            )
        )
        self.pin(node)
        self.hosts[node_id] = node
        return node

    def pin(self, node: Node) -> None:
        """known_hosts holds exactly the node's current host key (ed25519) for its address."""
        key = node.out("cat /etc/ssh/ssh_host_ed25519_key.pub").split()[:2]
        lines = [
            line
            for line in self.known_hosts.read_text().splitlines()
            if line and not line.startswith(node.ip + " ")
        ]
        self.known_hosts.write_text("\n".join([*lines, f"{node.ip} {' '.join(key)}"]) + "\n")

    def onboard(
        self, *args: str, as_json: bool = False, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        assert self.lab.server is not None
        return subprocess.run(
            [
                *LLMGW,
                "ctl",
                *(["--json"] if as_json else []),
                "onboard",
                *args,
                "--identity",
                str(self.key),
                "--ssh-option",
                f"UserKnownHostsFile={self.known_hosts}",
                "--ssh-option",
                "GlobalKnownHostsFile=/dev/null",
                "--timeout",
                "5m",
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={
                **os.environ,
                "LLMGW_SERVER": self.lab.server.url,
                "LLMGW_TOKEN": self.lab.server.admin_token,
                "LLMGW_CTL_CONFIG": "/dev/null",
            },
        )

    def tokens(self) -> list[dict[str, Any]]:
        assert self.lab.server is not None
        return self.lab.server.api("GET", "/api/join-tokens?all=1")


@pytest.fixture(scope="module")
def steps(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Steps:
    return Steps(lab, tmp_path_factory.mktemp("onboard"))


def leftovers(node: Node) -> str:
    """What is in the node's temporary folders, but the private ones systemd makes."""
    return node.out("find /tmp /var/tmp -mindepth 1 -maxdepth 1 ! -name 'systemd-private-*' -print")


class Sampler:
    """Every command line on this machine and in one container while a run goes on."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.local: set[str] = set()
        self.stop = threading.Event()
        node.sh("rm -f /run/stop-sampler")
        self.remote = subprocess.Popen(
            ["docker", "exec", node.container.name, "python3", "-c", SAMPLER],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stop.is_set():
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            self.local.add(f.read().replace(b"\0", b" ").decode(errors="replace"))
                    except OSError:
                        pass

    def finish(self) -> tuple[set[str], set[str]]:
        self.stop.set()
        self.thread.join()
        self.node.sh("touch /run/stop-sampler")
        out, _ = self.remote.communicate(timeout=60)
        return self.local, set(out.splitlines())


def test_one_host_is_installed_joined_approved_and_online(steps: Steps) -> None:
    node = steps.boot("ssh-one")
    temporary = leftovers(node)
    sampler = Sampler(node)
    run = steps.onboard("ssh-one", "--ssh", f"ops@{node.ip}", "--sudo", as_json=True)
    local, remote = sampler.finish()
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout)
    assert result["result"] == "online", result
    assert result["steps"] == [
        "connect",
        "download",
        "verify",
        "install",
        "join",
        "approve",
        "online",
    ]
    for step in ("ssh-one  connect: ops@", "ssh-one  download", "ssh-one  verify", "ssh-one  join"):
        assert step in run.stderr
    state = steps.lab.node_state("ssh-one")
    assert state is not None and state["state"] == "approved" and state["connected"]
    assert state["cpus"] and state["fingerprint"] == result["fingerprint"]
    # The fingerprint ctl approved is the one of the key on the host (its certificate's).
    on_host = node.out(
        "openssl x509 -in /var/lib/llmgw-agent/node.crt -pubkey -noout "
        "| openssl pkey -pubin -outform DER | sha256sum"
    ).split()[0]
    assert result["fingerprint"] == f"sha256:{on_host}"
    # The token: on no command line, here or there, while it ran; in no file left behind.
    [token] = [t for t in steps.tokens() if t["node"] == "ssh-one"]
    assert token["used_at"]
    prefix = token["prefix"]
    assert any("sh -s" in line for line in remote), "the sampler saw nothing of the run"
    assert any("onboard" in line for line in local), "the local sampler saw nothing of the run"
    assert [line for line in remote if prefix in line] == []
    assert [line for line in local if prefix in line] == []
    found = node.sh(
        f"grep -rlsF -e {prefix} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
        "--exclude-dir=lab",
        check=False,
    )
    assert found.stdout.strip() == "", found.stdout
    assert leftovers(node) == temporary  # the one-liner's download is gone
    local_files = subprocess.run(
        ["grep", "-rlsF", "-e", prefix, str(steps.tmp), str(Path.home() / ".ssh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert local_files.stdout.strip() == ""
    steps.node = node


def test_the_same_command_again_changes_nothing(steps: Steps) -> None:
    node = steps.hosts["ssh-one"]
    started = node.unit("InvocationID")
    tokens = len(steps.tokens())
    run = steps.onboard("ssh-one", "--ssh", f"ops@{node.ip}", "--sudo")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout == "ssh-one  skipped: already online; nothing done\n"
    assert len(steps.tokens()) == tokens
    assert node.unit("InvocationID") == started


def test_a_changed_host_key_is_refused_before_anything_runs(steps: Steps) -> None:
    node = steps.boot("ssh-two")
    node.sh("rm -f /etc/ssh/ssh_host_* && ssh-keygen -A && systemctl restart ssh")
    tokens = len(steps.tokens())
    run = steps.onboard("ssh-two", "--ssh", f"root@{node.ip}", "--wait-ssh", "30s")
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"ssh refused root@{node.ip}'s host key" in run.stderr
    assert f"ssh-keyscan {node.ip}" in run.stderr and f"ssh-keygen -R {node.ip}" in run.stderr
    assert len(steps.tokens()) == tokens
    journal = node.sh("journalctl -u ssh --no-pager", check=False).stdout
    assert "Accepted publickey" not in journal, journal
    assert node.sh(f"ls -d {INSTALLED} 2>/dev/null", check=False).stdout == ""


def test_a_failed_install_leaves_the_host_clean_and_revokes_the_token(steps: Steps) -> None:
    node = steps.hosts["ssh-two"]
    steps.pin(node)  # its new key, now known
    temporary = leftovers(node)
    assert steps.lab.server is not None
    port = steps.lab.server.url.rsplit(":", 1)[1]
    # The bundle URL is unreachable from this host (the enrolment port is not).
    node.sh(
        "nft add table inet llmgwtest && nft add chain inet llmgwtest out "
        "'{ type filter hook output priority 0; }' && "
        f"nft add rule inet llmgwtest out tcp dport {port} reject"
    )
    try:
        run = steps.onboard("ssh-two", "--ssh", f"root@{node.ip}")
    finally:
        node.sh("nft delete table inet llmgwtest")
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"the install on root@{node.ip} failed at download" in run.stderr
    [token] = [t for t in steps.tokens() if t["node"] == "ssh-two"]
    assert token["revoked_at"] and not token["used_at"], token
    assert node.sh(f"ls -d {INSTALLED} 2>/dev/null", check=False).stdout == ""
    assert node.sh("getent passwd llmgw-agent", check=False).returncode != 0
    assert leftovers(node) == temporary
    assert steps.lab.node_state("ssh-two") is None


def test_a_join_that_fails_inside_the_installer_is_rolled_back(steps: Steps) -> None:
    """The enrolment port unreachable: the bundle is installed, its join fails, and the
    installer takes back all it created (its rollback of a failed fresh install)."""
    node = steps.hosts["ssh-two"]
    temporary = leftovers(node)
    node.sh(
        "nft add table inet llmgwtest && nft add chain inet llmgwtest out "
        "'{ type filter hook output priority 0; }' && "
        f"nft add rule inet llmgwtest out tcp dport {steps.lab.enroll_port} reject"
    )
    try:
        run = steps.onboard("ssh-two", "--ssh", f"root@{node.ip}")
    finally:
        node.sh("nft delete table inet llmgwtest")
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"the install on root@{node.ip} failed at join" in run.stderr, run.stderr
    assert "nothing was left installed" in run.stderr, run.stderr
    tokens = [t for t in steps.tokens() if t["node"] == "ssh-two"]
    assert tokens and all(t["revoked_at"] and not t["used_at"] for t in tokens), tokens
    assert node.sh(f"ls -d {INSTALLED} 2>/dev/null", check=False).stdout == ""
    assert node.sh("getent passwd llmgw-agent", check=False).returncode != 0
    assert leftovers(node) == temporary
    assert steps.lab.node_state("ssh-two") is None


def test_many_hosts_one_unreachable(steps: Steps) -> None:
    two = steps.hosts["ssh-two"]
    three = steps.boot("ssh-three")
    hosts = steps.tmp / "hosts"
    # ssh-four: nothing listens on port 2 there.
    hosts.write_text(
        f"ssh-two root@{two.ip}\nssh-three root@{three.ip}\nssh-four root@{three.ip}:2\n"
    )
    # No retries (--wait-ssh, 2m by default, would wait that long on ssh-four's port).
    run = steps.onboard("--hosts", str(hosts), "--parallel", "3", "--wait-ssh", "0")
    assert run.returncode == 1, run.stdout + run.stderr
    table = run.stdout[run.stdout.index("NODE ") :].splitlines()
    rows = {line.split()[0]: line for line in table[1:]}
    assert rows["ssh-two"].split()[1] == "online", run.stdout
    assert rows["ssh-three"].split()[1] == "online", run.stdout
    assert rows["ssh-four"].split()[1] == "failed"
    assert f"ssh could not reach root@{three.ip}:2" in rows["ssh-four"]
    assert "1 of 3 hosts failed: ssh-four" in run.stderr
    for name in ("ssh-two", "ssh-three"):
        state = steps.lab.node_state(name)
        assert state is not None and state["state"] == "approved" and state["connected"]
    assert steps.lab.node_state("ssh-four") is None
    assert [t for t in steps.tokens() if t["node"] == "ssh-four"] == []
    again = steps.onboard("--hosts", str(hosts), "--wait-ssh", "0")
    assert again.returncode == 1
    assert "ssh-two    skipped: already online; nothing done" in again.stdout
    assert "ssh-three  skipped: already online; nothing done" in again.stdout


def package_source(steps: Steps, node: Node) -> list[str]:
    url, key = steps.lab.serve_repo(node)
    return ["--package", "--repo-url", url, "--repo-key", key]


def test_a_package_onboard_that_fails_at_its_join_leaves_no_package(steps: Steps) -> None:
    node = steps.boot("ssh-pkg")
    source = package_source(steps, node)
    temporary = leftovers(node)
    node.sh(
        "nft add table inet llmgwtest && nft add chain inet llmgwtest out "
        "'{ type filter hook output priority 0; }' && "
        f"nft add rule inet llmgwtest out tcp dport {steps.lab.enroll_port} reject"
    )
    try:
        run = steps.onboard("ssh-pkg", "--ssh", f"root@{node.ip}", *source)
    finally:
        node.sh("nft delete table inet llmgwtest")
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"the install on root@{node.ip} failed at join" in run.stderr, run.stderr
    assert "package llmgw-agent" in run.stderr and "nothing was left installed" in run.stderr
    tokens = [t for t in steps.tokens() if t["node"] == "ssh-pkg"]
    assert tokens and all(t["revoked_at"] and not t["used_at"] for t in tokens), tokens
    status = "dpkg-query -W -f '${db:Status-Status}' llmgw-agent 2>/dev/null || true"
    assert node.out(status) in ("", "not-installed")
    assert node.sh(f"ls -d {INSTALLED} {PACKAGED} 2>/dev/null", check=False).stdout == ""
    assert node.sh("getent passwd llmgw-agent", check=False).returncode != 0
    assert leftovers(node) == temporary
    assert steps.lab.node_state("ssh-pkg") is None


def test_a_package_onboard_brings_the_host_online(steps: Steps) -> None:
    node = steps.hosts["ssh-pkg"]
    run = steps.onboard(
        "ssh-pkg", "--ssh", f"root@{node.ip}", *package_source(steps, node), as_json=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout)
    assert result["result"] == "online", result
    assert node.out("dpkg-query -W -f '${db:Status-Status}' llmgw-agent") == "installed"
    assert node.out("readlink -f /usr/bin/llmgw") == "/usr/lib/llmgw/llmgw"
    assert node.sh("test -e /usr/local/lib/llmgw-agent", check=False).returncode != 0
    state = steps.lab.node_state("ssh-pkg")
    assert state is not None and state["state"] == "approved" and state["connected"]
    assert state["fingerprint"] == result["fingerprint"]
