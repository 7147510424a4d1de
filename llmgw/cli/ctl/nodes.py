"""``llmgw ctl nodes``, ``approve``, ``reject``, ``revoke``, ``drain``, ``uncordon``: the nodes of
the cluster and their life cycle."""

from __future__ import annotations

import shlex
import time
from typing import Any

import click

from llmgw.cli.common import Duration
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import ago, echo_json, table, until
from llmgw.errors import NotFound
from llmgw.versions import MINORS_SUPPORTED, newer_release, too_old

__all__ = ["approve", "drain", "nodes", "reject", "revoke", "uncordon", "version_warning"]


@click.command()
@click.argument("node", required=False)
@pass_ctl
def nodes(c: Ctl, node: str | None) -> None:
    """List nodes: state, connection, shards, GPUs (or why there are none); with NODE, all
    about that node. Warns about agents newer than the control plane (their streams are
    refused) or more than two minor releases behind it."""
    data = c.call("GET", "/api/nodes")
    if node is not None:
        found = [n for n in data if n["id"] == node]
        if not found:
            raise NotFound(f"there is no node {node!r}; 'llmgw ctl nodes' lists them")
        data = found
    if c.as_json:
        echo_json(data[0] if node is not None else data)
        return
    server_version = str(c.call("GET", "/api/status").get("version") or "")
    warnings = {n["id"]: version_warning(n, server_version) for n in data}
    if node is not None:
        click.echo(_details(data[0], server_version))
    else:
        click.echo(_table(data, warnings))
    for node_id, warning in warnings.items():
        if warning:
            click.echo(f"warning: node {node_id} {warning}", err=True)


def version_warning(node: dict[str, Any], server_version: str) -> str:
    """What is wrong with the node's agent version next to the control plane's ("" when
    nothing is), with the fix: the control plane is upgraded first, and an agent is
    supported up to MINORS_SUPPORTED minor releases behind it."""
    agent = node.get("agent_version") or ""
    if newer_release(agent, server_version):
        return (
            f"runs llmgw {agent}, newer than the control plane's llmgw {server_version}: its "
            f"stream is refused; upgrade the control plane to {agent} or later first"
        )
    if too_old(agent, server_version):
        return (
            f"runs llmgw {agent}, more than {MINORS_SUPPORTED} minor releases behind the "
            f"control plane's llmgw {server_version} (unsupported); upgrade it: "
            f"llmgw ctl update {shlex.quote(node['id'])} --version {server_version}"
        )
    return ""


def _gpus(n: dict[str, Any]) -> str:
    if n["gpus"]:
        return str(len(n["gpus"]))
    return f"0 ({n['gpu_status']})" if n["gpu_status"] else "0"


def _version_cell(n: dict[str, Any], warning: str) -> object:
    """The agent's version; marked when a warning line below the table says what is wrong."""
    return f"{n['agent_version']} (!)" if warning else n["agent_version"]


def _table(data: list[dict[str, Any]], warnings: dict[str, str]) -> str:
    rows = []
    for n in data:
        rows.append(
            [
                n["id"],
                n["state"] + (",draining" if n["draining"] else ""),
                "yes" if n["connected"] else "no",
                n["dataplane_addr"],
                n["shards"],
                ",".join(n["engines"]),
                _version_cell(n, warnings[n["id"]]),
                ago(n["last_seen"]),
                until(n["cert_expires_at"]),
                (n["fingerprint"] or "")[:23] + "…"
                if n["state"] != "pending"
                else n["fingerprint"],
                _gpus(n),
                _update_cell(n.get("update")),
            ]
        )
    return table(
        [
            "NODE",
            "STATE",
            "CONNECTED",
            "DATA PLANE",
            "SHARDS",
            "ENGINES",
            "VERSION",
            "SEEN",
            "CERT EXPIRES",
            "FINGERPRINT",
            "GPUS",
            "UPDATE",
        ],
        rows,
    )


