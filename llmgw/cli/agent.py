"""The ``llmgw agent`` group: everything that runs on a node.

``llmgw agent`` runs the node agent; ``join`` enrols the node; ``docker-proxy`` is the Docker
socket proxy the agent may use instead of docker.sock; ``update-apply`` and ``update-trust``
are the root update helper's entry points (systemd and the installer run them as root; the
code behind them is the helper's, these commands only parse options and print verdicts)."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import click
from click.core import ParameterSource

from llmgw.agent.config import DEFAULT_AGENT_CONFIG, DEFAULT_STATE_DIR, load_agent_config
from llmgw.agent.dockerproxy.relay import DEFAULT_LISTEN as DEFAULT_PROXY_LISTEN
from llmgw.agent.dockerproxy.relay import DEFAULT_UPSTREAM as DEFAULT_PROXY_UPSTREAM
from llmgw.agent.join import DEFAULT_ENROLL_PORT, JoinResult, join
from llmgw.agent.service import run_agent
from llmgw.cli.common import ReportingGroup
from llmgw.cli.prompts import read_secret
from llmgw.contracts.update_order import DEFAULT_SPOOL
from llmgw.errors import ConfigError
from llmgw.log import setup_logging
from llmgw.updater.apply import DEFAULT_INSTALLED_BINARY, DEFAULT_STATE, apply_request
from llmgw.updater.trust import DEFAULT_TRUST, install_trust

TOKEN_ENV = "LLMGW_JOIN_TOKEN"

__all__ = ["agent"]


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_AGENT_CONFIG,
    show_default=True,
    envvar="LLMGW_AGENT_CONFIG",
    help="agent.yaml (env: LLMGW_AGENT_CONFIG).",
)
@click.option(
    "--log-level",
    default="info",
    envvar="LLMGW_LOG_LEVEL",
    help="debug, info, warning (env: LLMGW_LOG_LEVEL).",
)
@click.option("--check", is_flag=True, help="Validate the configuration and exit.")
@click.pass_context
def agent(ctx: click.Context, config_path: Path, log_level: str, check: bool) -> None:
    """Run the node agent (systemd Type=notify)."""
    if ctx.invoked_subcommand is not None:
        return
    cfg = load_agent_config(config_path)
    if check:
        click.echo(f"{config_path}: ok (node {cfg.node_id}, servers {', '.join(cfg.servers)})")
        return
    setup_logging(log_level)
    run_agent(cfg)


@agent.command("join")
@click.option(
    "--node-id",
    required=True,
    envvar="LLMGW_NODE_ID",
    help="This node's id, the CN of its certificate (env: LLMGW_NODE_ID).",
)
@click.option(
    "--enroll-url",
    required=True,
    envvar="LLMGW_ENROLL_URL",
    help=f"The control plane's enrolment address, https://HOST[:PORT] (port "
    f"{DEFAULT_ENROLL_PORT} by default) (env: LLMGW_ENROLL_URL).",
)
@click.option(
    "--ca-hash",
    required=True,
    envvar="LLMGW_CA_HASH",
    help="sha256:<hex> of the cluster CA's public key, from 'llmgw ctl join-command' "
    "(env: LLMGW_CA_HASH).",
)
@click.option(
    "--config",
    "join_config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"agent.yaml: where the identity goes, written when missing; the same as "
    f"'llmgw agent --config' (default {DEFAULT_AGENT_CONFIG}; env: LLMGW_AGENT_CONFIG).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="LLMGW_AGENT_STATE_DIR",
    help=f"Where the identity goes when the config file does not exist yet (default "
    f"{DEFAULT_STATE_DIR}) (env: LLMGW_AGENT_STATE_DIR).",
)
@click.option(
    "--rekey",
    is_flag=True,
    help="Replace this node's key with a rekey token; it keeps its uid, and the old key "
    "and certificate are kept as *.old.",
)
@click.pass_context
def join_command(
    ctx: click.Context,
    node_id: str,
    enroll_url: str,
    ca_hash: str,
    join_config: Path | None,
    state_dir: Path | None,
    rekey: bool,
) -> None:
    """Enrol this node with the control plane; the join token comes from LLMGW_JOIN_TOKEN
    or a prompt, never from an argument."""
    config_path = _config_path(ctx, join_config)
    result = join(
        node_id=node_id,
        enroll_url=enroll_url,
        ca_hash=ca_hash,
        token=read_secret(TOKEN_ENV, "join token (not echoed): ", what="join token", strip=True),
        config_path=config_path,
        state_dir=state_dir,
        rekey=rekey,
    )
    click.echo(_report(result))


def _config_path(ctx: click.Context, join_config: Path | None) -> Path:
    """``join --config`` wins; the group's ``--config`` (or its env/default) otherwise."""
    parent = ctx.parent
    group_value = parent.params.get("config_path") if parent is not None else None
    group_path = Path(group_value) if group_value is not None else DEFAULT_AGENT_CONFIG
    if join_config is None:
        return group_path
    if (
        parent is not None
        and parent.get_parameter_source("config_path") is ParameterSource.COMMANDLINE
        and group_path != join_config
    ):
        raise click.UsageError(
            f"--config is given twice, as {group_path} and {join_config}; give it once"
        )
    return join_config


