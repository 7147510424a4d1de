"""The desired-engine routes' reading of a request body: one node or all, and the builds
(a list, or one from url/sha256/arch), each malformed shape refused with what to send; an
update order's ``all`` read as a JSON boolean only."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.bodies import BodyBudget
from llmgw.errors import ConfigError
from llmgw.server.admin.context import AdminContext, BadRequest, guarded
from llmgw.server.admin.software import MAX_BUILDS, SoftwareRoutes, _builds, _target
from llmgw.server.fleet.installs import Build

SHA = "d" * 64


def test_the_target_is_one_node_or_all() -> None:
    assert _target({"node": "gpu-1"}) == "gpu-1"
    assert _target({"node": "gpu-1", "all": False}) == "gpu-1"
    assert _target({"all": True}) is None
    for body in ({}, {"node": "gpu-1", "all": True}, {"node": ""}, {"node": ["a"]}, {"all": 1}):
        with pytest.raises(BadRequest) as info:
            _target(body)
        assert str(info.value) == "give either 'node' (one node id) or 'all': true"


def test_one_build_from_url_and_sha256_or_a_list() -> None:
    assert _builds({"url": "https://h/x.tgz", "sha256": SHA}) == [Build("", "https://h/x.tgz", SHA)]
    assert _builds(
        {"builds": [{"arch": "amd64", "url": "https://h/x.tgz", "sha256": SHA.upper()}]}
    ) == [Build("x86_64", "https://h/x.tgz", SHA)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"builds": [], "url": "https://h/x"},
            "give 'builds' or 'url' and 'sha256' (with 'arch'), not both",
        ),
        ({"builds": []}, f"'builds' must be a list of 1 to {MAX_BUILDS} builds"),
        ({"builds": {"arch": "x86_64"}}, f"'builds' must be a list of 1 to {MAX_BUILDS} builds"),
        ({"builds": ["https://h/x"]}, 'each build is an object: {"arch", "url", "sha256"}'),
        ({"url": "https://h/x"}, "'sha256' is required for each build"),
        ({"sha256": SHA}, "'url' is required for each build"),
        ({"url": "https://h/x", "sha256": SHA, "arch": 64}, "arch must be a string such as x86_64 or aarch64"),
    ],
)  # fmt: skip
def test_malformed_builds_are_refused(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        _builds(body)
    assert str(info.value) == message


def test_a_build_the_nodes_cannot_use_is_a_config_error_answered_400() -> None:
    with pytest.raises(ConfigError):
        _builds({"url": "s3://bucket/x.tgz", "sha256": SHA})


class _Updates:
    """The signing edge: records what it was asked to sign."""

    def __init__(self) -> None:
        self.orders: list[list[str] | None] = []

    async def order(self, nodes: list[str] | None, **_: object) -> list[dict[str, Any]]:
        self.orders.append(nodes)
        return []


def _order(body: dict[str, Any]) -> tuple[int, dict[str, Any], _Updates]:
    updates = _Updates()
    ctx = cast(
        AdminContext,
        SimpleNamespace(
            bodies=BodyBudget(1 << 20),
            updates=updates,
            admin_token="admin-secret",
            admin_token_file=Path("/s/token"),
        ),
    )
    app = web.Application()
    app.router.add_post("/api/updates", guarded(ctx, SoftwareRoutes(ctx).order_update))

    async def main() -> tuple[int, dict[str, Any]]:
        async with TestClient(TestServer(app)) as client:
            resp = await client.post(
                "/api/updates", json=body, headers={"Authorization": "Bearer admin-secret"}
            )
            return resp.status, await resp.json()

    status, data = asyncio.run(main())
    return status, data, updates


@pytest.mark.parametrize("value", ["false", 0, None], ids=["string-false", "zero", "null"])
def test_an_update_order_reads_all_as_a_json_boolean(value: object) -> None:
    """``"all": "false"`` signed an update for every node."""
    status, data, updates = _order({"version": "0.0.2", "all": value, "password": "pw"})
    assert status == 400, data
    shown = "null" if value is None else json.dumps(value)
    assert data["error"]["message"] == (
        f"'all' must be true or false (a JSON boolean), not {shown}; leave it out for false"
    )
    assert updates.orders == []


def test_an_update_order_for_all_or_for_named_nodes() -> None:
    assert _order({"version": "0.0.2", "all": True})[2].orders == [None]
    assert _order({"version": "0.0.2", "all": False, "nodes": ["gpu-1"]})[2].orders == [["gpu-1"]]
