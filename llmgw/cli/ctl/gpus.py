"""``llmgw ctl gpus [NODE]``, ``gpus cordon NODE GPU[,GPU]``, ``gpus uncordon NODE GPU[,GPU]``:
each node's GPUs with their states (healthy, unhealthy and why, cordoned by whom and why),
and taking single GPUs out of placement while the rest of their node keeps serving."""

from __future__ import annotations

import shlex
import urllib.parse
from typing import Any

import click

from llmgw.cli.common import ReportingGroup
from llmgw.cli.ctl.complete import ALL_NODES
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json, table

__all__ = ["gpus"]


class _NodeOrCommand(ReportingGroup):
    """``gpus NODE`` lists one node's GPUs; ``gpus cordon ...`` is a subcommand: a first
    argument that names no subcommand is the node."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            ctx.meta["gpus_node"] = args[0]
            args = args[1:]
        return super().parse_args(ctx, args)


def _plain(text: object) -> str:
    return "".join(c if c.isprintable() else "\ufffd" for c in str(text))


def _split(gpus: str) -> list[str]:
    names = [g.strip() for g in gpus.split(",") if g.strip()]
    if not names:
        raise click.BadParameter("name GPUs by index or uuid, comma-separated: 3 or 0,1")
    return names


def _why(gpu: dict[str, Any]) -> str:
    if gpu.get("health"):
        return _plain(gpu["health"])
    cordon = gpu.get("cordon")
    if cordon:
        reason = f": {cordon['reason']}" if cordon.get("reason") else ""
        return _plain(f"by {cordon.get('actor') or '?'}{reason}")
    return ""


def _rows(node: str, gpus: list[dict[str, Any]]) -> list[list[object]]:
    return [
        [
            node,
            g.get("index"),
            g.get("uuid") or "-",
            f"{g.get('memory_used_mib', 0)}/{g.get('memory_total_mib', 0)} MiB",
            g.get("state"),
            _why(g) or "-",
        ]
        for g in gpus
    ]


@click.group(
    cls=_NodeOrCommand,
    invoke_without_command=True,
    subcommand_metavar="[NODE | cordon NODE GPU[,GPU] | uncordon NODE GPU[,GPU]]",
)
@pass_ctl
@click.pass_context
def gpus(ctx: click.Context, c: Ctl) -> None:
    """List each node's GPUs: index, uuid, memory, state (healthy, unhealthy, cordoned) and
    why (the XID an agent reported, or who cordoned it and why). 'gpus NODE' lists one.

    A cordoned or unhealthy GPU takes no new replica; what runs on a cordoned one moves
    elsewhere (the replacement ready first), what runs on an unhealthy one is rebuilt
    elsewhere; the node's other GPUs keep serving."""
    if ctx.invoked_subcommand is not None:
        return
    node = ctx.meta.get("gpus_node")
    if node is None:
        data = c.call("GET", "/api/gpus")
    else:
        data = [c.call("GET", f"/api/nodes/{urllib.parse.quote(node, safe='')}/gpus")]
    if c.as_json:
        echo_json(data if node is None else data[0])
        return
    rows = [row for n in data for row in _rows(n["node"], n["gpus"])]
    click.echo(table(["NODE", "GPU", "UUID", "MEMORY", "STATE", "WHY"], rows))
    for n in data:
        if n.get("blocked"):
            click.echo(f"{n['node']}: {_plain(n['blocked'])}")


def _path(node: str, action: str) -> str:
    return f"/api/nodes/{urllib.parse.quote(node, safe='')}/gpus/{action}"


@gpus.command("cordon")
@click.argument("node", shell_complete=ALL_NODES)
@click.argument("gpu_list", metavar="GPU[,GPU]")
@click.option("--reason", default="", help="Why, for the events and 'llmgw ctl gpus'.")
@pass_ctl
def cordon(c: Ctl, node: str, gpu_list: str, reason: str) -> None:
    """Take GPUs of NODE (by index or uuid) out of placement; what runs there moves to
    other GPUs, the replacement ready before the original stops."""
    data = c.call("POST", _path(node, "cordon"), {"gpus": _split(gpu_list), "reason": reason})
    if c.as_json:
        echo_json(data)
        return
    click.echo(
        f"GPU {gpu_list} of {node} cordoned; its replicas move elsewhere "
        f"('llmgw ctl gpus {shlex.quote(node)}' to watch)"
    )


@gpus.command("uncordon")
@click.argument("node", shell_complete=ALL_NODES)
@click.argument("gpu_list", metavar="GPU[,GPU]")
@pass_ctl
def uncordon(c: Ctl, node: str, gpu_list: str) -> None:
    """Let cordoned GPUs of NODE take replicas again; a GPU that vanished from NVML (taken
    out of the machine) is forgotten."""
    data = c.call("POST", _path(node, "uncordon"), {"gpus": _split(gpu_list)})
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"GPU {gpu_list} of {node} takes replicas again")
