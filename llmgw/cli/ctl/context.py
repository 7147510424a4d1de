"""The object every ``llmgw ctl`` command receives: the ctl group's options and the admin API
client built from them on first use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from llmgw.cli.prompts import read_secret
from llmgw.client import ADMIN_PASSWORD_ENV, AdminClient, Transport, find_target

__all__ = ["OWN_PASSWORD_ENV", "Ctl", "pass_ctl"]

OWN_PASSWORD_ENV = "LLMGW_PASSWORD"
"""A signed-in account's own password, for scripts (the admin token's is LLMGW_ADMIN_PASSWORD)."""


@dataclass
class Ctl:
    server: str | None
    token: str | None
    config: Path | None
    as_json: bool
    state_dir: Path | None = None
    ca: Path | None = None
    insecure_http: bool = False
    transport: Transport | None = None
    _client: AdminClient | None = None

    @property
    def client(self) -> AdminClient:
        if self._client is None:
            self._client = AdminClient(
                find_target(self.server, self.token, self.config, self.state_dir),
                ca=self.ca,
                insecure_http=self.insecure_http,
                transport=self.transport,
            )
        return self._client

    @property
    def account(self) -> str | None:
        """The account ctl acts as (from 'llmgw ctl login'), or None for the admin token."""
        client = self.client
        target = client.target or (client.candidates[0] if client.candidates else None)
        return None if target is None else target.account

    def own_password(self, why: str) -> str:
        """The password of whoever ctl acts as, asked again for what a token alone may not
        do (``why``: signing an update, making an admin): the signed-in account's own, or
        the admin password with the admin token."""
        account = self.account
        if account is None:
            return read_secret(
                ADMIN_PASSWORD_ENV, f"admin password, {why} (not echoed): ", what="admin password"
            )
        return read_secret(
            OWN_PASSWORD_ENV, f"password of {account}, {why} (not echoed): ", what="password"
        )

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        password: bool = False,
    ) -> Any:
        """``password``: the body carries the admin password."""
        return self.client.request(method, path, body, password=password)


pass_ctl = click.make_pass_decorator(Ctl)
