"""The admin API's routes on a real store, for the tests of the keys and usage routes and of
the ``llmgw ctl`` commands that call them: requests answered in process, the gateway's key
refreshes counted, this instance's unflushed usage set by the test."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.bodies import BodyBudget
from llmgw.contracts.keypolicy import UsageRow
from llmgw.server.accounts.logins import LoginPolicy, Logins
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.admin import add_admin_routes
from llmgw.server.admin.context import AdminContext
from llmgw.server.store import Store

ADMIN = "admin-secret"


class Admin:
    """The admin API on a real store: ``call(method, path, body)`` -> (status, JSON)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.refreshed = 0
        self.pending: list[UsageRow] = []
        self.last_headers: dict[str, str] = {}  # the last answer's headers
        serving = SimpleNamespace(refresh_keys=self._refresh)
        operators = OperatorAccounts(store)
        self.ctx = cast(
            AdminContext,
            SimpleNamespace(
                store=store,
                operators=operators,
                logins=Logins(store, operators, LoginPolicy()),
                serving=serving,
                bodies=BodyBudget(1 << 20),
                admin_token=ADMIN,
                admin_token_file=Path("/s/token"),
                pending_usage=lambda: list(self.pending),
            ),
        )

    def _refresh(self) -> None:
        self.refreshed += 1

    def call(
        self, method: str, path: str, body: Any = None, *, token: str | None = ADMIN
    ) -> tuple[int, Any]:
        """``token``: the bearer credential (the admin token unless given; None: none)."""
        app = web.Application()  # one per event loop
        add_admin_routes(app, self.ctx)
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}

        async def main() -> tuple[int, Any]:
            async with TestClient(TestServer(app)) as client:
                resp = await client.request(method, path, json=body, headers=headers)
                self.last_headers = dict(resp.headers)
                return resp.status, await resp.json()

        return asyncio.run(main())

    def ok(self, method: str, path: str, body: Any = None, status: int = 200) -> Any:
        got, data = self.call(method, path, body)
        assert got == status, data
        return data

    def refused(self, method: str, path: str, body: Any = None, status: int = 400) -> str:
        got, data = self.call(method, path, body)
        assert got == status, data
        return str(data["error"]["message"])
