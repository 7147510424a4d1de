"""``llmgw ctl onboard``: install, join and approve a node over ssh, one host or a file of
them, without pasting anything.

For each host: ssh in (the system client, the host key pinned in known_hosts: that key is
what authenticates the machine), mint a one-time token, run the bundle one-liner there with
the token inside the script ssh reads on its standard input (so it is on no command line and
in no file), read the node's certificate back over the same session, approve the node only
when the key in it is the one the enrolment received, and wait until it is online with its
inventory. A host that fails has its token revoked; the others go on.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from cryptography import x509

from llmgw import pki
from llmgw.cli.common import Duration
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.hostsfile import HostEntry, read_hosts
from llmgw.cli.ctl.join import FACT_PARAMS, fact_options, parse_facts
from llmgw.cli.ctl.output import echo_json
from llmgw.cli.ctl.progress import Display, HostResult, summary
from llmgw.contracts.nodefacts import NodeFacts
from llmgw.errors import (
    APIError,
    ConfigError,
    LlmgwError,
    OnboardError,
    SshUnreachable,
)
from llmgw.ssh import RemoteRun, SshTarget, last_lines, parse_destination

__all__ = ["HostPlan", "Onboarding", "install_script", "onboard", "probe_script"]

STATE_DIR = "/var/lib/llmgw-agent"  # the installer's STATE_DIR: node.crt is there
MARK = "@@llmgw "  # the lines our scripts print about themselves
TOKEN_TTL = 1800  # seconds: a token lives as long as an install may take, not longer
RETRY_INTERVAL = 2.0  # seconds between two tries of ssh while a host does not answer
POLL_INTERVAL = 1.0  # seconds between two looks at the node while waiting for it online
# Where a hosts file's per-host keys go among the command's parameters.
_FACT_PARAM = {"fabric": "fabrics", "engine": "engines"}


def probe_script() -> str:
    """What the first session runs: it proves the host key, the login and sudo, and says
    whether it runs as root, before any token exists."""
    return 'exec 2>&1\necho "@@llmgw connected uid=$(id -u)"\n'


def install_script(command: str) -> str:
    """The install session's script around the one-liner ``command`` (which holds the token):
    all of it inside ``main``, so the shell has read it whole before anything runs (and a
    cut-off transfer runs nothing), standard input /dev/null for what it starts; then the
    node's certificate, for its key's fingerprint."""
    return (
        "main() {\n"
        "    exec 2>&1\n"
        f'    [ "$(id -u)" -eq 0 ] || {{ echo "{MARK}not-root"; exit 3; }}\n'
        f'    echo "{MARK}download"\n'
        f'    {command} || {{ rc=$?; echo "{MARK}failed $rc"; exit $rc; }}\n'
        f'    echo "{MARK}cert"\n'
        f"    cat {STATE_DIR}/node.crt\n"
        f'    echo "{MARK}end"\n'
        "}\n"
        "main </dev/null\n"
    )


@dataclass(frozen=True)
class HostPlan:
    """One host to onboard: its node id, where to ssh and how, its node facts, and the
    signed repository to install the package from (``install-agent.sh package``) if any."""

    node: str
    target: SshTarget
    sudo: bool
    facts: NodeFacts
    package: dict[str, str] | None = None


@dataclass(frozen=True)
class Timing:
    """The bounds of one host's onboarding."""

    wait_ssh: float  # retry ssh (refused, timed out) this long
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

    def _step(self, step: str, note: str = "") -> None:
        self.steps.append(step)
        self.report(step, note)

    # -- the steps ------------------------------------------------------------------------------

    def already_online(self) -> bool:
        """Whether the node is approved and connected already: a re-run leaves it alone."""
        node = self._node()
        return node is not None and node["state"] == "approved" and bool(node["connected"])

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
        deadline = self.clock() + self.timing.wait_ssh
        while True:
            try:
                result = self.remote.run(probe_script(), timeout=60)
                break
            except SshUnreachable:
                if self.clock() >= deadline:
                    raise
                self.report("connect", f"{where}: no answer yet, trying again")
                self.sleep(RETRY_INTERVAL)
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

    def mint(self) -> dict[str, Any]:
        body: dict[str, Any] = {"node": self.plan.node, "ttl": TOKEN_TTL}
        if self.plan.facts.as_json():
            body["facts"] = self.plan.facts.as_json()
        if self.plan.package:
            body["package"] = dict(self.plan.package)
        data: dict[str, Any] = self.c.call("POST", "/api/join-tokens", body)
        self.token_id = data["id"]
        if "/agent/bundles/" not in data["command"]:
            self.revoke_token()
            raise OnboardError(
                "the control plane serves no agent bundles, and onboard installs from one; "
                "copy llmgw-agent-*-linux-<arch>.tar.gz (make dist) into the bundle_dir of "
                "its server.yaml, then run onboard again"
            )
        return data

    def install(self, command: str) -> str:
        """The install session: download, verify, install and join, followed in what the
        one-liner and the installer print; the node's certificate (PEM) it ends with."""
        step = ["download"]

        def follow(line: str) -> None:
            if line == MARK + "download":
                self._step("download")
            elif line.endswith("agent.tar.gz: OK") and step[0] == "download":
                step[0] = "install"
                self._step("verify", "SHA-256 matches the one the token's command holds")
                self._step("install")
            elif line.startswith("==> join:") and step[0] == "install":
                step[0] = "join"
                self._step("join")
            elif line.startswith("==> ") and step[0] == "install":
                self.report("install", line[4:])

        result = self.remote.run(
            install_script(command), timeout=self.timing.install, on_line=follow
        )
        where = self.plan.target.describe()
        if result.returncode != 0 or MARK + "end" not in result.output:
            said = [line for line in result.output if not line.startswith(MARK)]
            raise OnboardError(
                f"the install on {where} failed at {self.steps[-1]} (exit "
                f"{result.returncode}):\n{last_lines(said)}"
            )
        begin = result.output.index(MARK + "cert")
        end = result.output.index(MARK + "end")
        return "\n".join(result.output[begin + 1 : end]) + "\n"

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

    def wait_online(self) -> None:
        """Until the node is connected, approved and its inventory stored."""
        deadline = self.clock() + self.timing.online
        while True:
            node = self._node()
            if (
                node is not None
                and node["state"] == "approved"
                and node["connected"]
                and node.get("cpus") is not None
            ):
                gpus = len(node.get("gpus") or [])
                self._step("online", f"{node['cpus']} CPUs, {gpus} GPUs, {node['health']}")
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


