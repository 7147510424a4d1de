"""The admin routes of the cluster CA (llmgw.server.admin.ca): what they accept and refuse,
over real HTTP to a stand-in of the control plane's ClusterAuthority."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.bodies import BodyBudget
from llmgw.errors import Conflict
from llmgw.server.admin.ca import CARoutes
from llmgw.server.admin.context import AdminContext, guarded
from llmgw.server.authority import ClusterAuthority

TOKEN = "admin-secret"


class FakeAuthority:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def status(self) -> dict[str, Any]:
        self.calls.append(("status", None))
        return {"current": {"ca_hash": "sha256:new"}}

    def rotate(self, overlap: float) -> dict[str, Any]:
        self.calls.append(("rotate", overlap))
        return {"rotated": overlap}

    def finish(self, *, force: bool = False) -> dict[str, Any]:
        self.calls.append(("finish", force))
        if not force:
            raise Conflict("nodes gpu-2 still hold certificates of the old CA")
        return {"finished": True}


def exchange(requests: list[tuple[str, str, Any]]) -> tuple[list[tuple[int, Any]], FakeAuthority]:
    authority = FakeAuthority()
    ctx = cast(
        AdminContext,
        SimpleNamespace(
            admin_token=TOKEN, admin_token_file=Path("/s/token"), bodies=BodyBudget(1 << 20)
        ),
    )
    routes = CARoutes(ctx, cast(ClusterAuthority, authority))
    app = web.Application()
    app.router.add_get("/api/ca", guarded(ctx, routes.status))
    app.router.add_post("/api/ca/rotate", guarded(ctx, routes.rotate))
    app.router.add_post("/api/ca/finish", guarded(ctx, routes.finish))

    async def scenario() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(app)) as client:
            out = []
            for method, path, body in requests:
                resp = await client.request(
                    method, path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}
                )
                out.append((resp.status, await resp.json()))
            return out

    return asyncio.run(scenario()), authority


def test_rotate_takes_a_duration_and_defaults_to_seven_days() -> None:
    answers, authority = exchange(
        [
            ("POST", "/api/ca/rotate", {"overlap": "2d"}),
            ("POST", "/api/ca/rotate", {"overlap": 3600}),
            ("POST", "/api/ca/rotate", {}),
        ]
    )
    assert [a[0] for a in answers] == [200, 200, 200]
    assert authority.calls == [
        ("rotate", 172800.0),
        ("rotate", 3600.0),
        ("rotate", 7 * 86400.0),
    ]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"overlap": "30s"}, "overlap must be from 1m to 365d"),
        ({"overlap": "400d"}, "overlap must be from 1m to 365d"),
        ({"overlap": "soon"}, "overlap must be seconds, or a duration like"),
        ({"overlap": True}, "overlap must be seconds"),
        ({"overlap": "1d", "force": True}, "unknown field(s) force; send only 'overlap'"),
    ],
)
def test_rotate_refuses_what_it_cannot_use(body: dict[str, Any], words: str) -> None:
    answers, authority = exchange([("POST", "/api/ca/rotate", body)])
    status, answer = answers[0]
    assert status == 400
    assert words in answer["error"]["message"]
    assert authority.calls == []


def test_finish_is_refused_with_the_reason_unless_forced() -> None:
    answers, authority = exchange(
        [
            ("POST", "/api/ca/finish", {}),
            ("POST", "/api/ca/finish", {"force": True}),
            ("POST", "/api/ca/finish", {"force": "yes"}),
            ("GET", "/api/ca", None),
        ]
    )
    assert answers[0] == (
        409,
        {
            "error": {
                "message": "nodes gpu-2 still hold certificates of the old CA",
                "code": "conflict",
            }
        },
    )
    assert answers[1] == (200, {"finished": True})
    assert (
        answers[2][0] == 400 and "force must be true or false" in answers[2][1]["error"]["message"]
    )
    assert answers[3] == (200, {"current": {"ca_hash": "sha256:new"}})
    assert authority.calls == [("finish", False), ("finish", True), ("status", None)]
