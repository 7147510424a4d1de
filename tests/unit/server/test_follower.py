"""A standby's LeaderProxy: it forwards the raw path it checked (never a decoded one that
normalises into another), and over ``tls: cluster`` it sends nothing to a peer whose
certificate the cluster CA issued without the control plane's identity (a node enrolled under
the leader's host name). The leader here is a real aiohttp server that records what reached
it; TLS is real."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from llmgw import pki
from llmgw.server.ha import leader_ssl
from llmgw.server.ha.follower import LeaderProxy


class Leader:
    """The leader's admin API as the proxy meets it: every request recorded, /v1/models
    distinguishable from the admin API."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []

    def app(self) -> web.Application:
        async def models(request: web.Request) -> web.Response:
            self.seen.append((request.method, request.raw_path, None))
            return web.json_response({"data": ["the gateway's model list"]})

        async def admin(request: web.Request) -> web.Response:
            auth = request.headers.get("Authorization")
            self.seen.append((request.method, request.raw_path, auth))
            return web.json_response({"raw_path": request.raw_path})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_route("*", "/{tail:.*}", admin)
        return app


async def _through(
    leader: Leader,
    scenario: Callable[[aiohttp.ClientSession, str], Awaitable[Any]],
    *,
    leader_url: Callable[[int], str] = lambda port: f"http://127.0.0.1:{port}",
    leader_ssl: ssl.SSLContext | None = None,
    proxy_ssl: Callable[[], Any] = lambda: None,
) -> Any:
    runner = web.AppRunner(leader.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=leader_ssl)
    await site.start()
    port = runner.addresses[0][1]
    proxy = LeaderProxy(lambda: leader_url(port), ssl=proxy_ssl)
    standby = web.Application()
    proxy.add_routes(standby)
    try:
        async with TestClient(TestServer(standby)) as client:
            base = str(client.make_url("/")).rstrip("/")
            return await scenario(client.session, base)
    finally:
        await proxy.close()
        await runner.cleanup()


async def _get(session: aiohttp.ClientSession, base: str, raw: str) -> tuple[int, Any]:
    # encoded=True: the bytes of the request line exactly as written here.
    async with session.get(URL(base + raw, encoded=True)) as resp:
        return resp.status, await resp.json()


def test_an_encoded_path_does_not_reach_what_it_decodes_to() -> None:
    """The proxy forwarded the decoded path: /api/x%2F..%2F..%2Fv1%2Fmodels left the
    standby as /api/x/../../v1/models, which the client library normalised to /v1/models."""
    leader = Leader()

    async def scenario(session: aiohttp.ClientSession, base: str) -> tuple[int, Any]:
        return await _get(session, base, "/api/x%2F..%2F..%2Fv1%2Fmodels")

    status, body = asyncio.run(_through(leader, scenario))
    assert status == 400
    assert body["error"]["code"] == "bad_path"
    assert "without encoded slashes (%2F, %5C) or '.'/'..' segments" in body["error"]["message"]
    assert leader.seen == []


@pytest.mark.parametrize(
    "raw",
    [
        "/api/../v1/models",
        "/api/nodes/./x",
        "/api/%2e%2e/v1/models",
        "/api/.%2E/v1/models",
        "/ui/x%5c..%5cv1",
        "/ui/x%2fy",
    ],
)
def test_dot_segments_and_encoded_separators_are_refused(raw: str) -> None:
    leader = Leader()

    async def scenario(session: aiohttp.ClientSession, base: str) -> tuple[int, Any]:
        return await _get(session, base, raw)

    status, _ = asyncio.run(_through(leader, scenario))
    assert status == 400
    assert leader.seen == []


def test_the_raw_path_and_query_reach_the_leader_as_sent() -> None:
    leader = Leader()
    sent = ["/api/nodes?state=pending&q=a%20b", "/api/keys/k%20x", "/ui", "/api"]

    async def scenario(session: aiohttp.ClientSession, base: str) -> list[int]:
        return [(await _get(session, base, raw))[0] for raw in sent]

    assert asyncio.run(_through(leader, scenario)) == [200] * len(sent)
    assert [raw for _, raw, _ in leader.seen] == sent


def _leader_ssl(pki_dir: Path) -> Any:
    """The context the standby's proxy uses with ``tls: cluster`` (ControlPlane's own)."""
    return leader_ssl(cast(Any, SimpleNamespace(cluster=True)), pki_dir)


def _serving(ident: pki.Identity) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(ident.cert, ident.key)
    return ctx


