"""``llmgw ctl join-command`` and ``llmgw ctl tokens``: the one-time tokens that join (or
rekey) a node, and the command to paste on it."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from typing import Any

import click

from llmgw.cli.common import Duration, ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json, table, until
from llmgw.contracts.joining import (
    OLD_REPAIR_FIELD,
    OLD_REPAIR_FLAG,
    REPAIR_FIELD,
    REPAIR_FLAG,
    JoinOptions,
    JoinRefused,
)
from llmgw.contracts.nodefacts import FACT_OPTIONS, NodeFacts
from llmgw.errors import ConfigError

__all__ = [
    "FACT_PARAMS",
    "fact_options",
    "join_body",
    "join_command",
    "parse_facts",
    "read_repair_flags",
    "repair_options",
    "show_join_token",
    "tokens",
]


_FACT_OPTIONS = [
    click.option(
        "--fabric",
        "fabrics",
        multiple=True,
        metavar="NAME[:HCA,...]",
        help="A fabric the node is on and its adapters, as in /sys/class/infiniband; a bare "
        "NAME takes the node's active InfiniBand adapters, found when it is installed "
        "(repeatable; 'none' alone: no fabric).",
    ),
    click.option("--nvidia-smi", metavar="PATH", help="nvidia-smi's absolute path on the node."),
    click.option(
        "--ib-root",
        metavar="DIR",
        help="The InfiniBand sysfs root (default /sys/class/infiniband).",
    ),
    click.option(
        "--engine",
        "engines",
        multiple=True,
        metavar="NAME=PATH",
        help="An engine's program on the node, e.g. vllm=/opt/vllm/bin/vllm (repeatable; 'none' "
        "alone: no engine program).",
    ),
    click.option("--models-root", metavar="DIR", help="Installer: where the node keeps models."),
    click.option("--cache-root", metavar="DIR", help="Installer: the node's cache folder."),
    click.option(
        "--firewall-from",
        multiple=True,
        metavar="CIDR",
        help="Installer: open the agent's ports to this address or network (repeatable).",
    ),
    click.option(
        "--fabric-peers",
        multiple=True,
        metavar="CIDR",
        help="Installer: the fabric's own network, allowed the multi-node ports (repeatable).",
    ),
    click.option(
        "--node-address",
        metavar="IP",
        help="The node's own address, where the control plane reaches its data plane "
        "(agent.yaml mgmt_addr; default: its route towards the control plane).",
    ),
    click.option(
        "--mgmt-interface",
        metavar="NAME",
        help="The node's network interface to take that address from (agent.yaml "
        "mgmt_interface, e.g. eth1).",
    ),
]
FACT_PARAMS = (
    "fabrics",
    "nvidia_smi",
    "ib_root",
    "engines",
    "models_root",
    "cache_root",
    "firewall_from",
    "fabric_peers",
    "node_address",
    "mgmt_interface",
)


def fact_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The node facts' options (--fabric, --nvidia-smi, --ib-root, --engine, --node-address,
    --mgmt-interface, and the installer's --models-root, --cache-root, --firewall-from,
    --fabric-peers), as join-command and onboard both take them; their values go to
    :func:`parse_facts`."""
    for option in reversed(_FACT_OPTIONS):
        command = option(command)
    return command


def parse_facts(values: dict[str, Any]) -> NodeFacts:
    """The facts of :func:`fact_options`' values, checked; a usage error names the option."""
    try:
        return NodeFacts.parse(**{k: values[k] for k in FACT_PARAMS})
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None


