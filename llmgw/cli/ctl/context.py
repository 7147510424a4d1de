"""The object every ``llmgw ctl`` command receives: the ctl group's options and the admin API
client built from them on first use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from llmgw.client import AdminClient, find_target

__all__ = ["Ctl", "pass_ctl"]


@dataclass
class Ctl:
    server: str | None
    token: str | None
    config: Path | None
    as_json: bool
    state_dir: Path | None = None
    ca: Path | None = None
    insecure_http: bool = False
    _client: AdminClient | None = None

    @property
    def client(self) -> AdminClient:
        if self._client is None:
            self._client = AdminClient(
                find_target(self.server, self.token, self.config, self.state_dir),
                ca=self.ca,
                insecure_http=self.insecure_http,
            )
        return self._client

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
