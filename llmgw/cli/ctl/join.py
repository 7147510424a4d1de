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
from llmgw.contracts.nodefacts import FACT_OPTIONS, NodeFacts
from llmgw.errors import ConfigError

__all__ = ["FACT_PARAMS", "fact_options", "join_command", "parse_facts", "tokens"]


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
@click.option(
    "--lost-state",
    is_flag=True,
    help="With --rekey: the node's state directory is gone (no old key): the token re-pairs "
    "it by its uid (printed in the command: agent join --node-uid UID), keeping its record "
    "and history; it needs approval by fingerprint again.",
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
    require_approval: bool,
    lost_state: bool,
    auto_approve: bool,
    cloud_init: bool,
    set_hostname: bool,
    fabrics: tuple[str, ...],
    nvidia_smi: str | None,
    ib_root: str | None,
    engines: tuple[str, ...],
    models_root: str | None,
    cache_root: str | None,
    firewall_from: tuple[str, ...],
    fabric_peers: tuple[str, ...],
    node_address: str | None,
    mgmt_interface: str | None,
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
    if require_approval and not rekey_node:
        raise click.UsageError(
            "--require-approval goes with --rekey (a fresh join always needs approval)"
        )
    if lost_state and not rekey_node:
        raise click.UsageError(
            "--lost-state goes with --rekey NODE: it re-pairs a joined node whose state "
            "directory is gone (a new node needs none: --node NODE)"
        )
    if auto_approve and rekey_node:
        raise click.UsageError(
            "--auto-approve goes with --node (a fresh join): a rekey's new key is proved by the "
            "old one, a lost-state re-pair's approved by its fingerprint; for a machine joining "
            f"afresh: --node {rekey_node} --auto-approve"
        )
    if cloud_init and rekey_node:
        raise click.UsageError(
            "--cloud-init goes with --node: the user-data joins a machine on its first boot; a "
            f"rekey runs on the joined node (--rekey {rekey_node} prints its command)"
        )
    if set_hostname and not cloud_init:
        raise click.UsageError(
            "--set-hostname goes with --cloud-init (the user-data sets the host name on first "
            "boot); where you paste the command, run 'hostnamectl set-hostname NODE' first, or "
            "let 'llmgw ctl onboard --set-hostname' do it"
        )
    facts = parse_facts(
        {
            "fabrics": fabrics,
            "nvidia_smi": nvidia_smi,
            "ib_root": ib_root,
            "engines": engines,
            "models_root": models_root,
            "cache_root": cache_root,
            "firewall_from": firewall_from,
            "fabric_peers": fabric_peers,
            "node_address": node_address,
            "mgmt_interface": mgmt_interface,
        }
    )
    if rekey_node and not lost_state and facts.given(FACT_OPTIONS):
        raise click.UsageError(
            f"{', '.join(facts.given(FACT_OPTIONS))} go with --node (a join) or --rekey NODE "
            "--lost-state (a re-pair); a rekey keeps the node's agent.yaml: to change its facts "
            "run install-agent.sh install with them on the node"
        )
    body: dict[str, Any] = {
        "node": node or rekey_node,
        "rekey": bool(rekey_node),
        "require_approval": require_approval,
    }
    if ttl is not None:
        body["ttl"] = ttl
    elif not cloud_init:
        body["ttl"] = 3600.0
    if auto_approve:
        body["auto_approve"] = True
    if cloud_init:
        body["cloud_init"] = True
    if set_hostname:
        body["set_hostname"] = True
    if lost_state:
        body["lost_state"] = True
    if facts.as_json():
        body["facts"] = facts.as_json()
    if address:
        body["address"] = address
    data = c.call("POST", "/api/join-tokens", body)
    if c.as_json:
        echo_json(data)
        return
    if data.get("warning"):
        click.echo(f"warning: {data['warning']}", err=True)
    if cloud_init:
        # Only the user-data on stdout: it is redirected into a file or a provisioning tool.
        click.echo(data["user_data"], nl=False)
        return
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(data["expires_at"]))
    what = "rekey" if data["kind"] == "rekey" else "join"
    if data.get("lost_state"):
        what = "lost-state rekey"
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
    if data.get("auto_approve"):
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
            + (" (lost-state)" if t.get("lost_state") else "")
            + (" (auto-approve)" if t.get("auto_approve") else ""),
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
