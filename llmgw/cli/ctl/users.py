"""``llmgw ctl users``: the operator accounts (list, add, password, role, remove). A password
is typed twice at a no-echo prompt, or read from stdin with ``--password-stdin``; never an
argument, where every user of the machine could read it in /proc."""

from __future__ import annotations

import sys
from typing import Any
from urllib.parse import quote

import click

from llmgw.cli.common import ReportingGroup
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import ago, echo_json, table
from llmgw.cli.prompts import read_secret
from llmgw.errors import ConfigError, PasswordError

__all__ = ["USER_PASSWORD_ENV", "users"]

USER_PASSWORD_ENV = "LLMGW_USER_PASSWORD"
_JSON_HELP = "Print JSON for scripts instead of text (as 'llmgw ctl --json')."
_STDIN_HELP = (
    "Read the password from the first line of stdin instead of a prompt (else env: "
    f"{USER_PASSWORD_ENV})."
)
_ROLES = click.Choice(["admin", "viewer"])


def _password(name: str, from_stdin: bool) -> str:
    if from_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
        if not password:
            raise ConfigError("no password on stdin; nothing was changed")
        return password
    return read_secret(
        USER_PASSWORD_ENV,
        f"password for {name} (not echoed): ",
        what="password",
        again=f"password for {name} again: ",
    )


def _role_of(c: Ctl, name: str) -> str | None:
    """NAME's role now (None: no such account, which the change itself then reports)."""
    found: list[dict[str, Any]] = c.call("GET", "/api/users")
    return next((u["role"] for u in found if u["name"] == name), None)


def _path(name: str) -> str:
    return f"/api/users/{quote(name, safe='')}"


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.pass_context
def users(ctx: click.Context, as_json: bool) -> None:
    """Operator accounts (admin, viewer): list them, add, change or remove one."""
    c = ctx.find_object(Ctl)
    assert c is not None
    c.as_json = c.as_json or as_json
    if ctx.invoked_subcommand is None:
        _list(c)


@users.command("list")
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@pass_ctl
def list_users(c: Ctl, as_json: bool) -> None:
    """The active accounts."""
    c.as_json = c.as_json or as_json
    _list(c)


def _list(c: Ctl) -> None:
    data: list[dict[str, Any]] = c.call("GET", "/api/users")
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [u["name"], u["role"], ago(u["created_at"]), u["created_by"], ago(u["password_changed_at"])]
        for u in data
    ]
    click.echo(table(["NAME", "ROLE", "CREATED", "BY", "PASSWORD CHANGED"], rows))


@users.command("add")
@click.argument("name")
@click.option(
    "--role", type=_ROLES, required=True, help="admin changes the cluster; viewer reads it."
)
@click.option("--password-stdin", "from_stdin", is_flag=True, help=_STDIN_HELP)
@pass_ctl
def add(c: Ctl, name: str, role: str, from_stdin: bool) -> None:
    """Add the account NAME with ROLE; asks for its password twice. An admin account can
    sign updates, so adding one also asks for your own password (the admin password with
    the admin token)."""
    body = {"name": name, "role": role, "password": _password(name, from_stdin)}
    if role == "admin":
        body["confirm_password"] = c.own_password(f"to make {name} an admin")
    data = c.call("POST", "/api/users", body, password=True)
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"added {data['name']} ({data['role']})")


@users.command("password")
@click.argument("name")
@click.option("--password-stdin", "from_stdin", is_flag=True, help=_STDIN_HELP)
@pass_ctl
def password(c: Ctl, name: str, from_stdin: bool) -> None:
    """Set NAME's password; asks for it twice. Not admin's: that is the admin password,
    changed with 'llmgw ctl admin password'."""
    if name == "admin":
        # Refused here before a password is typed; the control plane refuses it too.
        raise PasswordError(
            "the password of 'admin' is the admin password; change it with 'llmgw ctl admin "
            "password', which asks for the current one"
        )
    body = {"password": _password(name, from_stdin)}
    if _role_of(c, name) == "admin":
        body["confirm_password"] = c.own_password(f"to set the password of the admin {name}")
    data = c.call("PATCH", _path(name), body, password=True)
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"changed the password of {data['name']}")


@users.command("role")
@click.argument("name")
@click.argument("role", type=_ROLES)
@pass_ctl
def role(c: Ctl, name: str, role: str) -> None:
    """Give NAME the ROLE admin or viewer (admin asks for your own password too)."""
    body = {"role": role}
    if role == "admin" and _role_of(c, name) != "admin":
        body["confirm_password"] = c.own_password(f"to make {name} an admin")
    data = c.call("PATCH", _path(name), body, password="confirm_password" in body)
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"{data['name']} is now {data['role']}")


@users.command("remove")
@click.argument("name")
@pass_ctl
def remove(c: Ctl, name: str) -> None:
    """Remove the account NAME (its events keep its name)."""
    data = c.call("DELETE", _path(name))
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"removed {data['removed']}")
