"""One host's onboarding over ssh, step by step, as ``llmgw ctl onboard`` runs it for each
host: ssh in (the system client, the host key pinned in known_hosts, or accepted when new
with ``--accept-new-host-key`` and its fingerprint shown), mint a one-time token, run the
bundle one-liner there with the token inside the script ssh reads on its standard input (so
it is on no command line and in no file), read the node's certificate back over the same
session, approve the node only when the key in it is the one the enrolment received, and
wait until it is online with its inventory.

Both sessions are tried again while ssh cannot reach the host or is cut off (``wait_ssh``: a
machine booting, sshd restarting under cloud-init); the install script is safe to run again
(the installer skips a join that is done). A node id that exists already is joined afresh
only when it is revoked: a machine that is that node is rekeyed (``rekey``) or re-paired
(``re-pair``), never silently given a new identity.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cryptography import x509

from llmgw import pki
from llmgw.cli.ctl.context import Ctl
from llmgw.contracts.joining import REPAIR_FIELD, REPAIR_FLAG, JoinKind
from llmgw.contracts.nodefacts import NodeFacts
from llmgw.errors import APIError, OnboardError, SshUnreachable
from llmgw.ssh import RemoteResult, RemoteRun, SshTarget, last_lines

__all__ = [
    "MAX_HOSTNAME",
    "HostPlan",
    "Mode",
    "Onboarding",
    "Timing",
    "install_script",
    "probe_script",
]

STATE_DIR = "/var/lib/llmgw-agent"  # the installer's STATE_DIR: node.crt is there
MARK = "@@llmgw "  # the lines our scripts print about themselves
TOKEN_TTL = 1800  # seconds: a token lives as long as an install may take, not longer
RETRY_INTERVAL = 2.0  # seconds between two tries of ssh while a host does not answer
POLL_INTERVAL = 1.0  # seconds between two looks at the node while waiting for it online
MAX_HOSTNAME = 64  # the kernel's limit on a host name (HOST_NAME_MAX)
# The engine states of 'GET /api/engines' that mean the control plane is still at work.
_BUSY = ("waiting", "installing")
_STUCK = ("failed", "no-build")


Mode = JoinKind
"""What onboarding does with the node id (the join contract's kinds): join a new node, or,
for a machine that is an existing node, rekey it (its state directory is there) or re-pair it
(it is gone); ``--{mode}`` is onboard's flag of each."""


def probe_script() -> str:
    """What the first session runs: it proves the host key, the login and sudo, and says
    whether it runs as root and what the machine is called, before any token exists."""
    return 'exec 2>&1\necho "@@llmgw connected uid=$(id -u)"\necho "@@llmgw hostname $(uname -n)"\n'


def _hostname_steps(node: str) -> str:
    """Shell lines that name the machine ``node`` (hostnamectl, else hostname and
    /etc/hostname; /etc/hosts' 127.0.1.1 line too, so that the name resolves), unless it is."""
    q = shlex.quote(node)
    return (
        "    h=$(uname -n)\n"
        f'    if [ "$h" != {q} ]; then\n'
        f"        {{ command -v hostnamectl >/dev/null 2>&1 && hostnamectl set-hostname {q}; }} \\\n"
        f"            || {{ hostname {q} && printf '%s\\n' {q} >/etc/hostname; }} \\\n"
        f'            || {{ echo "{MARK}hostname-failed"; exit 4; }}\n'
        "        if grep -q '^127\\.0\\.1\\.1[[:space:]]' /etc/hosts 2>/dev/null; then\n"
        f"            sed -i 's/^127\\.0\\.1\\.1[[:space:]].*/127.0.1.1\\t{node}/' /etc/hosts\n"
        "        fi\n"
        f'        echo "{MARK}hostname-set $h"\n'
        "    fi\n"
    )


def install_script(command: str, *, hostname: str | None = None) -> str:
    """The install session's script around the one-liner ``command`` (which holds the token):
    all of it inside ``main``, so the shell has read it whole before anything runs (and a
    cut-off transfer runs nothing), standard input /dev/null for what it starts; then the
    node's certificate, for its key's fingerprint. ``hostname``: name the machine so first."""
    return (
        "main() {\n"
        "    exec 2>&1\n"
        f'    [ "$(id -u)" -eq 0 ] || {{ echo "{MARK}not-root"; exit 3; }}\n'
        + (_hostname_steps(hostname) if hostname else "")
        + f'    echo "{MARK}download"\n'
        f'    {command} || {{ rc=$?; echo "{MARK}failed $rc"; exit $rc; }}\n'
        f'    echo "{MARK}cert"\n'
        f"    cat {STATE_DIR}/node.crt\n"
        f'    echo "{MARK}end"\n'
        "}\n"
        "main </dev/null\n"
    )


@dataclass(frozen=True)
class HostPlan:
    """One host to onboard: its node id, where to ssh and how, its node facts, the signed
    repository to install the package from (``install-agent.sh package``) if any, what to do
    with the node id (``mode``) and whether to name the machine after it."""

    node: str
    target: SshTarget
    sudo: bool
    facts: NodeFacts
    package: dict[str, str] | None = None
    mode: Mode = Mode.JOIN
    set_hostname: bool = False


@dataclass(frozen=True)
class Timing:
    """The bounds of one host's onboarding."""

    wait_ssh: float  # retry ssh (refused, timed out, cut off) this long
    install: float  # the install session at most
    online: float  # the node online after its approval


class Onboarding:
    """One host's onboarding, step by step, reported through ``report(step, note)``. Raises
    the LlmgwError of the step that failed, after revoking the token it minted."""

    def __init__(
        self,
        c: Ctl,
        plan: HostPlan,
        timing: Timing,
        report: Callable[[str, str], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.c = c
        self.plan = plan
        self.timing = timing
        self.report = report
        self.clock = clock
        self.sleep = sleep or time.sleep
        self.remote = RemoteRun(plan.target, sudo=plan.sudo)
        self.token_id: str | None = None
        self.fingerprint: str | None = None
        self.steps: list[str] = []
        self.warnings: list[str] = []

    def _step(self, step: str, note: str = "") -> None:
        self.steps.append(step)
        self.report(step, note)

    def _warn(self, step: str, warning: str) -> None:
        self.warnings.append(warning)
        self.report(step, f"warning: {warning}")

    # -- the steps ------------------------------------------------------------------------------

    def wanted(self) -> bool:
        """Whether this host is onboarded now. False for a node online already (a re-run
        leaves it alone), unless a rekey or re-pair is asked for. OnboardError for a node id
        that exists when none was asked for (a fresh join would give it a new identity), and
        for one that does not, or is revoked, when one was."""
        node = self._node()
        plan = self.plan
        if plan.mode == Mode.JOIN:
            if node is None or node["state"] == "revoked":
                return True
            if node["state"] == "approved" and node["connected"]:
                return False
            connected = "connected" if node["connected"] else "not connected"
            raise OnboardError(
                f"node {plan.node} exists already ({node['state']}, {connected}), and "
                "onboarding it again would join it afresh: a new uid, its old certificates "
                f"denied. If {plan.target.describe()} is that node, add --rekey (its state "
                f"directory {STATE_DIR} is there) or {REPAIR_FLAG} (it is gone); to put another "
                f"machine under this id, revoke the old node first: llmgw ctl revoke {plan.node}"
            )
        if node is None:
            raise OnboardError(
                f"node {plan.node} does not exist on this control plane, so there is nothing "
                f"to {plan.mode}; leave out --{plan.mode} to join it as a new node"
            )
        if node["state"] == "revoked":
            raise OnboardError(
                f"node {plan.node} is revoked, and a revoked node comes back only through a "
                f"fresh join: leave out --{plan.mode}"
            )
        return True

    def run(self) -> None:
        self.connect()
        data = self.mint()
        try:
            cert_pem = self.install(data["command"])
            self.approve(cert_pem)
        except BaseException:
            self.revoke_token()
            raise
        self.wait_online()

    def connect(self) -> None:
        """ssh in and run the probe, again and again while the host does not answer, until
        ``wait_ssh``; a host key, login or sudo refusal is final at once."""
        where = self.plan.target.describe()
        self._step("connect", where)
        result = self._retried(
            "connect",
            lambda: self.remote.run(
                probe_script(), timeout=60, verbose=self.plan.target.accept_new_host_key
            ),
        )
        key = result.host_key
        if key is not None and key.added:
            self.report(
                "connect",
                f"{where}: accepted its new host key {key.fingerprint} ({key.type}) into "
                "known_hosts; compare it with the machine's own (ssh-keygen -lf "
                "/etc/ssh/ssh_host_*_key.pub on its console, or its provisioning system's)",
            )
        said = [line for line in result.output if line.startswith(MARK + "connected")]
        if result.returncode != 0 or not said:
            raise OnboardError(
                f"the first command on {where} failed (exit {result.returncode}):\n"
                f"{last_lines(result.output)}\nrun 'ssh {shlex.quote(where)} true' to see why"
            )
        if said[-1] != MARK + "connected uid=0":
            target = self.plan.target
            user = target.user or "the user ssh logs in as"
            raise OnboardError(
                f"{user} on {target.host} is not root, and the installer needs root: add --sudo "
                "(passwordless sudo there), or ssh as root"
            )
        named = [line for line in result.output if line.startswith(MARK + "hostname ")]
        hostname = named[-1].removeprefix(MARK + "hostname ") if named else ""
        if hostname and hostname != self.plan.node and not self.plan.set_hostname:
            self._warn(
                "connect",
                f"{where} is called {hostname}, not {self.plan.node}: one name for host, node "
                "and certificate keeps logs, alerts and the console in step; --set-hostname "
                f"names it {self.plan.node}",
            )

    def _retried(self, step: str, attempt: Callable[[], RemoteResult]) -> RemoteResult:
        """``attempt`` again while ssh cannot reach the host or is cut off, for ``wait_ssh``
        from the first failure; other refusals are final."""
        deadline: float | None = None
        while True:
            try:
                return attempt()
            except SshUnreachable:
                now = self.clock()
                deadline = now + self.timing.wait_ssh if deadline is None else deadline
                if now >= deadline:
                    raise
                self.report(
                    step,
                    f"{self.plan.target.describe()}: no answer yet, or cut off (sshd "
                    "restarting?); trying again",
                )
                self.sleep(RETRY_INTERVAL)

    def mint(self) -> dict[str, Any]:
        plan = self.plan
        body: dict[str, Any] = {"node": plan.node, "ttl": TOKEN_TTL}
        if plan.mode != Mode.JOIN:
            body["rekey"] = True
        if plan.mode == Mode.REPAIR:
            body[REPAIR_FIELD] = True
        if plan.facts.as_json():
            body["facts"] = plan.facts.as_json()
        if plan.package:
            body["package"] = dict(plan.package)
        data: dict[str, Any] = self.c.call("POST", "/api/join-tokens", body)
        self.token_id = data["id"]
        if "/agent/bundles/" not in data["command"]:
            self.revoke_token()
            raise OnboardError(
                "the control plane serves no agent bundles, and onboard installs from one; "
                "install the llmgw-agent-bundles package on it, or copy "
                "llmgw-agent-*-linux-<arch>.tar.gz (make dist) into the bundle_dir of its "
                "server.yaml, then run onboard again"
            )
        return data

    def install(self, command: str) -> str:
        """The install session: download, verify, install and join (or rekey), followed in
        what the one-liner and the installer print, tried again while ssh cannot reach the
        host; the node's certificate (PEM) it ends with."""
        script = install_script(
            command, hostname=self.plan.node if self.plan.set_hostname else None
        )
        result = self._retried(
            "install",
            lambda: self.remote.run(script, timeout=self.timing.install, on_line=self._follower()),
        )
        where = self.plan.target.describe()
        if MARK + "hostname-failed" in result.output:
            said = [line for line in result.output if not line.startswith(MARK)]
            raise OnboardError(
                f"could not name {where} {self.plan.node} (hostnamectl and hostname both "
                f"failed):\n{last_lines(said)}\nname it there, or leave out --set-hostname"
            )
        if result.returncode != 0 or MARK + "end" not in result.output:
            said = [line for line in result.output if not line.startswith(MARK)]
            raise OnboardError(
                f"the install on {where} failed at {self.steps[-1]} (exit "
                f"{result.returncode}):\n{last_lines(said)}"
            )
        begin = result.output.index(MARK + "cert")
        end = result.output.index(MARK + "end")
        return "\n".join(result.output[begin + 1 : end]) + "\n"

    def _follower(self) -> Callable[[str], None]:
        """What each line of the install session says about the step it is at."""
        step = ["download"]

        def follow(line: str) -> None:
            if line.startswith(MARK + "hostname-set "):
                was = line.removeprefix(MARK + "hostname-set ")
                self._step("hostname", f"{self.plan.node} (was {was})")
            elif line == MARK + "download":
                self._step("download")
            elif line.endswith("agent.tar.gz: OK") and step[0] == "download":
                step[0] = "install"
                self._step("verify", "SHA-256 matches the one the token's command holds")
                self._step("install")
            elif line.startswith(("==> join:", "==> rekey:")) and step[0] == "install":
                step[0] = "rekey" if line.startswith("==> rekey:") else "join"
                self._step(step[0])
            elif line.startswith("==> ") and step[0] == "install":
                self.report("install", line[4:])

        return follow

    def approve(self, cert_pem: str) -> None:
        """Approve the node when the key of the certificate read over ssh is the one the
        enrolment received; else reject it and say so."""
        try:
            cert = x509.load_pem_x509_certificate(cert_pem.encode())
        except ValueError:
            raise OnboardError(
                f"{self.plan.target.describe()} has no readable certificate in "
                f"{STATE_DIR}/node.crt after its join; see 'install-agent.sh status' there"
            ) from None
        on_host = pki.fingerprint(cert.public_key())
        node = self._node()
        enrolled = None if node is None else node.get("fingerprint")
        if enrolled != on_host:
            if node is not None:
                self.c.call("POST", f"/api/nodes/{self.plan.node}/reject")
            raise OnboardError(
                f"node {self.plan.node} enrolled with key {enrolled}, but the key on "
                f"{self.plan.target.describe()} is {on_host}: someone else used its token. "
                "The node is rejected, nothing approved; find out who joined, then onboard "
                "it again"
            )
        self.fingerprint = on_host
        if node is not None and node["state"] != "approved":
            self.c.call("POST", f"/api/nodes/{self.plan.node}/approve", {"fingerprint": on_host})
            self._step("approve", on_host)
        else:
            self._step("approve", f"{on_host} (approved already: a rekey keeps its approval)")

    def wait_online(self) -> None:
        """Until the node is connected, approved and its inventory stored; its last line says
        why it is degraded, if it is, after the engines the control plane is installing."""
        deadline = self.clock() + self.timing.online
        while True:
            node = self._node()
            if (
                node is not None
                and node["state"] == "approved"
                and node["connected"]
                and node.get("cpus") is not None
            ):
                self._engines()
                gpus = len(node.get("gpus") or [])
                note = f"{node['cpus']} CPUs, {gpus} GPUs, {node['health']}"
                reasons = [str(r.get("message", "")) for r in node.get("degraded") or []]
                if reasons:
                    note += ": " + "; ".join(reasons)
                self._step("online", note)
                return
            if self.clock() >= deadline:
                state = "no record" if node is None else node["state"]
                connected = bool(node and node["connected"])
                raise OnboardError(
                    f"node {self.plan.node} was approved but is not online with its inventory "
                    f"after {self.timing.online:.0f}s ({state}, "
                    f"{'connected' if connected else 'not connected'}); see 'journalctl -u "
                    "llmgw-agent' on it"
                )
            self.sleep(POLL_INTERVAL)

    def _engines(self) -> None:
        """Say which desired engines the control plane is installing on the node now, and
        which it cannot (their reasons); nothing when all are in place."""
        try:
            data = self.c.call("GET", f"/api/engines?node={self.plan.node}")
        except APIError:
            return  # a control plane without the engines API: nothing to say
        rows = [r for r in data.get("nodes", []) if r.get("node") == self.plan.node]
        busy = [f"{r['engine']} {r['desired']}" for r in rows if r.get("state") in _BUSY]
        stuck = [str(r.get("reason")) for r in rows if r.get("state") in _STUCK]
        if not busy and not stuck:
            return
        parts = [f"installing {', '.join(busy)}"] if busy else []
        self._step(
            "engines",
            "; ".join(parts + stuck) + " (the control plane's desired engines: follow them "
            "with 'llmgw ctl engines')",
        )

    def revoke_token(self) -> None:
        """Revoke the token minted here, unless it was spent (then there is nothing left to
        revoke: the node record says what came of it)."""
        if self.token_id is None:
            return
        try:
            self.c.call("DELETE", f"/api/join-tokens/{self.token_id}")
        except APIError as exc:
            if exc.status not in (404, 409):
                raise
        self.token_id = None

    def _node(self) -> dict[str, Any] | None:
        try:
            node: dict[str, Any] = self.c.call("GET", f"/api/nodes/{self.plan.node}")
        except APIError as exc:
            if exc.status == 404:
                return None
            raise
        return node
