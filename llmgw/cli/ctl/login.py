"""``llmgw ctl login``, ``logout`` and ``whoami``: ctl acting as an operator account.

``login NAME`` asks NAME's password (env: ``LLMGW_PASSWORD``), trades it at the control
plane for a token of the account's own (``POST /api/login``, rate-limited like the
console's sign-in) and keeps it per server in ``$XDG_CONFIG_HOME/llmgw/logins.yaml``
(0600). From then on ctl sends that token to that server instead of the shared admin
token, so that the events name the operator; a viewer's token only reads. The shared admin
token stays for automation and is recorded as ``token``.
"""

from __future__ import annotations

import time
from typing import Any

import click

from llmgw.cli.ctl.context import OWN_PASSWORD_ENV, Ctl, pass_ctl
from llmgw.cli.ctl.output import echo_json
from llmgw.cli.prompts import read_secret
from llmgw.client import Login, forget_login, save_login
from llmgw.errors import APIError

__all__ = ["login", "logout", "whoami"]


@click.command()
@click.argument("name")
@pass_ctl
def login(c: Ctl, name: str) -> None:
    """Sign in to the control plane as the account NAME (asks its password; env:
    LLMGW_PASSWORD): ctl then acts as NAME there, and the events say so."""
    password = read_secret(OWN_PASSWORD_ENV, f"password of {name} (not echoed): ", what="password")
    data: dict[str, Any] = c.call(
        "POST", "/api/login", {"name": name, "password": password}, password=True
    )
    server = c.client.target.server if c.client.target else ""
    path = save_login(Login(server, data["account"], data["token"], float(data["expires_at"])))
    if c.as_json:
        echo_json({k: data[k] for k in ("account", "role", "expires_at")} | {"saved": str(path)})
        return
    left = max(0.0, float(data["expires_at"]) - time.time())
    click.echo(
        f"signed in to {server} as {data['account']} ({data['role']}); the login lasts "
        f"{left / 86400:.0f} days at most (kept in {path})"
    )


@click.command()
@pass_ctl
def logout(c: Ctl) -> None:
    """End this server's login (here and at the control plane)."""
    target = c.client.candidates[0]
    if target.account is None:
        if c.as_json:
            echo_json({"server": target.server, "account": None, "signed_out": False})
            return
        click.echo(f"not signed in to {target.server}; nothing to do")
        return
    try:
        c.call("POST", "/api/logout")
    except APIError as exc:
        if exc.status != 401:  # 401: it had ended there already
            raise
    forget_login(target.server)
    if c.as_json:
        echo_json({"server": target.server, "account": target.account, "signed_out": True})
        return
    click.echo(f"signed out of {target.server} ({target.account})")


@click.command()
@pass_ctl
def whoami(c: Ctl) -> None:
    """Who ctl acts as at the control plane: an account and its role, or the admin token."""
    data: dict[str, Any] = c.call("GET", "/api/whoami")
    if c.as_json:
        echo_json(data)
        return
    if data["via"] == "token":
        click.echo(
            "the shared admin token (recorded as 'token'; 'llmgw ctl login NAME' to act as "
            "yourself)"
        )
    else:
        click.echo(f"{data['name']} ({data['role']})")
