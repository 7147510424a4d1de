"""``llmgw ctl events``: what happened in the cluster, newest first."""

from __future__ import annotations

import time

import click

from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json, table

__all__ = ["events"]


@click.command()
@click.option("--limit", default=30, show_default=True, type=click.IntRange(1, 1000))
@click.option(
    "--subject", default=None, help="Only events about this node, model, replica or shard."
)
@pass_ctl
def events(c: Ctl, limit: int, subject: str | None) -> None:
    """Recent cluster events, newest first."""
    path = f"/api/events?limit={limit}" + (f"&subject={subject}" if subject else "")
    data = c.call("GET", path)
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            time.strftime("%H:%M:%S", time.localtime(e["ts"])),
            e["kind"],
            e["subject"],
            e.get("actor") or "-",  # '' (the control plane), or a server from before actors
            e["message"],
        ]
        for e in data
    ]
    click.echo(table(["TIME", "KIND", "SUBJECT", "BY", "MESSAGE"], rows))
