"""``llmgw ctl nodes [NODE]``, ``approve``, ``reject``, ``revoke``, ``drain``, ``uncordon``: the
nodes of the cluster, their health (healthy, degraded and why, offline), their GPUs (memory
and utilisation, in a node's detail) and their life cycle."""

from __future__ import annotations

import shlex
import time
from typing import Any

import click

from llmgw.cli.common import Duration
from llmgw.cli.ctl.complete import ALL_NODES, PENDING_NODES
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import ago, echo_json, table, until
from llmgw.versions import MINORS_SUPPORTED, newer_release, too_old

__all__ = ["approve", "drain", "nodes", "reject", "revoke", "uncordon", "version_warning"]


def _gpus_cell(n: dict[str, Any]) -> str:
    if n["gpus"]:
        unhealthy = sum(1 for g in n["gpus"] if g.get("health"))
        # Cordoned GPUs: 'llmgw ctl gpus' (they are the operator's own doing).
        return f"{len(n['gpus'])} ({unhealthy} unhealthy)" if unhealthy else str(len(n["gpus"]))
    return f"0 ({_plain(n['gpu_status'])})" if n["gpu_status"] else "0"


@click.command()
@click.argument("node", required=False, shell_complete=ALL_NODES)
@pass_ctl
def nodes(c: Ctl, node: str | None) -> None:
    """List nodes: state, health, connection, shards, GPUs (or why there are none).

    With NODE, that node in full: its GPUs (memory, utilisation), why it is degraded and
    what to fix, its engines as checked, its fabrics, the sources it keeps warm and its
    warnings. Warns about agents newer than the control plane
    (their streams are refused) or more than two minor releases behind it."""
    if node is not None:
        _show_node(c, node)
        return
    data = c.call("GET", "/api/nodes")
    if c.as_json:
        echo_json(data)
        return
    status = c.call("GET", "/api/status")
    server_version = str(status.get("version") or "")
    warnings = {n["id"]: version_warning(n, server_version) for n in data}
    rows = []
    for n in data:
        rows.append(
            [
                n["id"],
                n["state"] + (",draining" if n["draining"] else ""),
                n.get("health", "-"),
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
                _gpus_cell(n),
                _update_cell(n.get("update")),
            ]
        )
    click.echo(
        table(
            [
                "NODE",
                "STATE",
                "HEALTH",
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
    )
    for line in _degraded_lines(data):
        click.echo(line)
    for node_id, warning in warnings.items():
        if warning:
            click.echo(f"warning: node {node_id} {warning}", err=True)
    if status.get("database"):
        click.echo(f"warning: database {status['database']}", err=True)


def _server_version(c: Ctl) -> str:
    return str(c.call("GET", "/api/status").get("version") or "")


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


def _version_cell(n: dict[str, Any], warning: str) -> object:
    """The agent's version; marked when a warning line below the table says what is wrong."""
    return f"{n['agent_version']} (!)" if warning else n["agent_version"]


def _update_cell(update: dict[str, Any] | None) -> str:
    if not update:
        return "-"
    return f"{update['version']} {update['state']}"


def _plain(text: object) -> str:
    """Text a node wrote (its reasons, warnings, engines' errors), with anything that is
    not printable (terminal escapes, newlines) shown as U+FFFD instead of acted on."""
    return "".join(c if c.isprintable() else "\ufffd" for c in str(text))


def _gpu_line(gpu: dict[str, Any]) -> str:
    """One GPU of a node's detail: index, model, memory used of total, and utilisation (live,
    from the node's heartbeats; unknown when the GPU cannot tell or the node is away)."""
    busy = gpu.get("utilization_percent")
    utilisation = f"{busy}%" if isinstance(busy, int) else "unknown"
    health = f", unhealthy: {_plain(gpu['health'])}" if gpu.get("health") else ""
    return (
        f"{gpu.get('index', '?')} {_plain(gpu.get('name') or '?')}: memory "
        f"{gpu.get('memory_used_mib', 0)}/{gpu.get('memory_total_mib', 0)} MiB, "
        f"utilisation {utilisation}{health}"
    )


def _warm_line(source: dict[str, Any]) -> str:
    """``llama: warm, 14.9 GiB, read in 62.0 s, 3 min ago``; a skipped one with why."""
    text = f"{_plain(source.get('source', ''))}: {_plain(source.get('state', ''))}"
    size = int(source.get("bytes") or 0)
    if size:
        text += f", {size / 1024**3:.1f} GiB"
    if source.get("last_pass_at"):
        text += f", read in {float(source.get('pass_seconds') or 0):.1f} s, "
        text += ago(source["last_pass_at"])
    if source.get("reason"):
        text += f" ({_plain(source['reason'])})"
    return text


def _subject(reason: dict[str, Any]) -> str:
    """What a degraded reason is about: ``engine vllm``, ``fabric ib-a``, ``gpus``, ``docker``."""
    code = str(reason.get("code") or "?")
    about = reason.get("engine") or reason.get("fabric") or ""
    return _plain(f"{code} {about}" if about else code)


def _degraded_lines(data: list[dict[str, Any]]) -> list[str]:
    """Under the table: each degraded node, what its reasons are about, and where to read
    them in full (the table has no room for the fixes)."""
    return [
        f"{n['id']} is degraded ({', '.join(_subject(r) for r in n['degraded'])}); "
        f"'llmgw ctl nodes {shlex.quote(n['id'])}' says what to fix"
        for n in data
        if n.get("health") == "degraded" and n.get("degraded")
    ]


def _host_memory_cell(n: dict[str, Any]) -> str:
    """``256.0 GiB, sleepers hold 180.0 GiB``: the node's memory and what its sleeping
    replicas hold of it (their weights, at level 1)."""
    total = n.get("memory_total_bytes") or 0
    held = n.get("sleepers_host_memory_bytes") or 0
    text = f"{total / 2**30:.1f} GiB" if total else "unknown"
    return f"{text}, sleepers hold {held / 2**30:.1f} GiB" if held else text


def _show_node(c: Ctl, node: str) -> None:
    n = c.call("GET", f"/api/nodes/{node}")
    if c.as_json:
        echo_json(n)
        return
    health = n.get("health", "-")
    server_version = _server_version(c)
    fields = [
        ("node", n["id"]),
        ("state", n["state"] + (", draining" if n["draining"] else "")),
        ("health", health),
        ("connected", "yes" if n["connected"] else "no"),
        ("data plane", n["dataplane_addr"] or "-"),
        ("version", f"{n['agent_version'] or '-'} (control plane: {server_version or '?'})"),
        ("last seen", ago(n["last_seen"])),
        ("shards", n["shards"]),
        ("GPUs", _gpus_cell(n)),
        ("host memory", _host_memory_cell(n)),
        ("engines", ", ".join(n["engines"]) or "none"),
        ("fingerprint", n["fingerprint"] or "-"),
        ("cert expires", until(n["cert_expires_at"])),
    ]
    width = max(len(name) for name, _ in fields) + 1
    for name, value in fields:
        click.echo(f"{name + ':':<{width}} {value}")
    gpus = n.get("gpus") or []
    if gpus:
        click.echo("gpus:")
        for gpu in gpus:
            click.echo(f"  - {_gpu_line(gpu)}")
    reasons = n.get("degraded") or []
    if reasons:
        offline = " (as it last reported)" if health == "offline" else ""
        click.echo(f"degraded{offline}: placement keeps it from what each names, only that")
        for reason in reasons:
            click.echo(f"  - {_subject(reason)}: {_plain(reason.get('message', ''))}")
    broken = [e for e in n.get("engine_details", []) if not e.get("ok")]
    if broken and not reasons:
        click.echo("engines that will not run:")
        for engine in broken:
            click.echo(f"  - {_plain(engine['name'])}: {_plain(engine.get('problem', ''))}")
    fabrics = n.get("fabrics") or []
    if fabrics:
        click.echo(
            "fabrics: "
            + ", ".join(f"{f['name']} ({'up' if f.get('healthy') else 'down'})" for f in fabrics)
        )
    warm = n.get("warm") or []
    if warm:
        click.echo("warm sources (prefetch: kept in the page cache):")
        for source in warm:
            click.echo(f"  - {_warm_line(source)}")
    warnings = n.get("warnings") or []
    if warnings:
        click.echo("warnings:")
        for warning in warnings:
            click.echo(f"  - {_plain(warning)}")
    version = version_warning(n, server_version)
    if version:
        click.echo(f"warning: node {n['id']} {version}", err=True)


@click.command()
@click.argument("node", shell_complete=PENDING_NODES)
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
@click.argument("node", shell_complete=PENDING_NODES)
@pass_ctl
def reject(c: Ctl, node: str) -> None:
    """Remove a pending NODE and deny its certificate."""
    data = c.call("POST", f"/api/nodes/{node}/reject")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"rejected {node}; its certificate is denied")


@click.command()
@click.argument("node", shell_complete=ALL_NODES)
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
@click.argument("node", shell_complete=ALL_NODES)
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
@click.argument("node", shell_complete=ALL_NODES)
@pass_ctl
def uncordon(c: Ctl, node: str) -> None:
    """Let a drained NODE take replicas again."""
    data = c.call("POST", f"/api/nodes/{node}/uncordon")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"{node} takes new replicas again")
