"""The console as its tests drive it: a real aiohttp application (the JSON error middleware
of :8080 included) with the console's routes over a real store, real accounts and login
sessions, the real scheduler and membership; a test client that signs in through the login
form like a browser, keeping its cookies."""

from __future__ import annotations

import asyncio
import html
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.bodies import BodyBudget
from llmgw.contracts.inventory import inventory_dict
from llmgw.pki import Authority
from llmgw.proto import control_pb2 as pb
from llmgw.server.accounts.logins import LoginPolicy, Logins
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import PASSWORD_FILE, AdminPassword
from llmgw.server.admin.context import AdminContext
from llmgw.server.common.httpapi import error_middleware
from llmgw.server.common.metrics import Metrics
from llmgw.server.console import Console, add_console_routes
from llmgw.server.fleet.nodes import Membership
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Store
from tests.unit.clock import Clock

VIEWER_PW = "vera's long password"
NOW = 1_800_000_000.0
HOSTILE = '<script>alert("x")</script>'
ADMIN_TOKEN = "llmgw-admin-test-token"

T = TypeVar("T")


class ConsoleRig:
    """The console's collaborators: accounts ``admin`` (the admin password) and ``vera``
    (viewer), a fleet the test adds nodes to."""

    def __init__(
        self,
        store: Store,
        clock: Clock,
        tmp_path: Path,
        *,
        scheme: str = "http",
        policy: LoginPolicy | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        password = AdminPassword(store, tmp_path / PASSWORD_FILE)
        password.start()
        self.admin_pw = (tmp_path / PASSWORD_FILE).read_text().strip()
        accounts = OperatorAccounts(store)
        accounts.ensure_first_admin()
        asyncio.run(accounts.add("vera", "viewer", VIEWER_PW, actor="admin"))
        self.logins = Logins(store, accounts, policy or LoginPolicy(), clock=clock)
        self.sessions: dict[str, NodeSession] = {}
        self.lost: set[str] = set()
        router = Router()
        self.scheduler = Scheduler(store, router, sessions=self.sessions, lost=self.lost)
        membership = Membership(
            store,
            self.scheduler,
            router,
            sessions=self.sessions,
            ca=cast(Authority, None),  # approval and renewal only; not the console's
            cert_lifetime=86400.0,
        )
        self.history = RequestHistory(clock=lambda: NOW)
        self.ctx = cast(
            AdminContext,
            SimpleNamespace(
                store=store,
                scheduler=self.scheduler,
                planner=None,
                membership=membership,
                updates=SimpleNamespace(status_of=lambda node_id: None, all_status=dict),
                sessions=self.sessions,
                lost=self.lost,
                history=self.history,
                bodies=BodyBudget(1 << 20),
                http_scheme=scheme,
                logins=self.logins,
                admin_token=ADMIN_TOKEN,
                metrics=Metrics(),
                tokenizer_problem=lambda _model: None,
            ),
        )

    def app(self) -> tuple[web.Application, Console]:
        app = web.Application(middlewares=[error_middleware])
        console = add_console_routes(app, self.ctx, clock=lambda: NOW)
        return app, console

    def add_node(
        self,
        node_id: str,
        *,
        state: str = "approved",
        connected: bool = True,
        gpus: int = 2,
        name: str = "NVIDIA H100",
        warm: Sequence[pb.WarmStatus] = (),
    ) -> None:
        inv = pb.Inventory(
            hostname=node_id,
            cpus=32,
            memory_total_bytes=256 << 30,
            engines=["sim"],
            engine_details=[pb.EngineInfo(name="sim", ok=True, version="1")],
            gpus=[
                pb.Gpu(index=i, uuid=f"GPU-{node_id}-{i}", name=name, memory_total_mib=81920)
                for i in range(gpus)
            ],
            fabrics=[pb.Fabric(name="ib-a", hcas=["mlx5_0"], healthy=True)],
            warm=warm,
        )
        self.store.upsert_node(
            node_id,
            dataplane_addr="10.0.0.1:9443",
            agent_version="0.9.0",
            inventory=inventory_dict(inv),
            connected=connected,
        )
        self.store.set_node_state(node_id, state)
        if connected:
            self.sessions[node_id] = NodeSession(
                node_id=node_id,
                dataplane_addr="10.0.0.1:9443",
                epoch=1,
                engines=frozenset(inv.engines),
                approved=state == "approved",
            )

    def run(
        self,
        scenario: Callable[[Browser], Awaitable[T]],
        setup: Callable[[Console], None] = lambda console: None,
    ) -> T:
        """``scenario`` against the console (``setup`` first), with a browser-like client."""
        app, console = self.app()
        setup(console)

        async def go() -> T:
            async with TestClient(TestServer(app)) as client:
                return await scenario(Browser(client, self))

        return asyncio.run(go())


_HIDDEN = re.compile(r'<input type="hidden" name="csrf" value="([^"]*)">')


def csrf_of(page: str) -> str:
    """The CSRF token of the first form of ``page``."""
    found = _HIDDEN.search(page)
    assert found is not None, "the page has no form with a CSRF token"
    return html.unescape(found.group(1))


class Browser:
    """A test client that signs in through the login form and keeps its cookies."""

    def __init__(self, client: TestClient, rig: ConsoleRig) -> None:
        self.client = client
        self.rig = rig
        self.csrf = ""

    @property
    def origin(self) -> str:
        return f"http://{self.client.host}:{self.client.port}"

    async def get(self, path: str, **kw: Any) -> tuple[int, str, Any]:
        resp = await self.client.get(path, allow_redirects=False, **kw)
        return resp.status, await resp.text(), resp

    async def post(
        self, path: str, data: dict[str, str] | None = None, **kw: Any
    ) -> tuple[int, str, Any]:
        resp = await self.client.post(path, data=data or {}, allow_redirects=False, **kw)
        return resp.status, await resp.text(), resp

    async def login(self, name: str = "admin", password: str | None = None) -> Any:
        """Sign in; the session's CSRF token (from the first page) kept in :attr:`csrf`."""
        status, page, _ = await self.get("/ui/login")
        assert status == 200, page
        status, _body, resp = await self.post(
            "/ui/login",
            {
                "csrf": csrf_of(page),
                "next": "/ui/",
                "name": name,
                "password": self.rig.admin_pw if password is None else password,
            },
        )
        if status == 303:
            status2, page, _ = await self.get("/ui/")
            assert status2 == 200, page
            self.csrf = csrf_of(page)
        return resp


_FLASH = re.compile(
    r'<p class="flash flash-(\w+)" role="(?:status|alert)" id="(?:flash|problem)">([^<]*)</p>'
)


def flash_of(page: str) -> str:
    """The page's flash message or refusal, as the operator reads it ("" when none)."""
    found = _FLASH.search(page)
    return f"{found.group(1)}: {html.unescape(found.group(2))}" if found else ""


async def sse_messages(resp: Any, count: int, timeout: float = 5.0) -> list[dict[str, str]]:
    """The next ``count`` SSE blocks (comments as {"comment": ...})."""
    out: list[dict[str, str]] = []
    block: dict[str, str] = {}

    async def read() -> None:
        while len(out) < count:
            raw = await resp.content.readline()
            if not raw:
                return
            line = raw.decode().rstrip("\n")
            if not line:
                if block:
                    out.append(dict(block))
                    block.clear()
                continue
            if line.startswith(":"):
                block["comment"] = line[1:].strip()
                continue
            name, _, value = line.partition(": ")
            block[name] = value

    await asyncio.wait_for(read(), timeout)
    return out


def box(page: str, box_id: str) -> str | None:
    """The text of a read-only command box, as the browser shows it."""
    found = re.search(rf'<textarea id="{box_id}-text"[^>]*>([^<]*)</textarea>', page)
    return None if found is None else html.unescape(found.group(1))