def repair_options(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--re-pair`` (with ``help_text``) and its old name ``--lost-state``, hidden, which
    still works and warns; the command reads both with :func:`read_repair_flags`."""

    def add(command: Callable[..., Any]) -> Callable[..., Any]:
        command = click.option(
            OLD_REPAIR_FLAG, "old_repair", is_flag=True, hidden=True, help="Old --re-pair."
        )(command)
        return click.option(REPAIR_FLAG, "re_pair", is_flag=True, help=help_text)(command)

    return add


def read_repair_flags(re_pair: bool, old_repair: bool) -> bool:
    """Whether a re-pair was asked for, by its name or its old one (which warns)."""
    if old_repair:
        click.echo(
            f"warning: {OLD_REPAIR_FLAG} is the old name of {REPAIR_FLAG}; use {REPAIR_FLAG}",
            err=True,
        )
    return re_pair or old_repair


@click.command("join-command")
@click.option("--node", "node", help="Id of the node to join (DNS name, e.g. gpu-01).")
@click.option(
    "--rekey",
    "rekey_node",
    metavar="NODE",
    help="Mint a rekey token for NODE instead: it keeps its uid.",
)
@click.option(
    "--ttl",
    type=Duration(),
    default=None,
    help="How long the token is valid (30m, 1h, 2d; default 1h, with --cloud-init 24h).",
)
@click.option(
    "--address",
    help="HOST or HOST:PORT (IPv6 in brackets) the node reaches the control plane at; a PORT "
    "is the gateway's, for the bundle download (default: the server's first advertise, else "
    "the host ctl used). The node's own address is --node-address.",
)
@click.option(
    "--require-approval",
    is_flag=True,
    help="With --rekey: the node needs approval again after rekeying.",
)
@repair_options(
    "With --rekey: the node's state directory is gone (no old key): the token re-pairs "
    "it by its uid (printed in the command: agent join --node-uid UID), keeping its record "
    "and history; it needs approval by fingerprint again (old name: --lost-state)."
)
@click.option(
    "--auto-approve",
    is_flag=True,
    help="With --node: approve the node that spends this token on first use, without "
    "comparing its fingerprint (trust on first use; recorded on the token and in the events).",
)
@click.option(
    "--cloud-init",
    "cloud_init",
    is_flag=True,
    help="With --node: print #cloud-config user-data that installs and joins the machine on "
    "its first boot (pass it as the new machine's user-data), instead of a command.",
)
@click.option(
    "--set-hostname",
    is_flag=True,
    help="With --cloud-init: the machine's host name becomes the node id (one name for node, "
    "host and certificate).",
)
@fact_options
@pass_ctl
def join_command(
    c: Ctl,
    node: str | None,
    rekey_node: str | None,
    ttl: float | None,
    address: str | None,
    re_pair: bool,
    old_repair: bool,
    **flags: Any,
) -> None:
    """Mint a one-time token and print the command to paste on the node: with agent bundles
    on the control plane, a one-liner that downloads and checks the bundle and runs its
    install-agent.sh (install, or rekey); else 'llmgw agent join'. Node facts (--fabric,
    --nvidia-smi, --ib-root, --engine, --node-address, --mgmt-interface; for the installer
    also --models-root, --cache-root, --firewall-from, --fabric-peers) are appended to it. --cloud-init prints user-data
    instead (the token in a root-only file, removed after use); --auto-approve skips the
    approval by fingerprint for the machine that spends the token first."""
    if bool(node) == bool(rekey_node):
        raise click.UsageError("give exactly one of --node NODE (a new node) or --rekey NODE")
    facts = parse_facts(flags)
    try:
        options = JoinOptions.of_flags(
            node=node or rekey_node or "NODE",
            rekey=bool(rekey_node),
            re_pair=read_repair_flags(re_pair, old_repair),
            facts=tuple(facts.given(FACT_OPTIONS)),
            **{k: flags[k] for k in _MODE_FLAGS},
        ).check()
    except JoinRefused as exc:
        raise click.UsageError(str(exc)) from None
    data = c.call("POST", "/api/join-tokens", join_body(options, facts, ttl, address))
    if c.as_json:
        echo_json(data)
        return
    show_join_token(data, cloud_init=options.cloud_init)


_MODE_FLAGS = ("require_approval", "auto_approve", "cloud_init", "set_hostname")


def join_body(
    options: JoinOptions, facts: NodeFacts, ttl: float | None, address: str | None
) -> dict[str, Any]:
    """``POST /api/join-tokens``' body for checked ``options``."""
    body: dict[str, Any] = {
        "node": options.node,
        "rekey": options.rekey,
        "require_approval": options.require_approval,
    }
    if ttl is not None:
        body["ttl"] = ttl
    elif not options.cloud_init:
        body["ttl"] = 3600.0
    for flag in ("auto_approve", "cloud_init", "set_hostname", REPAIR_FIELD):
        if getattr(options, flag):
            body[flag] = True
    if facts.as_json():
        body["facts"] = facts.as_json()
    if address:
        body["address"] = address
    return body


def show_join_token(data: dict[str, Any], *, cloud_init: bool = False) -> None:
    """The minted token as an operator reads it: what it is, the command to paste and
    what comes next (the cloud-init user-data alone on stdout)."""
    if data.get("warning"):
        click.echo(f"warning: {data['warning']}", err=True)
    if cloud_init:
        # Only the user-data on stdout: it is redirected into a file or a provisioning tool.
        click.echo(data["user_data"], nl=False)
        return
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(data["expires_at"]))
    what = "rekey" if data["kind"] == "rekey" else "join"
    if data.get(REPAIR_FIELD, data.get(OLD_REPAIR_FIELD)) is True:
        what = "re-pair"
    click.echo(
        f"{what} token {data['id']} for node {data['node']}, valid until {expires} (one use)"
    )
    if data.get("node_uid"):
        click.echo(f"node uid:  {data['node_uid']} (kept: same record, history and placement)")
    click.echo(f"enrol URL: {data['enroll_url']}")
    click.echo(f"CA hash:   {data['ca_hash']}")
    click.echo("")
    click.echo("run on the node:")
    click.echo("")
    click.echo(f"  {data['command']}")
    click.echo("")
    if " llmgw agent join " in data["command"]:
        # No bundles to serve: the command needs llmgw on the node already.
        click.echo(
            "(this control plane serves no agent bundles, so the node needs llmgw installed "
            "first; for the one-line install, install the llmgw-agent-bundles package on the "
            "control plane, or copy llmgw-agent-*-linux-<arch>.tar.gz (make dist) into its "
            "bundle_dir)",
            err=True,
        )
    if data.get("auto_approve") is True:
        click.echo(
            "the node is approved when it joins (auto-approve: trust on first use of this "
            "token); 'llmgw ctl events' records the fingerprint it was approved with"
        )
        return
    click.echo(
        "then compare the fingerprint it prints and approve: llmgw ctl approve "
        f"{shlex.quote(data['node'])} --fingerprint sha256:…"
    )


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.option(
    "--all", "include_all", is_flag=True, help="Include used, expired and revoked tokens."
)
@click.pass_context
def tokens(ctx: click.Context, include_all: bool) -> None:
    """List outstanding join tokens (and revoke them with 'tokens revoke ID')."""
    if ctx.invoked_subcommand is not None:
        return
    c = ctx.find_object(Ctl)
    assert c is not None
    data = c.call("GET", "/api/join-tokens" + ("?all=1" if include_all else ""))
    if c.as_json:
        echo_json(data)
        return

    def state(t: dict[str, Any]) -> str:
        if t["used_at"] and t.get("approved_fingerprint"):
            return f"used, approved {t['approved_fingerprint']}"
        if t["used_at"]:
            return "used"
        if t["revoked_at"]:
            return "revoked"
        return "active" if t["active"] else "expired"

    rows = [
        [
            t["id"],
            t["node"],
            t["kind"]
            + (" (re-pair)" if t.get(REPAIR_FIELD, t.get(OLD_REPAIR_FIELD)) is True else "")
            + (" (auto-approve)" if t.get("auto_approve") is True else ""),
            t["prefix"] + "…",
            until(t["expires_at"]),
            state(t),
        ]
        for t in data
    ]
    click.echo(table(["ID", "NODE", "KIND", "PREFIX", "EXPIRES", "STATE"], rows))


@tokens.command("revoke")
@click.argument("token_id")
@pass_ctl
def tokens_revoke(c: Ctl, token_id: str) -> None:
    """Revoke an unused join token (its id or prefix)."""
    data = c.call("DELETE", f"/api/join-tokens/{token_id}")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"revoked join token {data['id']} for node {data['node']}")
