"""The admin route of a model's last hour (llmgw.server.admin.metrics), over real HTTP
through the admin router: the token required, the points as JSON, a deployed model without
traffic answering zeros, an unknown model 404 naming the known ones, bad queries 400."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.bodies import BodyBudget
from llmgw.server.admin.context import AdminContext, guarded
from llmgw.server.admin.metrics import MetricsRoutes
from llmgw.server.gateway.history import BUCKETS, RequestHistory

TOKEN = "admin-secret"
NOW = 1_800_000_000.0


def exchange(
    history: RequestHistory, deployed: list[str], requests: list[tuple[str, str | None]]
) -> list[tuple[int, Any]]:
    ctx = cast(
        AdminContext,
        SimpleNamespace(
            admin_token=TOKEN,
            admin_token_file=Path("/s/token"),
            logins=SimpleNamespace(resolve=lambda token, kind: None),  # no login token
            bodies=BodyBudget(1 << 20),
            serving=SimpleNamespace(models={name: object() for name in deployed}),
            history=history,
        ),
    )
    app = web.Application()
    app.router.add_get("/api/metrics/history", guarded(ctx, MetricsRoutes(ctx).history))

    async def scenario() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for path, token in requests:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                resp = await client.get(path, headers=headers)
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(scenario())


def _history() -> RequestHistory:
    history = RequestHistory(clock=lambda: NOW)
    history.record("llama", ttft=0.25)
    history.record("llama", error=True)
    return history


def test_the_points_of_a_model() -> None:
    ((status, body),) = exchange(
        _history(), ["llama"], [("/api/metrics/history?model=llama", TOKEN)]
    )
    assert status == 200
    assert body["model"] == "llama" and body["step_s"] == 10
    points = body["points"]
    assert len(points) == BUCKETS
    last = points[-1]
    assert (last["t"], last["requests"], last["errors"]) == (NOW, 2, 1)
    assert abs(last["ttft_p50"] / 0.25 - 1) < 0.13
    assert points[0] == {
        "t": NOW - (BUCKETS - 1) * 10,
        "rps": 0.0,
        "requests": 0,
        "errors": 0,
        "ttft_p50": None,
        "ttft_p99": None,
    }


def test_a_coarser_step() -> None:
    ((status, body),) = exchange(
        _history(), ["llama"], [("/api/metrics/history?model=llama&step=60", TOKEN)]
    )
    assert status == 200 and len(body["points"]) == 60 and body["step_s"] == 60


def test_the_admin_token_is_required() -> None:
    answers = exchange(
        _history(),
        ["llama"],
        [("/api/metrics/history?model=llama", None), ("/api/metrics/history?model=llama", "x")],
    )
    assert [status for status, _ in answers] == [401, 401]
    assert answers[0][1]["error"]["code"] == "unauthorized"


def test_a_deployed_model_without_traffic_answers_zeros() -> None:
    ((status, body),) = exchange(
        _history(), ["llama", "qwen"], [("/api/metrics/history?model=qwen", TOKEN)]
    )
    assert status == 200
    assert not any(p["requests"] for p in body["points"])


def test_an_unknown_model_is_404_naming_the_known_ones() -> None:
    # "old" is no longer deployed but served within the hour: known still.
    history = _history()
    history.record("old")
    ((status, body),) = exchange(
        history, ["llama", "qwen"], [("/api/metrics/history?model=x", TOKEN)]
    )
    assert status == 404
    assert body["error"] == {
        "message": "no model 'x' deployed or served in the last hour; known: llama, old, qwen",
        "code": "not_found",
    }
    ((status, body),) = exchange(
        RequestHistory(clock=lambda: NOW), [], [("/api/metrics/history?model=x", TOKEN)]
    )
    assert status == 404 and "none is ('llmgw ctl models' lists them)" in body["error"]["message"]


def test_bad_queries() -> None:
    answers = exchange(
        _history(),
        ["llama"],
        [
            ("/api/metrics/history", TOKEN),
            ("/api/metrics/history?model=llama&step=abc", TOKEN),
            ("/api/metrics/history?model=llama&step=15", TOKEN),
        ],
    )
    assert [status for status, _ in answers] == [400, 400, 400]
    messages = [body["error"]["message"] for _, body in answers]
    assert messages[0] == "name the model: /api/metrics/history?model=NAME"
    assert messages[1] == "step must be whole seconds, not 'abc'"
    assert messages[2].startswith("step must be a multiple of 10 s")
