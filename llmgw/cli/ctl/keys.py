"""``llmgw ctl keys``: the API keys of the gateway."""

from __future__ import annotations

import click

from llmgw.cli.common import ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import ago, echo_json, table

__all__ = ["keys"]


@click.group(cls=ReportingGroup)
def keys() -> None:
    """API keys for the gateway (/v1)."""


@keys.command("create")
@click.argument("name")
@pass_ctl
def keys_create(c: Ctl, name: str) -> None:
    """Create a key for NAME; the key is shown once."""
    data = c.call("POST", "/api/keys", {"name": name})
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"created key {data['id']} for {data['name']}:")
    click.echo(data["key"])
    click.echo("store it now: it is not shown again (only its hash is kept)")


@keys.command("list")
@click.option("--all", "include_all", is_flag=True, help="Include revoked keys.")
@pass_ctl
def keys_list(c: Ctl, include_all: bool) -> None:
    """List API keys (prefixes only)."""
    data = c.call("GET", "/api/keys" + ("?all=1" if include_all else ""))
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            k["id"],
            k["name"],
            k["prefix"] + "…",
            ago(k["created_at"]),
            "revoked" if k["revoked_at"] else "active",
        ]
        for k in data
    ]
    click.echo(table(["ID", "NAME", "PREFIX", "CREATED", "STATE"], rows))


@keys.command("revoke")
@click.argument("key")
@pass_ctl
def keys_revoke(c: Ctl, key: str) -> None:
    """Revoke KEY (its id or prefix); requests with it get 401 at once."""
    data = c.call("DELETE", f"/api/keys/{key}")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"revoked key {data['id']} ({data['name']})")
