"""A stream whose event stream was begun while it waited for a replica (a cold start): what
comes after goes into that stream, a refusal or an engine's error as an error event, since
the client has its 200 already."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any, cast

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.http.relay import STARTED_STREAM
from llmgw.server.gateway import refusals
from llmgw.server.gateway.dispatch import in_started_stream
from llmgw.server.gateway.modelrequest import ModelRequest


async def _answer(begin: bool, answer: web.Response) -> tuple[int, str]:
    async def handler(request: web.Request) -> web.StreamResponse:
        if begin:
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            await stream.write(b": waiting for a replica of m to start\n\n")
            request[STARTED_STREAM] = stream
        req = cast(ModelRequest, SimpleNamespace(http=request))
        return await in_started_stream(req, answer)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    async with TestClient(TestServer(app)) as client:
        resp = await client.post("/v1/chat/completions", json={})
        return resp.status, await resp.text()


def test_a_refusal_after_the_stream_began_is_an_error_event_in_it() -> None:
    refusal = refusals.no_room("m", "dm-a: 0 of 1 GPUs free, needs 1", "llmgw ctl")
    status, text = asyncio.run(_answer(True, refusal))
    assert status == 200
    assert text.startswith(": waiting for a replica of m to start\n\n")
    event: dict[str, Any] = json.loads(text.split("data: ", 1)[1])
    assert event["error"]["code"] == "no_capacity"
    assert "none can be placed now: dm-a: 0 of 1 GPUs free" in event["error"]["message"]


def test_without_a_begun_stream_the_refusal_is_sent_as_it_is() -> None:
    refusal = refusals.no_room("m", "no GPUs", "llmgw ctl")
    status, text = asyncio.run(_answer(False, refusal))
    assert status == 503
    assert json.loads(text)["error"]["code"] == "no_capacity"