def _details(n: dict[str, Any], server_version: str) -> str:
    """One node, a line per fact."""
    facts = [
        ("node", n["id"]),
        ("state", n["state"] + (",draining" if n["draining"] else "")),
        ("connected", "yes" if n["connected"] else "no"),
        ("data plane", n["dataplane_addr"] or "-"),
        ("version", f"{n['agent_version'] or '-'} (control plane: {server_version or '?'})"),
        ("seen", ago(n["last_seen"])),
        ("shards", n["shards"]),
        ("engines", ",".join(n["engines"]) or "-"),
        ("gpus", _gpus(n)),
        ("fingerprint", n["fingerprint"] or "-"),
        ("cert expires", until(n["cert_expires_at"])),
        ("update", _update_cell(n.get("update"))),
    ]
    return "\n".join(f"{name + ':':<14}{value}" for name, value in facts)


def _update_cell(update: dict[str, Any] | None) -> str:
    if not update:
        return "-"
    return f"{update['version']} {update['state']}"


@click.command()
@click.argument("node")
@click.option(
    "--fingerprint",
    "fp",
    required=True,
    help="The sha256:… key fingerprint 'llmgw agent join' printed on the node.",
)
@pass_ctl
def approve(c: Ctl, node: str, fp: str) -> None:
    """Approve a pending NODE after comparing its key fingerprint."""
    data = c.call("POST", f"/api/nodes/{node}/approve", {"fingerprint": fp})
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"approved {node}; it takes work from now on")


@click.command()
@click.argument("node")
@pass_ctl
def reject(c: Ctl, node: str) -> None:
    """Remove a pending NODE and deny its certificate."""
    data = c.call("POST", f"/api/nodes/{node}/reject")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"rejected {node}; its certificate is denied")


@click.command()
@click.argument("node")
@pass_ctl
def revoke(c: Ctl, node: str) -> None:
    """Revoke NODE: deny its certificates, cut its stream, rebuild its replicas elsewhere."""
    data = c.call("POST", f"/api/nodes/{node}/revoke")
    if c.as_json:
        echo_json(data)
        return
    serials = ", ".join(data["serials"]) or "none outstanding"
    click.echo(
        f"revoked {node} (certificates denied: {serials}); it can come back only through a fresh join"
    )


@click.command()
@click.argument("node")
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until no replica is left on NODE.",
)
@click.option(
    "--timeout", type=Duration(), default="30m", show_default=True, help="How long to wait."
)
@pass_ctl
def drain(c: Ctl, node: str, wait: bool, timeout: float) -> None:
    """Move every replica off NODE, one at a time, each replacement ready before the original stops."""
    data = c.call("POST", f"/api/nodes/{node}/drain")
    if not wait:
        if c.as_json:
            echo_json(data)
        else:
            click.echo(
                f"draining {node}: {len(data['replicas_left'])} replicas to move "
                f"(llmgw ctl drain {shlex.quote(node)} to watch)"
            )
        return
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        left = data["replicas_left"]
        moving = ", ".join(f"{m['replica']} -> {m['replacement']}" for m in data["moving"]) or "-"
        line = f"{node}: {len(left)} replicas left; moving {moving}"
        if data.get("blocked"):
            line += f"; blocked: {data['blocked']}"
        if line != last and not c.as_json:
            click.echo(line)
            last = line
        if not left:
            break
        if time.monotonic() > deadline:
            raise click.ClickException(f"drain of {node} not done after {timeout:.0f}s: {line}")
        time.sleep(1.0)
        data = c.call("GET", f"/api/nodes/{node}/drain")
    if c.as_json:
        echo_json(data)
    else:
        click.echo(
            f"{node} is drained; 'llmgw ctl uncordon {shlex.quote(node)}' lets it take "
            "replicas again"
        )


@click.command()
@click.argument("node")
@pass_ctl
def uncordon(c: Ctl, node: str) -> None:
    """Let a drained NODE take replicas again."""
    data = c.call("POST", f"/api/nodes/{node}/uncordon")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"{node} takes new replicas again")
