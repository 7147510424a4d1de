"""The data plane's body limits and engine timeouts, on real sockets.

TLS and the control-plane certificate check are covered by the mTLS integration tests; here
the data plane listens in plain HTTP with its peer check stubbed, in front of an engine
stand-in on 127.0.0.1 that answers, or stays silent.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.dataplane import DataPlane
from llmgw.bodies import MAX_BODY_HEADER
from llmgw.http.relay import ENGINE_FAILED, NOT_PROCESSED
from tests.unit.serving import serving

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("each_loop")]

KIB = 1024
STEP_S = 10.0  # the longest any one step may wait; only reached when something is broken


@dataclass
class Engine:
    port: int = 0
    seen: list[int] = field(default_factory=list)  # body sizes that reached the engine
    gone: asyncio.Event = field(default_factory=asyncio.Event)


def engine_app(engine: Engine) -> web.Application:
    async def ok(request: web.Request) -> web.Response:
        engine.seen.append(len(await request.read()))
        return web.json_response({"ok": True})

    async def stall(request: web.Request) -> web.Response:
        await request.read()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            engine.gone.set()
            raise
        return web.json_response({})

    async def dies(request: web.Request) -> web.StreamResponse:
        # Killed mid-answer: part of a body whose length says more, then the connection gone.
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 100
        await resp.prepare(request)
        await resp.write(b'{"choices": [')
        assert request.transport is not None
        request.transport.abort()
        return resp

    app = web.Application(client_max_size=64 * 1024 * KIB)
    app.router.add_post("/v1/ok", ok)
    app.router.add_post("/v1/dies", dies)
    app.router.add_post("/v1/stall", stall)
    return app


@dataclass
class Rig:
    dp: DataPlane
    engine: Engine
    url: str
    client: aiohttp.ClientSession

    async def post(
        self, path: str, data: Any, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        async with self.client.post(self.url + path, data=data, headers=headers) as resp:
            return resp.status, await resp.json(), dict(resp.headers)


def run(body: Callable[[Rig], Awaitable[None]], **limits: Any) -> None:
    async def main() -> None:
        engine = Engine()
        async with serving(engine_app(engine)) as port:
            engine.port = port
            dp = DataPlane(
                "127.0.0.1:0",
                None,  # type: ignore[arg-type]  # plain HTTP for this test
                lambda shard: port if shard == "s1" else None,
                **limits,
            )
            dp._peer_refusal = lambda request: None  # type: ignore[method-assign]
            await dp.start()
            try:
                async with aiohttp.ClientSession() as client:
                    url = f"http://127.0.0.1:{dp.bound_port}/s/s1"
                    await body(Rig(dp, engine, url, client))
            finally:
                await dp.stop()

    asyncio.run(main())


def test_agent_yaml_limit_applies_when_the_gateway_names_none() -> None:
    async def body(rig: Rig) -> None:
        status, _, _ = await rig.post("/v1/ok", b"x" * (60 * KIB))
        assert status == 200
        status, answer, _ = await rig.post("/v1/ok", b"x" * (100 * KIB))
        assert status == 413
        assert answer["error"]["code"] == "request_too_large"
        message = answer["error"]["message"]
        assert "102400 bytes; the limit is 64 KiB" in message
        assert "max_request_body in the model's catalog profile" in message
        assert rig.engine.seen == [60 * KIB]
        assert rig.dp.bodies.used == 0

    run(body, max_request_body=64 * KIB)


def test_the_gateways_limit_for_the_model_raises_it() -> None:
    async def body(rig: Rig) -> None:
        raised = {MAX_BODY_HEADER: str(200 * KIB)}
        status, _, _ = await rig.post("/v1/ok", b"x" * (100 * KIB), raised)
        assert status == 200
        status, answer, _ = await rig.post("/v1/ok", b"x" * (300 * KIB), raised)
        assert status == 413
        assert "the limit is 200 KiB" in answer["error"]["message"]
        # A value that is not a number is ignored: agent.yaml's limit holds.
        for bogus in ("lots", "-1", "1e9", " 9"):
            status, _, _ = await rig.post("/v1/ok", b"x" * (100 * KIB), {MAX_BODY_HEADER: bogus})
            assert status == 413, bogus
        # Never more than the whole budget.
        huge = {MAX_BODY_HEADER: str(10**11)}
        status, answer, _ = await rig.post("/v1/ok", b"x" * (600 * KIB), huge)
        assert status == 413
        assert "the limit is 512 KiB" in answer["error"]["message"]
        assert rig.engine.seen == [100 * KIB]

    run(body, max_request_body=64 * KIB, max_inflight_body_bytes=512 * KIB)


def test_a_chunked_body_is_counted() -> None:
    async def body(rig: Rig) -> None:
        async def pieces() -> AsyncIterator[bytes]:
            for _ in range(8):
                yield b"y" * (16 * KIB)

        status, answer, _ = await rig.post("/v1/ok", pieces())
        assert status == 413
        assert "over the limit of 64 KiB" in answer["error"]["message"]
        assert rig.engine.seen == []
        assert rig.dp.bodies.used == 0

    run(body, max_request_body=64 * KIB)


def test_over_the_budget_is_503_not_processed_so_the_gateway_tries_another_replica() -> None:
    async def body(rig: Rig) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", rig.dp.bound_port)
        size = 100 * KIB
        writer.write(
            f"POST /s/s1/v1/ok HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode()
            + b"z" * (size - 1)
        )
        await writer.drain()
        for _ in range(int(STEP_S / 0.01)):
            if rig.dp.bodies.used == size:
                break
            await asyncio.sleep(0.01)
        assert rig.dp.bodies.used == size  # its declared length, charged as it starts

        status, answer, headers = await rig.post("/v1/ok", b"x" * (50 * KIB))
        assert status == 503
        assert headers[NOT_PROCESSED] == "1"
        assert headers["Retry-After"] == "1"
        assert answer["error"]["code"] == "overloaded"
        assert "max_inflight_body_bytes" in answer["error"]["message"]

        writer.write(b"z")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), STEP_S)
        assert line.startswith(b"HTTP/1.1 200"), line
        writer.close()
        assert rig.engine.seen == [size]
        status, _, _ = await rig.post("/v1/ok", b"x" * (50 * KIB))
        assert status == 200

    run(body, max_request_body=100 * KIB, max_inflight_body_bytes=128 * KIB)


def test_a_silent_engine_is_502_after_the_idle_timeout() -> None:
    async def body(rig: Rig) -> None:
        status, answer, headers = await asyncio.wait_for(rig.post("/v1/stall", b"{}"), STEP_S)
        assert status == 502
        assert answer["error"]["code"] == "engine_unreachable"
        assert "sent nothing for 0.5 s" in answer["error"]["message"]
        assert headers[ENGINE_FAILED] == "timeout"  # the gateway may ask another replica
        assert NOT_PROCESSED not in headers  # the engine did take it
        await asyncio.wait_for(rig.engine.gone.wait(), STEP_S)
        assert json.dumps(answer)  # an ordinary JSON error, not a traceback

    run(body, upstream_idle_timeout=0.5)


def test_an_engine_that_dies_mid_answer_is_502_saying_so() -> None:
    async def body(rig: Rig) -> None:
        status, answer, headers = await rig.post("/v1/dies", b"{}")
        assert status == 502
        assert answer["error"]["code"] == "engine_unreachable"
        assert headers[ENGINE_FAILED] == "reset"
        assert NOT_PROCESSED not in headers

    run(body)


def test_an_engine_that_refuses_the_connection_is_502_not_processed() -> None:
    # A stopping engine (its replica scaled down, the gateway not told yet): nothing reached
    # it, so the gateway may send the request to another replica.
    async def body(rig: Rig) -> None:
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
        free.close()  # nothing listens there now
        rig.dp.port_of = lambda shard: port
        status, answer, headers = await rig.post("/v1/ok", b"{}")
        assert status == 502
        assert answer["error"]["code"] == "engine_unreachable"
        assert headers.get(NOT_PROCESSED) == "1"
        assert ENGINE_FAILED not in headers
        assert rig.engine.seen == []

    run(body)


def test_only_shard_paths_are_served_and_expect_100_continue_is_answered() -> None:
    # The data plane's one route, /s/<shard>/<anything> for any method, as the Application's
    # router served it: other paths are not found, and a client that asks to be told before
    # it sends its body (curl does, for large ones) is told.
    async def body(rig: Rig) -> None:
        root = rig.url.removesuffix("/s/s1")
        for path in ("/", "/s/s1", "/s", "/s//v1/ok", "/x/s1/v1/ok"):
            async with rig.client.post(root + path, data=b"{}") as resp:
                assert (resp.status, await resp.text()) == (404, "404: Not Found"), path
        async with rig.client.post(root + "/s/nope/v1/ok", data=b"{}") as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "shard_not_ready"
        host, port = root.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(
                b"POST /s/s1/v1/ok HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                b"Expect: 100-continue\r\n\r\n"
            )
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), STEP_S)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(b"{}")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), STEP_S)
            assert head.startswith(b"HTTP/1.1 200 ")
        finally:
            writer.close()
        assert rig.engine.seen == [2]

    run(body)
