"""/healthz and /metrics (llmgw.server.gateway.probes) on the gateway's listener: a stranger gets the
status and role a load balancer needs and no metrics; the metrics token or the admin token,
as Prometheus sends it (Authorization: Bearer), gets both in full."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw.server.common.config import load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.routing import Endpoint, Router
from tests.unit.gateway_rig import gateway_of, serving_of
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(30)

METRICS_TOKEN = "llmgw-metrics-abc"
ADMIN_TOKEN = "llmgw-admin-xyz"


def run(body: Callable[[str, aiohttp.ClientSession], Awaitable[None]], **more: Any) -> None:
    async def main() -> None:
        cfg = load_server_config(None)
        router = Router()
        router.set_ready(Endpoint("m", "r1", "s1", "n1", "127.0.0.1:9"))
        metrics = Metrics()
        metrics.key_requests.inc(("team-a", "m", "200"))
        gateway = gateway_of(
            cfg,
            router,
            serving_of(cfg, [], []),
            metrics=metrics,
            readers=(METRICS_TOKEN, ADMIN_TOKEN),
            **more,
        )
        app = web.Application()
        gateway.add_routes(app)
        async with serving(app) as port, aiohttp.ClientSession() as http:
            await body(f"http://127.0.0.1:{port}", http)

    asyncio.run(main())


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_metrics_need_the_metrics_or_the_admin_token() -> None:
    async def body(url: str, http: aiohttp.ClientSession) -> None:
        for headers in ({}, bearer("wrong"), {"Authorization": f"Basic {METRICS_TOKEN}"}):
            async with http.get(url + "/metrics", headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"] == 'Bearer realm="llmgw"'
                text = await resp.text()
                assert "team-a" not in text
                error = (await resp.json())["error"]
                assert error["code"] == "unauthorized"
                assert "metrics_token_file in server.yaml" in error["message"]
        for token in (METRICS_TOKEN, ADMIN_TOKEN):
            async with http.get(url + "/metrics", headers=bearer(token)) as resp:
                assert resp.status == 200
                text = await resp.text()
                assert 'llmgw_key_requests_total{key="team-a",model="m",code="200"} 1' in text

    run(body)


def test_healthz_tells_a_stranger_only_its_status_and_role() -> None:
    health = {
        "role": "standby",
        "instance": "cp2",
        "leader": "https://cp1:8080",
        "database": "unreachable since 2026-01-01 00:00:00; ...",
    }

    async def body(url: str, http: aiohttp.ClientSession) -> None:
        async with http.get(url + "/healthz") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ok", "role": "standby"}
        async with http.get(url + "/healthz", headers=bearer("wrong")) as resp:
            assert await resp.json() == {"status": "ok", "role": "standby"}
        async with http.get(url + "/healthz", headers=bearer(METRICS_TOKEN)) as resp:
            assert await resp.json() == {
                "status": "ok",
                "epoch": 1,
                "nodes": 0,
                "models": ["m"],
                **health,
            }

    run(body, health=lambda: health)


def test_healthz_answers_503_draining_while_a_stop_drains_the_instance() -> None:
    draining: dict[str, object] | None = None

    async def body(url: str, http: aiohttp.ClientSession) -> None:
        nonlocal draining
        async with http.get(url + "/healthz") as resp:
            assert resp.status == 200
        draining = {"status": "draining", "phase": "draining", "in_flight": 2}
        async with http.get(url + "/healthz") as resp:
            assert resp.status == 503
            assert await resp.json() == {"status": "draining", "role": "leader"}
        async with http.get(url + "/healthz", headers=bearer(ADMIN_TOKEN)) as resp:
            assert resp.status == 503
            got = await resp.json()
            assert got["status"] == "draining" and got["in_flight"] == 2
            assert got["models"] == ["m"] and got["role"] == "leader"
        async with http.get(url + "/metrics", headers=bearer(ADMIN_TOKEN)) as resp:
            assert resp.status == 200  # Prometheus still scrapes a draining instance

    run(body, draining=lambda: draining)


def test_a_single_instance_is_the_leader() -> None:
    async def body(url: str, http: aiohttp.ClientSession) -> None:
        async with http.get(url + "/healthz") as resp:
            assert await resp.json() == {"status": "ok", "role": "leader"}

    run(body)