def test_a_node_certified_for_the_leaders_name_gets_nothing(
    tmp_path: Path, resolve_to_loopback: None, caplog: pytest.LogCaptureFixture
) -> None:
    """leader_http names cp.example; a node enrolled as cp.example holds a certificate of
    the cluster CA for that name. The proxy ends the handshake before the operator's token
    goes out, and says why; the real leader's certificate goes through."""
    ca = pki.init_ca(tmp_path / "pki")
    node = pki.issue_node_cert(ca, "cp.example", tmp_path / "node")
    server = pki.issue_server_cert(ca, tmp_path / "server", hosts=["cp.example"])

    async def scenario(session: aiohttp.ClientSession, base: str) -> tuple[int, Any]:
        headers = {"Authorization": "Bearer the-operators-token"}
        async with session.get(base + "/api/nodes", headers=headers) as resp:
            return resp.status, await resp.json()

    def run(ident: pki.Identity) -> tuple[Leader, tuple[int, Any]]:
        leader = Leader()
        got = asyncio.run(
            _through(
                leader,
                scenario,
                leader_url=lambda port: f"https://cp.example:{port}",
                leader_ssl=_serving(ident),
                proxy_ssl=lambda: _leader_ssl(tmp_path / "pki"),
            )
        )
        return leader, got

    with caplog.at_level(logging.WARNING, logger="llmgw.server.follower"):
        leader, (status, body) = run(node)
    assert status == 503 and body["error"]["code"] == "no_leader"
    assert leader.seen == []
    (line,) = [r for r in caplog.records if r.name == "llmgw.server.follower"]
    assert line.getMessage().startswith("refused to forward an admin request: the leader's")
    assert pki.CONTROL_PLANE_OID.dotted_string in line.fields["reason"]  # type: ignore[attr-defined]
    leader, (status, _) = run(server)
    assert status == 200
    assert leader.seen == [("GET", "/api/nodes", "Bearer the-operators-token")]


def test_with_the_database_away_a_standby_says_so_rather_than_that_nobody_leads() -> None:
    """The standby cannot read the lease while PostgreSQL is away; its refusal said "no
    instance leads now" though the leader leads on. It says the database is away."""

    async def main() -> list[dict[str, Any]]:
        bodies = []
        for leader, away in (("", time.time()), ("", None), ("http://127.0.0.1:9", time.time())):
            proxy = LeaderProxy(lambda leader=leader: leader, database_away=lambda a=away: a)
            standby = web.Application()
            proxy.add_routes(standby)
            try:
                async with TestClient(TestServer(standby)) as client:
                    resp = await client.get("/api/nodes")
                    assert resp.status == 503
                    bodies.append((await resp.json())["error"])
            finally:
                await proxy.close()
        return bodies

    away, nobody, silent = asyncio.run(main())
    assert away["code"] == "database_unreachable"
    assert "the database is unreachable since " in away["message"]
    assert "no instance leads now" not in away["message"]
    assert "point llmgw ctl at the leader" in away["message"]
    assert nobody["code"] == "no_leader"
    assert "no instance leads now" in nobody["message"]  # the database answers: it is true
    assert silent["code"] == "database_unreachable"
    assert "the leader at http://127.0.0.1:9 does not answer" in silent["message"]


@pytest.mark.parametrize(
    "raw",
    ["/api/ha/kv-events", "/api/ha/kv-events?x=1", "/api/ha/kv-events/", "/api/ha/kv%2Devents"],
)
def test_the_kv_events_relay_is_not_forwarded_and_the_refusal_names_the_leader(raw: str) -> None:
    """A holder of the admin token asking a standby for the relay's endless stream held the
    standby's proxy to the leader for its 120 s timeout: it is refused at once, 421, with
    what to call instead; nothing reaches the leader."""
    leader = Leader()
    urls: list[str] = []

    def leader_url(port: int) -> str:
        urls.append(f"http://127.0.0.1:{port}")
        return urls[-1]

    async def scenario(session: aiohttp.ClientSession, base: str) -> tuple[int, Any]:
        return await _get(session, base, raw)

    status, body = asyncio.run(_through(leader, scenario, leader_url=leader_url))
    assert status == 421
    assert body["error"]["code"] == "not_forwarded"
    assert (
        f"call GET /api/ha/kv-events on the leader ({urls[-1]}) itself" in body["error"]["message"]
    )
    assert leader.seen == []


def test_paths_beside_the_relay_are_still_forwarded() -> None:
    leader = Leader()
    sent = ["/api/ha/kv-events-x", "/api/ha/other", "/api/ha"]

    async def scenario(session: aiohttp.ClientSession, base: str) -> list[int]:
        return [(await _get(session, base, raw))[0] for raw in sent]

    assert asyncio.run(_through(leader, scenario)) == [200] * len(sent)
    assert [raw for _, raw, _ in leader.seen] == sent


def test_with_no_leader_the_relay_refusal_says_none_leads() -> None:
    async def main() -> tuple[int, Any]:
        proxy = LeaderProxy(lambda: "")
        standby = web.Application()
        proxy.add_routes(standby)
        try:
            async with TestClient(TestServer(standby)) as client:
                resp = await client.get("/api/ha/kv-events")
                return resp.status, await resp.json()
        finally:
            await proxy.close()

    status, body = asyncio.run(main())
    assert status == 421
    assert "the leader (none leads now)" in body["error"]["message"]
