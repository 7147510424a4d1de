"""``llmgw agent join``: enrol this node with the control plane and say what comes next."""

from __future__ import annotations

import shlex
from pathlib import Path

import click
from click.core import ParameterSource

from llmgw.agent.join import JoinResult, join
from llmgw.agent.update_spool import CONTAINER_ENV
from llmgw.cli.agent.facts import node_facts
from llmgw.cli.prompts import read_secret
from llmgw.contracts.joining import JoinOptions, JoinRefused
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG, DEFAULT_AGENT_STATE_DIR
from llmgw.contracts.ports import DEFAULT_ENROLL_PORT

__all__ = ["TOKEN_ENV", "join_command"]

TOKEN_ENV = "LLMGW_JOIN_TOKEN"


@click.command("join")
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
    f"{DEFAULT_AGENT_STATE_DIR}) (env: LLMGW_AGENT_STATE_DIR).",
)
@click.option(
    "--rekey",
    is_flag=True,
    help="Replace this node's key with a rekey token; it keeps its uid, and the old key "
    "and certificate are kept as *.old.",
)
@click.option(
    "--node-uid",
    metavar="UID",
    help="Re-pair a node whose state directory is gone, keeping its record: the uid and the "
    "re-pair token printed by 'llmgw ctl join-command --rekey NODE --re-pair'. "
    "It needs approval by fingerprint again.",
)
@click.option(
    "--fabric",
    "fabrics",
    multiple=True,
    metavar="NAME[:HCA,...]",
    help="A fabric this node is on and its adapters, as in /sys/class/infiniband; a bare "
    "NAME takes this node's active InfiniBand adapters (repeatable; 'none' alone: no "
    "fabric). Written to the agent.yaml this join writes.",
)
@click.option("--nvidia-smi", metavar="PATH", help="nvidia-smi's absolute path (discovery).")
@click.option("--ib-root", metavar="DIR", help="The InfiniBand sysfs root (discovery).")
@click.option(
    "--engine",
    "engines",
    multiple=True,
    metavar="NAME=PATH",
    help="An engine's program, e.g. vllm=/opt/vllm/bin/vllm (repeatable).",
)
@click.option(
    "--node-address",
    metavar="IP",
    help="The address the control plane reaches this node's data plane at (agent.yaml "
    "mgmt_addr; default: the route's source address towards the control plane).",
)
@click.option(
    "--mgmt-interface",
    metavar="NAME",
    help="The network interface to take that address from (agent.yaml mgmt_interface).",
)
@click.option(
    "--by-installer",
    is_flag=True,
    hidden=True,
    envvar="LLMGW_BY_INSTALLER",
    help="install-agent.sh runs this join: it writes agent.yaml and starts the agent itself, "
    "and says so; the report leaves both out.",
)
@click.option(
    "--in-container",
    is_flag=True,
    hidden=True,
    envvar=CONTAINER_ENV,
    help="The agent's image runs this join (its environment says so): the agent starts as "
    "its container, and the report says how.",
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
    node_uid: str | None,
    fabrics: tuple[str, ...],
    nvidia_smi: str | None,
    ib_root: str | None,
    engines: tuple[str, ...],
    node_address: str | None,
    mgmt_interface: str | None,
    by_installer: bool,
    in_container: bool,
) -> None:
    """Enrol this node with the control plane; the join token comes from LLMGW_JOIN_TOKEN
    or a prompt, never from an argument."""
    config_path = _config_path(ctx, join_config)
    try:  # before the token is asked for
        JoinOptions.of_modes(rekey=rekey, re_pair=node_uid is not None)
    except JoinRefused as exc:
        raise click.UsageError(str(exc)) from None
    facts = node_facts(
        fabrics=fabrics,
        nvidia_smi=nvidia_smi,
        ib_root=ib_root,
        engines=engines,
        node_address=node_address,
        mgmt_interface=mgmt_interface,
    )
    result = join(
        node_id=node_id,
        enroll_url=enroll_url,
        ca_hash=ca_hash,
        token=read_secret(TOKEN_ENV, "join token (not echoed): ", what="join token", strip=True),
        config_path=config_path,
        state_dir=state_dir,
        rekey=rekey,
        node_uid=node_uid,
        facts=facts,
    )
    click.echo(_report(result, by_installer=by_installer, in_container=in_container))


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


def _report(result: JoinResult, *, by_installer: bool = False, in_container: bool = False) -> str:
    """What the join did and what comes next. ``by_installer``: install-agent.sh writes
    agent.yaml (the config this join wrote is its staging copy) and starts or restarts the
    agent itself, so neither is said here; the installer says both, with the real paths.
    ``in_container``: the join ran in the agent's image, whose agent starts as its container
    (README "The agent as a container"), not as a unit."""
    paths = result.paths
    verb = "re-paired" if result.repaired else ("rekeyed" if result.rekeyed else "joined")
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
    if not by_installer:
        config_note = "written" if result.config_written else "kept as it was"
        lines.append(f"config:      {paths.config} ({config_note})")
    if in_container:
        start = (
            "restart the agent's container to use the new identity: docker compose restart agent"
            if result.rekeyed or result.repaired
            else "start the agent's container: docker compose up -d"
        )
    elif result.rekeyed or result.repaired:
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
        if not by_installer:
            lines.append(f"then {start}")
    elif not by_installer:
        lines.append(f"next: {start}")
    return "\n".join(lines)
