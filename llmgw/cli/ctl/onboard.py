"""``llmgw ctl onboard``: install, join and approve a node over ssh, one host or a file of
them, without pasting anything; each host's steps are :mod:`llmgw.cli.ctl.onboarding`'s.

A host that fails has its token revoked; the others go on. A node online already is left
as it is; one that exists otherwise is refused unless ``--rekey`` or ``--re-pair`` says
what the machine is.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click

from llmgw.cli.common import Duration
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.hostsfile import HostEntry, read_hosts
from llmgw.cli.ctl.join import (
    FACT_PARAMS,
    fact_options,
    parse_facts,
    read_repair_flags,
    repair_options,
)
from llmgw.cli.ctl.onboarding import MAX_HOSTNAME, HostPlan, Mode, Onboarding, Timing
from llmgw.cli.ctl.output import echo_json
from llmgw.cli.ctl.progress import Display, HostResult, summary
from llmgw.contracts.joining import JoinOptions, JoinRefused
from llmgw.contracts.nodefacts import FACT_OPTIONS, NodeFacts
from llmgw.errors import ConfigError, LlmgwError, OnboardError
from llmgw.ssh import SshTarget, parse_destination

__all__ = ["onboard"]

# Where a hosts file's per-host keys go among the command's parameters.
_FACT_PARAM = {"fabric": "fabrics", "engine": "engines"}


def onboard_host(
    c: Ctl, plan: HostPlan, timing: Timing, display: Display
) -> tuple[HostResult, LlmgwError | None]:
    """One host from start to end, its failure caught (the other hosts go on)."""
    result = HostResult(node=plan.node, destination=plan.target.describe())
    started = time.monotonic()
    onboarding = Onboarding(c, plan, timing, lambda step, note: display.step(plan.node, step, note))
    error: LlmgwError | None = None
    try:
        if onboarding.wanted():
            onboarding.run()
            result.result = "online"
        else:
            result.result = "skipped"
            display.step(plan.node, "skipped", "already online; nothing done")
    except LlmgwError as exc:
        error = exc
        result.error = str(exc).splitlines()[0]
        display.step(plan.node, "failed", result.error)
    result.seconds = time.monotonic() - started
    result.fingerprint = onboarding.fingerprint
    result.steps = onboarding.steps
    result.warnings = onboarding.warnings
    return result, error


def plan_hosts(
    entries: Sequence[HostEntry],
    defaults: Mapping[str, Any],
    ssh_defaults: Mapping[str, Any],
    package: dict[str, str] | None = None,
    *,
    mode: Mode = Mode.JOIN,
    set_hostname: bool = False,
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
                accept_new_host_key=ssh_defaults["accept_new"],
            )
        except ConfigError as exc:
            raise ConfigError(f"{entry.node} (line {entry.line}): {exc}") from None
        sudo = bool(entry.settings.get("sudo", ssh_defaults["sudo"]))
        plans.append(
            HostPlan(
                node=entry.node,
                target=target,
                sudo=sudo,
                facts=facts,
                package=package,
                mode=mode,
                set_hostname=set_hostname,
            )
        )
    return plans


def _check_modes(rekey: bool, re_pair: bool, package: bool, facts: NodeFacts) -> Mode:
    """The mode the flags ask for, checked by the join contract (before anything)."""
    try:
        options = JoinOptions.of_modes(
            rekey=rekey, re_pair=re_pair, package=package, facts=tuple(facts.given(FACT_OPTIONS))
        ).check()
    except JoinRefused as exc:
        raise click.UsageError(str(exc)) from None
    return options.kind


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
@click.option(
    "--accept-new-host-key",
    is_flag=True,
    help="Accept a host key known_hosts does not have yet (as StrictHostKeyChecking="
    "accept-new), printing its fingerprint to compare; a changed key is still refused.",
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
    "--rekey",
    is_flag=True,
    help="The machine is that node, its state directory kept: give it a new key (same uid, "
    "history and approval). Needed for a node id that exists.",
)
@repair_options(
    "The machine is that node but its state directory is gone: re-pair it by its uid "
    "(approved by fingerprint again). Needed for a node id that exists (old name: "
    "--lost-state)."
)
@click.option(
    "--set-hostname",
    is_flag=True,
    help="Name the machine after its node id (hostnamectl; /etc/hosts' 127.0.1.1 line): one "
    "name for host, node and certificate. Without it, a different name is warned about.",
)
@click.option(
    "--wait-ssh",
    type=Duration(),
    default="2m",
    show_default=True,
    help="Retry ssh while the host refuses, does not answer or cuts the session off (a "
    "machine booting, sshd restarting under cloud-init), this long, for the first session "
    "and again for the install; 0: never. A host key refusal is never retried.",
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
    accept_new_host_key: bool,
    sudo: bool,
    package: bool,
    repo_url: str | None,
    repo_key: str | None,
    rekey: bool,
    re_pair: bool,
    old_repair: bool,
    set_hostname: bool,
    wait_ssh: float,
    timeout: float,
    hosts_file: Path | None,
    parallel: int,
    **facts: Any,
) -> None:
    """Install, join and approve a node over ssh: NODE --ssh [USER@]HOST, or every host of
    --hosts FILE. The ssh host key must be in known_hosts already (it is what proves the
    machine is the one meant), unless --accept-new-host-key; the token goes to the host on
    ssh's standard input only, and the node is approved only when the key it enrolled with
    is the one on that host. A node online already is left as it is; a node id that exists
    otherwise needs --rekey or --re-pair."""
    if package != bool(repo_url) or package != bool(repo_key):
        raise click.UsageError(
            "--package installs from a signed repository: give it with --repo-url URL and "
            "--repo-key FILE|URL (and those two only with --package)"
        )
    source = {"repo_url": repo_url, "repo_key": repo_key} if repo_url and repo_key else None
    re_pair = read_repair_flags(re_pair, old_repair)
    mode = _check_modes(rekey, re_pair, package, parse_facts(facts))
    ssh_defaults = {
        "identity": identity,
        "options": ssh_options,
        "sudo": sudo,
        "accept_new": accept_new_host_key,
    }
    if hosts_file is not None:
        if node or destination or port:
            raise click.UsageError(
                "--hosts FILE lists the nodes and their hosts: give it without NODE, --ssh "
                "and --port (a port goes in the file, HOST:PORT)"
            )
        entries = read_hosts(hosts_file)
        plans = plan_hosts(
            entries, facts, ssh_defaults, source, mode=mode, set_hostname=set_hostname
        )
    else:
        if not node or not destination:
            raise click.UsageError("give NODE --ssh [USER@]HOST (one host), or --hosts FILE (many)")
        target = _one_target(destination, port, ssh_defaults)
        plans = [
            HostPlan(
                node=node,
                target=target,
                sudo=sudo,
                facts=parse_facts(facts),
                package=source,
                mode=mode,
                set_hostname=set_hostname,
            )
        ]
    if set_hostname:
        _check_host_names(plans)
    if shutil.which("ssh") is None:
        raise OnboardError(
            "no ssh client on this machine; install OpenSSH's (apt-get install openssh-client)"
        )
    timing = Timing(wait_ssh=wait_ssh, install=timeout, online=timeout)
    _onboard_all(c, plans, timing, many=hosts_file is not None, parallel=parallel)


def _one_target(destination: str, port: int | None, ssh_defaults: Mapping[str, Any]) -> SshTarget:
    """Where ``--ssh [USER@]HOST[:PORT]`` (and ``--port``) say to ssh; a usage error when
    they contradict each other."""
    try:
        user, host, dest_port = parse_destination(destination)
        if dest_port and port and dest_port != port:
            raise ConfigError(f"--ssh {destination} and --port {port} name two ports")
        identity = ssh_defaults["identity"]
        return SshTarget(
            host=host,
            user=user,
            port=port or dest_port,
            identity=identity.expanduser() if identity else None,
            options=ssh_defaults["options"],
            accept_new_host_key=ssh_defaults["accept_new"],
        )
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _check_host_names(plans: Sequence[HostPlan]) -> None:
    """--set-hostname: every node id must fit in a host name."""
    long = [p.node for p in plans if len(p.node) > MAX_HOSTNAME]
    if long:
        raise click.UsageError(
            f"node id {long[0]} has {len(long[0])} characters, and a host name at most "
            f"{MAX_HOSTNAME}; leave out --set-hostname, or choose a shorter node id"
        )


def _onboard_all(
    c: Ctl, plans: Sequence[HostPlan], timing: Timing, *, many: bool, parallel: int
) -> None:
    """Onboard every plan (``many``: a hosts file's, ``parallel`` at once, with a table at
    the end), then say what failed: the one host's own error, or how many of many."""
    out = sys.stderr if c.as_json else sys.stdout
    display = Display(
        out,
        [p.node for p in plans],
        live=many and out.isatty(),
        columns=shutil.get_terminal_size().columns,
    )
    with ThreadPoolExecutor(max_workers=parallel if many else 1) as pool:
        done = list(pool.map(lambda p: onboard_host(c, p, timing, display), plans))
    results = [r for r, _ in done]
    failures = [(r, e) for r, e in done if e is not None]
    if c.as_json:
        echo_json([r.as_json() for r in results] if many else results[0].as_json())
    elif many:
        click.echo("")
        click.echo(summary(results))
    if not many:
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
