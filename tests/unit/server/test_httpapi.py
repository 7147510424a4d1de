"""The :8080 conventions: the bearer credential as sent, and JSON errors for what handlers do
not answer themselves."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request
from multidict import CIMultiDict

from llmgw.server.common.httpapi import bearer_token, error_middleware


def _token(header: str | None) -> bytes | None:
    headers = CIMultiDict({"Authorization": header} if header is not None else {})
    return bearer_token(make_mocked_request("GET", "/", headers=headers))


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("Bearer sk-1", b"sk-1"),
        ("bearer sk-1", b"sk-1"),
        ("BEARER   sk-1  ", b"sk-1"),
        ("  Bearer sk-1", b"sk-1"),
        ("Bearer", None),
        ("Bearer ", None),
        ("Basic sk-1", None),
        ("Bearersk-1", None),
        ("", None),
        (None, None),
        # Not ASCII: compared as UTF-8 (the integration tests send bytes that are not UTF-8).
        ("Bearer \xff\xfe", b"\xc3\xbf\xc3\xbe"),
    ],
)
def test_bearer_token(header: str | None, expected: bytes | None) -> None:
    assert _token(header) == expected


def _serve(body: Any) -> None:
    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    async def main() -> None:
        app = web.Application(middlewares=[error_middleware], client_max_size=10)
        app.router.add_get("/boom", boom)
        app.router.add_post("/read", _read)
        app.router.add_get("/own", _own)
        async with TestClient(TestServer(app)) as client:
            await body(client)

    asyncio.run(main())


async def _own(request: web.Request) -> web.Response:
    raise web.HTTPBadRequest(
        text='{"error": {"message": "mine", "code": "own"}}', content_type="application/json"
    )


async def _read(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


def test_aiohttp_refusals_and_bugs_become_json_errors(caplog: pytest.LogCaptureFixture) -> None:
    seen: dict[str, tuple[int, dict[str, Any]]] = {}

    async def body(client: TestClient[Any, Any]) -> None:
        for name, method, path, data in (
            ("404", "GET", "/nope", None),
            ("405", "PUT", "/boom", None),
            ("413", "POST", "/read", b"x" * 100),
            ("500", "GET", "/boom", None),
            ("own", "GET", "/own", None),
        ):
            resp: aiohttp.ClientResponse = await client.request(method, path, data=data)
            seen[name] = (resp.status, await resp.json())

    with caplog.at_level(logging.INFO, logger="llmgw.server.http"):
        _serve(body)
    assert {k: v[0] for k, v in seen.items()} == {
        "404": 404,
        "405": 405,
        "413": 413,
        "500": 500,
        "own": 400,
    }
    # A handler's own JSON error goes out as it is.
    assert seen["own"][1] == {"error": {"message": "mine", "code": "own"}}
    assert seen["404"][1]["error"]["code"] == "not_found"
    assert seen["405"][1]["error"]["code"] == "method_not_allowed"
    assert seen["413"][1]["error"]["code"] == "body_too_large"
    assert "Maximum request body size 10 exceeded" in seen["413"][1]["error"]["message"]
    assert seen["404"][1]["error"]["message"].startswith("GET /nope: Not Found; ")
    error = seen["500"][1]["error"]
    assert error == {
        "message": "the control plane failed on this request; its operator finds why in its log",
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }
    # One line per refusal; the bug (and only the bug) with its traceback, for the operator.
    records = [r for r in caplog.records if r.name == "llmgw.server.http"]
    assert len(records) == 4
    assert [bool(r.exc_info) for r in records] == [False, False, False, True]


def test_a_browser_at_the_root_goes_to_the_console_and_an_api_client_is_told_where_to_go() -> None:
    seen: dict[str, tuple[int, str, str]] = {}

    async def body(client: TestClient[Any, Any]) -> None:
        for name, method, accept in (
            ("browser", "GET", "text/html,application/xhtml+xml,*/*;q=0.8"),
            ("head", "HEAD", "text/html"),
            ("api", "GET", "application/json"),
            ("curl", "GET", "*/*"),
            ("post", "POST", "text/html"),
        ):
            resp = await client.request(
                method, "/", headers={"Accept": accept}, allow_redirects=False
            )
            seen[name] = (resp.status, resp.headers.get("Location", ""), await resp.text())

    _serve(body)
    assert seen["browser"][:2] == (302, "/ui/")
    assert seen["head"][:2] == (302, "/ui/")
    for name in ("api", "curl"):
        status, _, text = seen[name]
        assert status == 404
        message = json.loads(text)["error"]["message"]
        assert "/v1" in message and "/ui/" in message, message
    assert seen["post"][0] == 404  # only a page view is sent to the console