def _report(result: JoinResult) -> str:
    paths = result.paths
    verb = "rekeyed" if result.rekeyed else "joined"
    lines = [
        f"node {result.node_id} {verb} (uid {result.node_uid})",
        f"fingerprint: {result.fingerprint}",
        f"state: {result.state}",
        f"certificate valid until {result.not_after:%Y-%m-%d %H:%M} UTC",
        f"key:         {paths.key} (0600; it never leaves this machine)",
        f"certificate: {paths.cert}",
        f"ca:          {paths.ca}",
        f"uid:         {paths.uid}",
    ]
    if result.old_key is not None or result.old_cert is not None:
        kept = ", ".join(str(p) for p in (result.old_key, result.old_cert) if p is not None)
        lines.append(f"previous:    {kept}")
    config_note = "written" if result.config_written else "kept as it was"
    lines.append(f"config:      {paths.config} ({config_note})")
    if result.rekeyed:
        start = "restart the agent to use the new identity: sudo systemctl restart llmgw-agent"
    else:
        start = (
            "start the agent: sudo systemctl enable --now llmgw-agent "
            f"(or: llmgw agent --config {shlex.quote(str(paths.config))})"
        )
    if result.state == "pending":
        lines.append(
            f"next: ask the operator to approve it: llmgw ctl approve "
            f"{shlex.quote(result.node_id)} --fingerprint {shlex.quote(result.fingerprint)}"
        )
        lines.append(f"then {start}")
    else:
        lines.append(f"next: {start}")
    return "\n".join(lines)


@agent.command("update-apply")
@click.option(
    "--spool",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_SPOOL,
    show_default=True,
    help="The agent's update spool, where it renames a finished download to 'request'.",
)
@click.option(
    "--trust",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_TRUST,
    show_default=True,
    help="ca.pem and node-id, written by the installer; only root may write there.",
)
@click.option(
    "--state",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_STATE,
    show_default=True,
    help="The helper's own state (0700, root): the last accepted counter, work directories.",
)
@click.option(
    "--installed-binary",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_INSTALLED_BINARY,
    show_default=True,
    help="The installed agent program, asked for its --version (a downgrade is refused).",
)
def update_apply(spool: Path, trust: Path, state: Path, installed_binary: Path) -> None:
    """Check and apply the signed update the agent spooled (as root, from
    llmgw-agent-update.service). The request is moved out of the agent's reach first; the
    verdict goes to SPOOL/status.json. Exit 0: applied, or nothing to do."""
    result = apply_request(spool=spool, trust=trust, state=state, installed_binary=installed_binary)
    if result.exit_code:
        click.echo(f"error: update {result.state}: {result.message}", err=True)
    raise click.exceptions.Exit(result.exit_code)


@agent.command("docker-proxy")
@click.option(
    "--listen",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_PROXY_LISTEN,
    show_default=True,
    help="The socket to serve; the agent's DOCKER_HOST is unix://LISTEN.",
)
@click.option(
    "--upstream",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_PROXY_UPSTREAM,
    show_default=True,
    help="dockerd's socket.",
)
@click.option(
    "--group",
    default="llmgw-agent",
    show_default=True,
    help="The group that may connect (the socket is 0660).",
)
@click.option(
    "--bind-root",
    "bind_roots",
    multiple=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="A directory containers may bind read-only (it, or what is below it when every "
    "directory on the way is root's). Repeatable; none by default: no bind mounts.",
)
@click.option(
    "--host-network/--no-host-network",
    default=True,
    show_default=True,
    help="Whether containers may use the host's network (multi-node shards do).",
)
@click.option(
    "--log-level",
    default="info",
    envvar="LLMGW_LOG_LEVEL",
    help="debug, info, warning (env: LLMGW_LOG_LEVEL).",
)
def docker_proxy(
    listen: Path,
    upstream: Path,
    group: str,
    bind_roots: tuple[Path, ...],
    host_network: bool,
    log_level: str,
) -> None:
    """Serve a Docker socket that allows only what llmgw's docker runtime does (as root or
    a member of the docker group, from llmgw-docker-proxy.service): llmgw's labelled
    containers, not privileged, no host namespaces, devices or mounts, ports on 127.0.0.1.
    Everything else is answered 403 with the reason."""
    import asyncio

    from llmgw.agent.dockerproxy import Policy, serve
    from llmgw.notify import Notifier

    for root in bind_roots:
        if not root.is_absolute() or os.path.normpath(root) != str(root):
            raise ConfigError(f"--bind-root {root}: give an absolute, normalised path")
    setup_logging(log_level)
    notifier = Notifier()
    policy = Policy(bind_roots=tuple(bind_roots), host_network=host_network)
    asyncio.run(serve(listen, upstream, policy, group=group or None, on_ready=notifier.ready))


@agent.command("update-trust")
@click.option(
    "--ca",
    "ca_file",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The cluster CA to trust (a copy of root's; never read through a symlink).",
)
@click.option(
    "--ca-hash",
    default=None,
    help="sha256:<hex> the CA's public key must hash to (from 'llmgw ctl join-command'); "
    "without it, the pin recorded at the first install.",
)
@click.option(
    "--trust",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_TRUST,
    show_default=True,
    help="Where the update helper's trust lives (root's).",
)
def update_trust(ca_file: Path, ca_hash: str | None, trust: Path) -> None:
    """Make the update helper trust the CA in --ca, once it matches the pin (as root, from
    install-agent.sh). Prints 'trust: written' or 'trust: unchanged'; exits 1, the trust
    kept as it was, when the CA does not match."""
    changed = install_trust(ca_file, trust, ca_hash)
    click.echo("trust: written" if changed else "trust: unchanged")
