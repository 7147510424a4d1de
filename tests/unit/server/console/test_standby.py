"""The console through a standby (llmgw.server.ha.follower.LeaderProxy): every /ui/ request goes
to the leader whole, the Host along so that the Origin check holds, the event stream relayed
as it comes, and the browser's address signed under the admin token so that the leader's
login limits count the browser; an address a client claims itself is not believed, nor a
signed one replayed."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from llmgw.server.ha.follower import (
    CLIENT_ADDR_HEADER,
    CLIENT_MAC_HEADER,
    MAC_WINDOW,
    LeaderProxy,
    client_addr,
    sign_client_addr,
)
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import ADMIN_TOKEN, Browser, ConsoleRig, csrf_of, sse_messages


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path) -> ConsoleRig:
    rig = ConsoleRig(store, clock, tmp_path)
    rig.add_node("gpu-1")
    return rig


def through_standby(rig: ConsoleRig, scenario: Any) -> Any:
    leader_app, console = rig.app()
    console.stream.poll_s = 0.02

    async def go() -> Any:
        async with TestServer(leader_app) as leader:
            proxy = LeaderProxy(
                lambda: f"http://{leader.host}:{leader.port}", secret=lambda: ADMIN_TOKEN
            )
            standby = web.Application()
            proxy.add_routes(standby)
            try:
                async with TestClient(TestServer(standby)) as client:
                    return await scenario(Browser(client, rig))
            finally:
                await proxy.close()

    return asyncio.run(go())


def test_the_console_works_through_a_standby(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str, int, list[dict[str, str]]]:
        status, _, resp = await b.get("/ui/nodes")
        assert status == 303 and resp.headers["Location"].startswith("/ui/login?next=")
        await b.login()
        status, page, _ = await b.get("/ui/nodes/gpu-1")
        # The Origin a browser on the standby sends is the standby's: the Host went along.
        drained, _, _ = await b.post(
            "/ui/nodes/gpu-1/drain",
            {"csrf": b.csrf, "confirm": "gpu-1"},
            headers={"Origin": b.origin},
        )
        stream = await b.client.get("/ui/events/stream")
        await sse_messages(stream, 1)  # retry
        store.add_event("node_uncordon", "gpu-1", "live through the standby", "admin")
        live = await sse_messages(stream, 1)
        stream.close()
        return status, page, drained, live

    status, page, drained, live = through_standby(rig, scenario)
    assert status == 200 and '<span id="node-id">gpu-1</span>' in page
    assert drained == 303 and store.get_node("gpu-1").draining
    assert json.loads(live[0]["data"])["message"] == "live through the standby"


def test_a_foreign_origin_is_still_refused_through_a_standby(rig: ConsoleRig) -> None:
    async def scenario(b: Browser) -> int:
        await b.login()
        status, _, _ = await b.post(
            "/ui/nodes/gpu-1/drain",
            {"csrf": b.csrf, "confirm": "gpu-1"},
            headers={"Origin": "http://evil.example"},
        )
        return status

    assert through_standby(rig, scenario) == 403


def test_a_client_cannot_claim_an_address_through_a_standby(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> None:
        _, page, _ = await b.get("/ui/login")
        await b.post(
            "/ui/login",
            {"csrf": csrf_of(page), "name": "admin", "password": rig.admin_pw},
            headers=sign_client_addr(ADMIN_TOKEN, "203.0.113.7", "POST", "/ui/login"),
        )

    through_standby(rig, scenario)
    (login,) = [e for e in store.list_events() if e.kind == "operator_login"]
    # The standby dropped the client's own headers and signed the address it saw.
    assert login.message == "console login from 127.0.0.1"


ADDR = "203.0.113.7"


def _request(headers: dict[str, str], method: str = "POST", path: str = "/ui/login") -> web.Request:
    return make_mocked_request(method, path, headers=headers)


def test_the_client_address_a_standby_signs() -> None:
    signed = sign_client_addr(ADMIN_TOKEN, ADDR, "POST", "/ui/login")
    assert client_addr(_request(signed), ADMIN_TOKEN) == ADDR
    forged = {**sign_client_addr(ADMIN_TOKEN, ADDR, "POST", "/ui/login"), CLIENT_ADDR_HEADER: "x"}
    other_key = sign_client_addr("other", ADDR, "POST", "/ui/login")
    bare = {CLIENT_ADDR_HEADER: ADDR}
    for headers in (forged, other_key, bare):
        assert client_addr(_request(headers), ADMIN_TOKEN) != ADDR
    unsigned = sign_client_addr(ADMIN_TOKEN, ADDR, "POST", "/ui/login")
    assert client_addr(_request(unsigned), "") != ADDR  # no secret: nothing is believed


def test_a_signed_address_cannot_be_replayed() -> None:
    """The MAC covered only the address: headers seen once were good for any request, for
    ever. Now they hold for one method and raw path, within MAC_WINDOW, once."""
    signed = sign_client_addr(ADMIN_TOKEN, ADDR, "POST", "/ui/login")
    assert client_addr(_request(signed), ADMIN_TOKEN) == ADDR
    assert client_addr(_request(signed), ADMIN_TOKEN) != ADDR  # the same headers again
    for method, path in (("POST", "/api/login"), ("GET", "/ui/login"), ("POST", "/ui/login?x")):
        fresh = sign_client_addr(ADMIN_TOKEN, ADDR, "POST", "/ui/login")
        assert client_addr(_request(fresh, method, path), ADMIN_TOKEN) != ADDR, (method, path)
    now = time.time()
    for skew in (-MAC_WINDOW - 5, MAC_WINDOW + 5):  # signed too long ago, or too far ahead
        stale = sign_client_addr(ADMIN_TOKEN, ADDR, "POST", "/ui/login", now=now + skew)
        assert client_addr(_request(stale), ADMIN_TOKEN) != ADDR, skew
    skewed = sign_client_addr(ADMIN_TOKEN, ADDR, "POST", "/ui/login", now=now - MAC_WINDOW + 5)
    assert client_addr(_request(skewed), ADMIN_TOKEN) == ADDR  # clocks a little apart
    # The MAC of the last release (the address alone) is believed no more.
    old = hmac.new(ADMIN_TOKEN.encode(), b"client-addr:" + ADDR.encode(), hashlib.sha256)
    headers = {CLIENT_ADDR_HEADER: ADDR, CLIENT_MAC_HEADER: old.hexdigest()}
    assert client_addr(_request(headers), ADMIN_TOKEN) != ADDR