def onboard_host(
    c: Ctl, plan: HostPlan, timing: Timing, display: Display
) -> tuple[HostResult, LlmgwError | None]:
    """One host from start to end, its failure caught (the other hosts go on)."""
    result = HostResult(node=plan.node, destination=plan.target.describe())
    started = time.monotonic()
    onboarding = Onboarding(c, plan, timing, lambda step, note: display.step(plan.node, step, note))
    error: LlmgwError | None = None
    try:
        if onboarding.already_online():
            result.result = "skipped"
            display.step(plan.node, "skipped", "already online; nothing done")
        else:
            onboarding.run()
            result.result = "online"
    except LlmgwError as exc:
        error = exc
        result.error = str(exc).splitlines()[0]
        display.step(plan.node, "failed", result.error)
    result.seconds = time.monotonic() - started
    result.fingerprint = onboarding.fingerprint
    result.steps = onboarding.steps
    return result, error


def plan_hosts(
    entries: Sequence[HostEntry],
    defaults: Mapping[str, Any],
    ssh_defaults: Mapping[str, Any],
    package: dict[str, str] | None = None,
) -> list[HostPlan]:
    """Each entry's plan: the command line's options, those the entry sets replacing them."""
    plans = []
    for entry in entries:
        values = dict(defaults)
        for key, value in entry.settings.items():
            if key in ("identity", "ssh_option", "sudo"):
                continue
            values[_FACT_PARAM.get(key, key)] = value
        try:
            facts = NodeFacts.parse(**{k: values[k] for k in FACT_PARAMS})
            identity = entry.settings.get("identity", ssh_defaults["identity"])
            target = SshTarget(
                host=entry.host,
                user=entry.user,
                port=entry.port,
                identity=Path(identity).expanduser() if identity else None,
                options=tuple(entry.settings.get("ssh_option", ssh_defaults["options"])),
            )
        except ConfigError as exc:
            raise ConfigError(f"{entry.node} (line {entry.line}): {exc}") from None
        sudo = bool(entry.settings.get("sudo", ssh_defaults["sudo"]))
        plans.append(
            HostPlan(node=entry.node, target=target, sudo=sudo, facts=facts, package=package)
        )
    return plans


