"""``llmgw ctl update`` and ``llmgw ctl admin password``: signed agent updates, and the admin
password that each update asks for (read from the environment or a no-echo prompt, never
from the command line)."""

from __future__ import annotations

import time
from typing import Any

import click

from llmgw.cli.common import Duration, ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json, table
from llmgw.cli.prompts import read_secret
from llmgw.client import ADMIN_PASSWORD_ENV, NEW_ADMIN_PASSWORD_ENV

__all__ = ["admin", "update"]


@click.command()
@click.argument("target", metavar="NODE|--all", required=False)
@click.option("--all", "all_nodes", is_flag=True, help="Every approved node.")
@click.option(
    "--version",
    "version",
    required=True,
    help="The agent version to install; the control plane must serve its bundle.",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until every node has applied (or refused) the update.",
)
@click.option(
    "--timeout",
    type=Duration(),
    default="30m",
    show_default=True,
    help="How long to wait with --wait.",
)
@click.option(
    "--ttl",
    type=Duration(whole=True),
    default="1h",
    show_default=True,
    help="How long the signed order stays valid, from 1m to 7d in whole seconds (90, 1h).",
)
@pass_ctl
def update(
    c: Ctl,
    target: str | None,
    all_nodes: bool,
    version: str,
    wait: bool,
    timeout: float,
    ttl: int,
) -> None:
    """Update the agent on NODE (or --all) to VERSION with an order signed by the cluster
    CA. Asks again for the password of whoever ctl acts as: the admin password with the
    admin token (env: LLMGW_ADMIN_PASSWORD for scripts), a signed-in account's own (env:
    LLMGW_PASSWORD)."""
    if bool(target) == all_nodes:
        raise click.UsageError("name one NODE or pass --all")
    password = c.own_password("to sign the update")
    body: dict[str, Any] = {"version": version, "password": password, "ttl": ttl}
    if all_nodes:
        body["all"] = True
    else:
        body["nodes"] = [target]
    rows = c.call("POST", "/api/updates", body, password=True)
    nodes = [r["node"] for r in rows]
    deadline = time.monotonic() + timeout
    shown: dict[str, tuple[str, str]] = {}

    def progress(current: list[dict[str, Any]]) -> None:
        for r in current:
            seen = (r["state"], r["message"])
            if shown.get(r["node"]) != seen and not c.as_json:
                click.echo(f"{r['node']}: {r['version']} {r['state']}: {r['message']}", err=True)
            shown[r["node"]] = seen

    progress(rows)
    while wait and not all(r["final"] for r in rows):
        if time.monotonic() > deadline:
            pending = ", ".join(f"{r['node']} ({r['state']})" for r in rows if not r["final"])
            raise click.ClickException(
                f"the update is not finished after {timeout:.0f}s: {pending}; "
                "'llmgw ctl nodes' shows where each node is"
            )
        time.sleep(1.0)
        rows = c.call("GET", "/api/updates?" + "&".join(f"node={n}" for n in nodes))
        progress(rows)
    if c.as_json:
        echo_json(rows)
    else:
        click.echo(
            table(
                ["NODE", "VERSION", "COUNTER", "STATE", "MESSAGE"],
                [[r["node"], r["version"], r["counter"], r["state"], r["message"]] for r in rows],
            )
        )
    if wait and any(r["state"] != "done" for r in rows):
        raise click.exceptions.Exit(1)


@click.group(cls=ReportingGroup)
def admin() -> None:
    """The control plane's own credentials."""


@admin.command("password")
@pass_ctl
def admin_password(c: Ctl) -> None:
    """Change the admin password that signed updates ask for (old, then new twice; env:
    LLMGW_ADMIN_PASSWORD and LLMGW_NEW_ADMIN_PASSWORD for scripts)."""
    old = read_secret(
        ADMIN_PASSWORD_ENV, "current admin password (not echoed): ", what="admin password"
    )
    new = read_secret(
        NEW_ADMIN_PASSWORD_ENV,
        "new admin password (not echoed): ",
        what="new admin password",
        again="new admin password again: ",
    )
    data = c.call("PUT", "/api/admin/password", {"old": old, "new": new}, password=True)
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"admin password changed; {data['removed']} (the first one) was removed")
