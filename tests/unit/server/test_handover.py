"""The :8080 socket kept across a change of role (llmgw.server.ha.handover): a request sent
to the retiring role's application ends there, and while it waits in that application's
gateway queue it still hears of a replica becoming ready after the new role's gateway was
built (each gateway's admission subscribes to the router until its gateway is closed)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from llmgw.listener import ListenerLimits, listening_socket
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.queueing import Admission
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.ha import Handover


def _role_app(router: Router, name: str) -> tuple[web.Application, Admission]:
    """One role's application: a gateway-like handler queued in its own admission, closed
    with the application as ControlPlane._gateway closes the gateway's."""
    admission = Admission(router, lambda _model: 1, Metrics())

    async def complete(_request: web.Request) -> web.Response:
        ep = await admission.acquire("m", "key", 1, frozenset(), timeout=30.0)
        return web.json_response({"app": name, "shard": ep.shard_id})

    async def close(_app: web.Application) -> None:
        admission.close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.on_cleanup.append(close)
    return app, admission


async def _until(check: Any) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never")


def test_a_request_queued_in_the_retiring_application_hears_of_a_ready_replica() -> None:
    async def main() -> None:
        router = Router()
        busy = Endpoint("m", "r1", "s1", "n1", "127.0.0.1:9001", inflight=1)  # full
        router.set_ready(busy)
        sock = listening_socket("127.0.0.1", 0)
        handover = Handover(sock, listen="127.0.0.1:0", limits=ListenerLimits())
        leader_app, leader_admission = _role_app(router, "leader")
        await handover.serve(leader_app, None)
        url = f"http://127.0.0.1:{handover.port}/v1/chat/completions"
        async with aiohttp.ClientSession() as session:
            queued = asyncio.create_task(session.post(url))
            await _until(lambda: leader_admission.depth("m") == 1)
            # The role changes: the standby's gateway is built and its application served.
            standby_app, standby_admission = _role_app(router, "standby")
            await handover.serve(standby_app, None)
            # A replica becomes ready: the request queued in the leader's gateway takes it.
            router.set_ready(Endpoint("m", "r2", "s2", "n2", "127.0.0.1:9002"))
            response = await asyncio.wait_for(queued, timeout=10)
            assert (response.status, await response.json()) == (
                200,
                {"app": "leader", "shard": "s2"},
            )
            response.release()
            # New requests go to the standby's application.
            busy.inflight = 0
            async with session.post(url) as fresh:
                assert (await fresh.json())["app"] == "standby"
            assert standby_admission.depth("m") == 0
        await handover.close()
        sock.close()

    asyncio.run(main())


def test_a_retired_gateway_is_no_longer_told() -> None:
    router = Router()
    told: list[str] = []
    stop_old = router.on_ready(lambda model: told.append(f"old {model}"))
    router.on_ready(lambda model: told.append(f"new {model}"))
    router.set_ready(Endpoint("m", "r1", "s1", "n1", "127.0.0.1:9001"))
    stop_old()
    stop_old()  # twice: nothing more
    router.set_ready(Endpoint("m", "r2", "s2", "n2", "127.0.0.1:9002"))
    assert told == ["old m", "new m", "new m"]
