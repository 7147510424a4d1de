"""``llmgw ctl instances``: the control-plane instances sharing one PostgreSQL database (the
lease's holder leads), and ``instances retire ID``, which shuts a stopped one out for good."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import click

from llmgw.cli.common import ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import ago, echo_json, table

__all__ = ["instances"]

_JSON_HELP = "Print JSON for scripts instead of text (as 'llmgw ctl --json')."


def _seen(instance: dict[str, Any]) -> str:
    # The server's count (the database's clock), not this machine's idea of its timestamp.
    return ago(time.time() - float(instance["seen_s_ago"]))


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.pass_context
def instances(ctx: click.Context, as_json: bool) -> None:
    """Control-plane instances on PostgreSQL: list them, retire one."""
    c = ctx.find_object(Ctl)
    assert c is not None
    c.as_json = c.as_json or as_json  # 'instances --json retire ID' too
    if ctx.invoked_subcommand is not None:
        return
    data = c.call("GET", "/api/instances")
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            i["id"],
            i["role"],
            i["stream"] or "-",
            i["http"] or "-",
            i["version"] or "-",
            _seen(i),
            ago(i["retired_at"]),
        ]
        for i in data
    ]
    click.echo(table(["ID", "ROLE", "STREAM", "HTTP", "VERSION", "LAST SEEN", "RETIRED"], rows))
    for i in data:
        if i["role"] == "silent":
            click.echo(
                f"{i['id']} was last seen {_seen(i)}; once it is stopped for good: llmgw ctl "
                f"instances retire {i['id']}"
            )


@instances.command("retire")
@click.argument("instance_id", metavar="ID")
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@pass_ctl
def retire(c: Ctl, instance_id: str, as_json: bool) -> None:
    """Retire the stopped instance ID for good: its id is refused at start from now on, and
    agents refuse its certificates."""
    data = c.call("POST", f"/api/instances/{quote(instance_id, safe='')}/retire")
    if as_json or c.as_json:
        echo_json(data)
        return
    serials = ", ".join(data["retired_serials"]) or "none recorded"
    click.echo(
        f"retired instance {data['id']}; the leader tells the agents, whose data planes refuse "
        f"its certificates from now on (serials {serials})"
    )
    click.echo(
        "its id cannot be used again: a machine in its place needs another instance_id and new "
        "certificates"
    )