@click.command("onboard")
@click.argument("node", required=False)
@click.option("--ssh", "destination", metavar="[USER@]HOST", help="Where to ssh for NODE.")
@click.option("--port", type=click.IntRange(1, 65535), help="ssh's port (default: ssh's).")
@click.option(
    "--identity",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The private key to log in with (default: the ssh agent, ~/.ssh/config).",
)
@click.option(
    "--ssh-option",
    "ssh_options",
    multiple=True,
    metavar="K=V",
    help="An ssh -o option, e.g. ProxyJump=bastion (repeatable; never BatchMode or "
    "StrictHostKeyChecking).",
)
@click.option("--sudo", is_flag=True, help="Run the installer with sudo -n (passwordless).")
@click.option(
    "--package",
    is_flag=True,
    help="Install the signed llmgw-agent package (install-agent.sh package, apt or dnf) from "
    "--repo-url instead of the bundle's binary.",
)
@click.option("--repo-url", metavar="URL", help="With --package: the signed repository's URL.")
@click.option(
    "--repo-key",
    metavar="FILE|URL",
    help="With --package: its public key (a path on the host, or a URL).",
)
@click.option(
    "--wait-ssh",
    type=Duration(),
    default="0",
    help="Retry ssh while the host refuses or does not answer (a machine booting), this "
    "long, e.g. 5m; a host key refusal is never retried.",
)
@click.option(
    "--timeout",
    type=Duration(minimum=10),
    default="10m",
    show_default=True,
    help="The install at most, and again the wait for the node online.",
)
@click.option(
    "--hosts",
    "hosts_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Onboard every host of FILE: lines 'NODE [USER@]HOST[:PORT]', or a YAML list with "
    "per-host options; instead of NODE --ssh.",
)
@click.option(
    "--parallel",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="With --hosts: this many hosts at once.",
)
@fact_options
@pass_ctl
def onboard(
    c: Ctl,
    node: str | None,
    destination: str | None,
    port: int | None,
    identity: Path | None,
    ssh_options: tuple[str, ...],
    sudo: bool,
    package: bool,
    repo_url: str | None,
    repo_key: str | None,
    wait_ssh: float,
    timeout: float,
    hosts_file: Path | None,
    parallel: int,
    **facts: Any,
) -> None:
    """Install, join and approve a node over ssh: NODE --ssh [USER@]HOST, or every host of
    --hosts FILE. The ssh host key must be in known_hosts already (it is what proves the
    machine is the one meant); the token goes to the host on ssh's standard input only, and
    the node is approved only when the key it enrolled with is the one on that host. A node
    online already is left as it is."""
    if package != bool(repo_url) or package != bool(repo_key):
        raise click.UsageError(
            "--package installs from a signed repository: give it with --repo-url URL and "
            "--repo-key FILE|URL (and those two only with --package)"
        )
    source = {"repo_url": repo_url, "repo_key": repo_key} if repo_url and repo_key else None
    if hosts_file is not None:
        if node or destination or port:
            raise click.UsageError(
                "--hosts FILE lists the nodes and their hosts: give it without NODE, --ssh "
                "and --port (a port goes in the file, HOST:PORT)"
            )
        entries = read_hosts(hosts_file)
        plans = plan_hosts(
            entries,
            facts,
            {"identity": identity, "options": ssh_options, "sudo": sudo},
            source,
        )
    else:
        if not node or not destination:
            raise click.UsageError("give NODE --ssh [USER@]HOST (one host), or --hosts FILE (many)")
        parsed_facts = parse_facts(facts)
        try:
            user, host, dest_port = parse_destination(destination)
            if dest_port and port and dest_port != port:
                raise ConfigError(f"--ssh {destination} and --port {port} name two ports")
            target = SshTarget(
                host=host,
                user=user,
                port=port or dest_port,
                identity=identity.expanduser() if identity else None,
                options=ssh_options,
            )
        except ConfigError as exc:
            raise click.UsageError(str(exc)) from None
        plans = [HostPlan(node=node, target=target, sudo=sudo, facts=parsed_facts, package=source)]
    if shutil.which("ssh") is None:
        raise OnboardError(
            "no ssh client on this machine; install OpenSSH's (apt-get install openssh-client)"
        )
    timing = Timing(wait_ssh=wait_ssh, install=timeout, online=timeout)
    out = sys.stderr if c.as_json else sys.stdout
    live = hosts_file is not None and out.isatty()
    display = Display(
        out, [p.node for p in plans], live=live, columns=shutil.get_terminal_size().columns
    )
    with ThreadPoolExecutor(max_workers=parallel if hosts_file else 1) as pool:
        done = list(pool.map(lambda p: onboard_host(c, p, timing, display), plans))
    results = [r for r, _ in done]
    failures = [(r, e) for r, e in done if e is not None]
    if c.as_json:
        echo_json([r.as_json() for r in results] if hosts_file else results[0].as_json())
    elif hosts_file is not None:
        click.echo("")
        click.echo(summary(results))
    if hosts_file is None:
        if failures:
            error = failures[0][1]
            assert error is not None
            raise error
        return
    if failures:
        raise OnboardError(
            f"{len(failures)} of {len(results)} hosts failed: "
            f"{', '.join(r.node for r, _ in failures)}; their tokens are revoked. Fix what the "
            "table says and run the same command again: the nodes online are skipped"
        )
