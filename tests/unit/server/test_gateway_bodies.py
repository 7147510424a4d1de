"""The gateway against hostile clients and a hostile engine, on real sockets.

The gateway runs in-process with a stand-in control plane; a hostile "data plane" (an
aiohttp app on 127.0.0.1, plain HTTP) answers each model in its own bad way: CR-ended lines
that never end an event, a huge answer, silence. Requests whose bodies are over their limit,
chunked or not, and more body bytes in flight than the budget allows, come from raw sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from llmgw import bodies
from llmgw.bodies import MAX_BODY_HEADER, BodyBudget
from llmgw.http.relay import NOT_PROCESSED
from llmgw.server.common.config import load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.gateway import Gateway, GatewaySettings
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.usage import MAX_SSE_EVENT
from llmgw.server.store.rows import ApiKey
from tests.unit.gateway_rig import serving_of
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(60)

KEY = "sk-test"
MIB = 1024 * 1024
STEP_S = 10.0  # the longest any one step may wait; only reached when something is broken
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class Engine:
    """What the hostile engine saw."""

    port: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # model -> requests received
    seen: list[dict[str, Any]] = field(default_factory=list)  # the 'ok' model's requests
    written: dict[str, int] = field(default_factory=dict)  # model -> bytes it got to write
    gone: dict[str, asyncio.Event] = field(default_factory=dict)  # model -> gateway hung up

    def went(self, model: str) -> asyncio.Event:
        return self.gone.setdefault(model, asyncio.Event())


def engine_app(engine: Engine) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        model = request.match_info["shard"]
        engine.requests[model] = engine.requests.get(model, 0) + 1
        body = await request.read()
        try:
            return await {**BEHAVIOURS, **SHARDS}[model](request, body, engine, model)
        except (asyncio.CancelledError, ConnectionError):
            engine.went(model).set()
            raise

    app = web.Application(client_max_size=64 * MIB)
    app.router.add_post("/s/{shard}/v1/chat/completions", handle)
    return app


async def ok(request: web.Request, body: bytes, engine: Engine, model: str) -> web.Response:
    engine.seen.append(
        {"model": model, "bytes": len(body), "max_body": request.headers.get(MAX_BODY_HEADER)}
    )
    return web.json_response(
        {
            "id": "c",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


async def sse_head(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


async def cr_lines(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    """16 MiB of CR-ended lines, never a blank line."""
    resp = await sse_head(request)
    piece = b"data: x\r" * 8192  # 64 KiB
    for _ in range(256):
        await resp.write(piece)
        engine.written[model] = engine.written.get(model, 0) + len(piece)
    await resp.write_eof()
    return resp


async def stall(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    await asyncio.sleep(3600)


async def stall_stream(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    resp = await sse_head(request)
    event = {"choices": [{"index": 0, "delta": {"content": "a"}}]}
    await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
    await asyncio.sleep(3600)


async def huge(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    """Says 1 GiB is coming, sends a little, then holds."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = 1024**3
    await resp.prepare(request)
    await resp.write(b'{"choices": [')
    await asyncio.sleep(3600)


async def huge_chunked(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    """A chunked answer that never ends."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    piece = b" " * 65536
    for _ in range(16 * 1024):  # 1 GiB unless stopped
        await resp.write(piece)
        engine.written[model] = engine.written.get(model, 0) + len(piece)
    return resp


async def busy(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    """What the data plane answers when its body budget is spent."""
    return web.json_response(
        {"error": {"message": "no room", "code": "overloaded"}},
        status=503,
        headers={NOT_PROCESSED: "1", "Retry-After": "1"},
    )


async def draining(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    return web.json_response(
        {"error": {"message": "shutting down", "code": "draining"}},
        status=503,
        headers={NOT_PROCESSED: "1"},
    )


async def engine_gone(request: web.Request, body: bytes, engine: Engine, model: str) -> Any:
    """What the data plane answers when its engine refused the connection (stopping)."""
    return web.json_response(
        {"error": {"message": "engine did not answer", "code": "engine_unreachable"}},
        status=502,
        headers={NOT_PROCESSED: "1"},
    )


BEHAVIOURS: dict[str, Callable[[web.Request, bytes, Engine, str], Awaitable[Any]]] = {
    "ok": ok,
    "ok-big": ok,
    "cr-lines": cr_lines,
    "stall": stall,
    "stall-stream": stall_stream,
    "huge": huge,
    "huge-chunked": huge_chunked,
    "busy": busy,
    "draining": draining,
    "engine-gone": engine_gone,
}
# Shards of the model "pair" (test_a_replica_whose_engine_is_stopping_is_passed_over), which
# are not models of their own.
SHARDS = {"pair-gone": engine_gone, "pair-ok": ok}


def control_plane(port: int, **cfg_changes: Any) -> Any:
    cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0, **cfg_changes)
    router = Router()
    for model in BEHAVIOURS:
        router.set_ready(Endpoint(model, f"r-{model}", model, "engine", f"127.0.0.1:{port}"))
    key = ApiKey("k1", "test", KEY, hashlib.sha256(KEY.encode()).hexdigest(), 0.0, None)
    models = [
        ServedModel(m, "sim", ("generate",), frozenset({"/v1/chat/completions"}), 64, None)
        for m in BEHAVIOURS
    ]
    return SimpleNamespace(
        cfg=cfg,
        serving=serving_of(cfg, [key], models),
        bodies=BodyBudget(cfg.max_inflight_body_bytes),
        router=router,
        metrics=Metrics(),
    )


@dataclass
class Rig:
    cp: Any
    engine: Engine
    url: str
    port: int
    client: aiohttp.ClientSession


def run(body: Callable[[Rig], Awaitable[None]], **cfg_changes: Any) -> None:
    async def main() -> None:
        engine = Engine()
        async with serving(engine_app(engine)) as engine_port:
            engine.port = engine_port
            cp = control_plane(engine_port, **cfg_changes)
            gateway = Gateway(
                cp.router,
                cp.metrics,
                cp.serving,
                cp.bodies,
                GatewaySettings.of(cp.cfg),
                revoked=set,
                client_ssl=lambda: None,  # plain HTTP to the stand-in data plane
                nodes_connected=lambda: 0,
                epoch=1,
                started_at=time.time(),
            )
            app = web.Application(client_max_size=MIB)
            gateway.add_routes(app)
            app.on_cleanup.append(lambda _app: gateway.close())
            async with serving(app) as port, aiohttp.ClientSession() as client:
                await body(Rig(cp, engine, f"http://127.0.0.1:{port}", port, client))

    asyncio.run(main())


def chat(model: str, size: int = 0, **extra: Any) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x" * size}], **extra}
    ).encode()


async def post(rig: Rig, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with rig.client.post(rig.url + "/v1/chat/completions", data=body, headers=AUTH) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


async def served_meanwhile(rig: Rig, n: int = 5) -> float:
    """Send ``n`` ordinary requests one after another; the slowest one's seconds."""
    slowest = 0.0
    for _ in range(n):
        started = time.perf_counter()
        status, _, _ = await asyncio.wait_for(post(rig, chat("ok")), STEP_S)
        assert status == 200
        slowest = max(slowest, time.perf_counter() - started)
    return slowest


# --------------------------------------------------------------------------- hostile engine


def test_cr_lines_without_a_blank_line_end_the_stream_with_an_error_event() -> None:
    async def body(rig: Rig) -> None:
        started = time.perf_counter()
        async with rig.client.post(
            rig.url + "/v1/chat/completions", data=chat("cr-lines", stream=True), headers=AUTH
        ) as resp:
            assert resp.status == 200
            received = await asyncio.wait_for(resp.read(), STEP_S)
        # Ended by the gateway past the bound, not after the engine's 16 MiB; generous bound.
        assert time.perf_counter() - started < STEP_S
        assert len(received) < MAX_SSE_EVENT + 512 * 1024
        tail = received[received.rindex(b"\n\ndata: ") + 8 :]
        error = json.loads(tail)["error"]
        assert error["code"] == "upstream_error"
        assert "without ending an event" in error["message"]
        await asyncio.wait_for(rig.engine.went("cr-lines").wait(), STEP_S)
        assert rig.engine.written.get("cr-lines", 0) < 16 * MIB
        assert await served_meanwhile(rig) < STEP_S
        assert rig.cp.metrics.requests.values[("cr-lines", "r-cr-lines", "502")] == 1

    run(body)


def test_a_silent_engine_gets_502_and_others_are_served_meanwhile() -> None:
    async def body(rig: Rig) -> None:
        stalled = asyncio.create_task(post(rig, chat("stall")))
        await asyncio.sleep(0.2)
        assert not stalled.done()
        await served_meanwhile(rig)  # the gateway answers others while one waits
        status, answer, _ = await asyncio.wait_for(stalled, STEP_S)
        assert status == 502
        assert answer["error"]["code"] == "upstream_timeout"
        assert answer["error"]["type"] == "server_error"
        assert "sent nothing for 1 s" in answer["error"]["message"]
        assert "upstream_idle_timeout" in answer["error"]["message"]
        await asyncio.wait_for(rig.engine.went("stall").wait(), STEP_S)

    run(body, upstream_idle_timeout=1.0)


def test_a_stream_that_goes_silent_ends_with_an_error_openai_clients_raise() -> None:
    async def body(rig: Rig) -> None:
        client = openai.AsyncOpenAI(base_url=rig.url + "/v1", api_key=KEY, max_retries=0)
        got: list[str] = []
        with pytest.raises(openai.APIError, match="the stream ended early"):
            stream = await client.chat.completions.create(
                model="stall-stream", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content or "")
        assert got == ["a"]
        await client.close()
        await asyncio.wait_for(rig.engine.went("stall-stream").wait(), STEP_S)

    run(body, upstream_idle_timeout=1.0)


def test_an_answer_over_max_response_body_by_its_length_is_502_at_once() -> None:
    async def body(rig: Rig) -> None:
        started = time.perf_counter()
        status, answer, _ = await asyncio.wait_for(post(rig, chat("huge")), STEP_S)
        assert time.perf_counter() - started < 5.0  # not the idle timeout: at once
        assert status == 502
        assert "1073741824 bytes" in answer["error"]["message"]
        assert "max_response_body" in answer["error"]["message"]
        await asyncio.wait_for(rig.engine.went("huge").wait(), STEP_S)

    run(body, max_response_body=MIB)


def test_an_endless_chunked_answer_is_cut_past_max_response_body() -> None:
    async def body(rig: Rig) -> None:
        status, answer, _ = await asyncio.wait_for(post(rig, chat("huge-chunked")), STEP_S)
        assert status == 502
        assert "over 1048576 bytes" in answer["error"]["message"]
        await asyncio.wait_for(rig.engine.went("huge-chunked").wait(), STEP_S)
        # Socket buffers hold a few MiB more at most; the engine meant to send 1 GiB.
        assert rig.engine.written["huge-chunked"] < 64 * MIB
        await served_meanwhile(rig)

    run(body, max_response_body=MIB)


# --------------------------------------------------------------------------- hostile clients


async def raw_exchange(
    port: int, head: bytes, pieces: list[bytes]
) -> tuple[int, dict[str, str], bytes]:
    """Send a request by hand (``pieces`` after the head, stopping early if the answer
    comes first); the answer's status, headers and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        answer = asyncio.create_task(reader.readuntil(b"\r\n\r\n"))
        for piece in pieces:
            if answer.done():
                break
            writer.write(piece)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
        raw_head = await asyncio.wait_for(answer, STEP_S)
        lines = raw_head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        data = await asyncio.wait_for(
            reader.readexactly(int(headers.get("content-length", "0"))), STEP_S
        )
        return status, headers, data
    finally:
        writer.close()


async def settle(done: Callable[[], bool]) -> None:
    """Poll ``done`` (state the gateway changes on this same loop) for up to STEP_S."""
    for _ in range(int(STEP_S / 0.01)):
        if done():
            return
        await asyncio.sleep(0.01)


def request_head(port: int, extra: str) -> bytes:
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n{extra}\r\n"
    ).encode()


def test_a_body_declared_over_the_limit_gets_413_before_it_is_sent() -> None:
    async def body(rig: Rig) -> None:
        head = request_head(rig.port, f"Content-Length: {1024**3}\r\n")
        # Only 64 KiB of the 1 GiB are ever sent: the answer comes first.
        status, _, data = await raw_exchange(rig.port, head, [b" " * 65536])
        assert status == 413
        error = json.loads(data)["error"]
        assert error["code"] == "request_too_large"
        assert error["type"] == "invalid_request_error"
        assert "1073741824 bytes" in error["message"]
        assert "takes at most 1 MiB" in error["message"]
        assert "max_request_body in server.yaml" in error["message"]
        assert rig.engine.requests == {}
        assert rig.cp.bodies.used == 0

    run(body, max_request_body=MIB)


def test_a_chunked_body_is_counted_and_refused_past_the_limit() -> None:
    async def body(rig: Rig) -> None:
        head = request_head(rig.port, "Transfer-Encoding: chunked\r\n")
        piece = b"10000\r\n" + b" " * 65536 + b"\r\n"
        status, _, data = await raw_exchange(rig.port, head, [piece] * 64)  # 4 MiB
        assert status == 413
        message = json.loads(data)["error"]["message"]
        assert "more than 1 MiB" in message
        assert rig.engine.requests == {}
        assert rig.cp.bodies.used == 0

    run(body, max_request_body=MIB)


def test_a_profile_raises_the_limit_for_its_model_and_the_data_plane_is_told() -> None:
    async def body(rig: Rig) -> None:
        rig.cp.serving.body_limits = {"ok-big": 3 * MIB}
        rig.cp.serving.largest_body_limit = 3 * MIB
        status, answer, _ = await post(rig, chat("ok", 2 * MIB))
        assert status == 413
        message = answer["error"]["message"]
        assert "model 'ok' takes at most 1 MiB" in message
        assert "max_request_body in server.yaml" in message
        assert rig.engine.seen == []

        big = chat("ok-big", 2 * MIB)
        status, answer, _ = await post(rig, big)
        assert status == 200, answer
        assert rig.engine.seen == [{"model": "ok-big", "bytes": len(big), "max_body": str(3 * MIB)}]
        status, answer, _ = await post(rig, chat("ok-big", 4 * MIB))
        assert status == 413
        assert "no model on this gateway takes more than 3 MiB" in answer["error"]["message"]
        # Another model's profile takes 5 MiB: 4 MiB is read, then held to ok-big's own.
        rig.cp.serving.body_limits["other"] = 5 * MIB
        rig.cp.serving.largest_body_limit = 5 * MIB
        status, answer, _ = await post(rig, chat("ok-big", 4 * MIB))
        assert status == 413, answer
        assert "model 'ok-big' takes at most 3 MiB" in answer["error"]["message"]
        assert "its catalog profile's max_request_body" in answer["error"]["message"]
        assert len(rig.engine.seen) == 1
        assert rig.cp.bodies.used == 0

    run(body, max_request_body=MIB)


def test_bodies_in_flight_over_the_budget_get_503_with_retry_after() -> None:
    async def body(rig: Rig) -> None:
        full = chat("ok", MIB - 128)
        size = len(full)
        head = request_head(rig.port, f"Content-Length: {size}\r\n")
        held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        for _ in range(2):  # two clients send all but the last 10 bytes, and wait
            reader, writer = await asyncio.open_connection("127.0.0.1", rig.port)
            writer.write(head + full[:-10])
            await writer.drain()
            held.append((reader, writer))
        # A declared length is charged whole as the body starts, before it is all in.
        await settle(lambda: rig.cp.bodies.used >= 2 * size)
        assert rig.cp.bodies.used == 2 * size

        status, answer, headers = await post(rig, chat("ok", 100_000))
        assert status == 503
        assert headers["Retry-After"] == "1"
        assert answer["error"]["code"] == "overloaded"
        assert "max_inflight_body_bytes" in answer["error"]["message"]

        for reader, writer in held:  # the two held ones finish and are served
            writer.write(full[-10:])
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), STEP_S)
            assert line.startswith(b"HTTP/1.1 200"), line
            writer.close()
        await settle(lambda: rig.cp.bodies.used == 0)
        assert rig.cp.bodies.used == 0
        status, _, _ = await post(rig, chat("ok", 100_000))
        assert status == 200

    run(body, max_request_body=MIB, max_inflight_body_bytes=2 * MIB)


def test_a_body_cut_short_is_given_back_to_the_budget() -> None:
    async def body(rig: Rig) -> None:
        _, writer = await asyncio.open_connection("127.0.0.1", rig.port)
        writer.write(request_head(rig.port, "Content-Length: 500000\r\n") + b" " * 200_000)
        await writer.drain()
        await settle(lambda: rig.cp.bodies.used >= 500_000)
        assert rig.cp.bodies.used == 500_000
        writer.close()
        await settle(lambda: rig.cp.bodies.used == 0)
        assert rig.cp.bodies.used == 0
        assert rig.engine.requests == {}

    run(body)


def test_a_chunked_body_is_charged_as_it_arrives_and_refused_when_the_budget_runs_out() -> None:
    async def body(rig: Rig) -> None:
        held = chat("ok", 700 * 1024)
        writers = []
        for _ in range(2):  # 2 x ~700 KiB declared and charged, of a 2 MiB budget
            _, writer = await asyncio.open_connection("127.0.0.1", rig.port)
            writer.write(request_head(rig.port, f"Content-Length: {len(held)}\r\n"))
            await writer.drain()
            writers.append(writer)
        await settle(lambda: rig.cp.bodies.used >= 2 * len(held))
        assert rig.cp.bodies.used == 2 * len(held)

        # 800 KiB chunked is under the 1 MiB limit, but only ~600 KiB of budget is left.
        head = request_head(rig.port, "Transfer-Encoding: chunked\r\n")
        piece = b"4000\r\n" + b" " * 0x4000 + b"\r\n"  # 16 KiB
        status, headers, data = await raw_exchange(rig.port, head, [piece] * 50)
        assert status == 503
        assert headers["retry-after"] == "1"
        assert json.loads(data)["error"]["code"] == "overloaded"
        assert rig.cp.bodies.used == 2 * len(held)  # what it took was given back
        for writer in writers:
            writer.close()
        await settle(lambda: rig.cp.bodies.used == 0)
        assert rig.cp.bodies.used == 0

    run(body, max_request_body=MIB, max_inflight_body_bytes=2 * MIB)


def test_replicas_with_no_room_for_the_body_make_a_503_with_retry_after() -> None:
    async def body(rig: Rig) -> None:
        status, answer, headers = await post(rig, chat("busy"))
        assert status == 503
        assert headers["Retry-After"] == "1"
        assert answer["error"]["code"] == "overloaded"
        assert "max_inflight_body_bytes in agent.yaml" in answer["error"]["message"]
        # A draining agent is not a busy one: no replica answered.
        status, answer, _ = await post(rig, chat("draining"))
        assert status == 502
        assert answer["error"]["code"] == "upstream_unavailable"

    run(body)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_that_trickles_in_is_408_and_its_budget_given_back(
    monkeypatch: pytest.MonkeyPatch, chunked: bool
) -> None:
    monkeypatch.setattr(bodies, "BODY_TIME_BASE", 0.5)
    monkeypatch.setattr(bodies, "BODY_MIN_RATE", 1024**4)  # the size adds nothing here

    async def body(rig: Rig) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", rig.port)
        framing = "Transfer-Encoding: chunked" if chunked else "Content-Length: 100000"
        first = b"a\r\n" + b" " * 10 + b"\r\n" if chunked else b" " * 10
        started = time.perf_counter()
        writer.write(request_head(rig.port, framing + "\r\n") + first)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), STEP_S)
        assert line.startswith(b"HTTP/1.1 408"), line
        assert time.perf_counter() - started >= 0.4
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        error = json.loads(await reader.readexactly(length))["error"]
        assert error["code"] == "body_timeout"
        assert error["message"].startswith("The request body did not arrive within 0.5 s (0.5 s")
        assert error["message"].endswith("KiB/s); send it faster.")  # case kept
        writer.close()
        assert rig.cp.bodies.used == 0
        assert rig.engine.requests == {}

    run(body)


def test_a_replica_whose_engine_is_stopping_is_passed_over() -> None:
    # Scaled down while a gateway (a standby's, following the database) still routes to
    # it: nothing reached the engine, so the request goes to the other replica.
    async def body(rig: Rig) -> None:
        addr = f"127.0.0.1:{rig.engine.port}"
        rig.cp.router.set_ready(Endpoint("pair", "r-gone", "pair-gone", "engine", addr))
        rig.cp.router.set_ready(Endpoint("pair", "r-ok", "pair-ok", "engine", addr))
        rig.cp.serving.models["pair"] = rig.cp.serving.models["ok"]
        for _ in range(6):
            status, _, _ = await post(rig, chat("pair"))
            assert status == 200
        status, answer, _ = await post(rig, chat("engine-gone"))
        assert status == 502
        assert answer["error"]["code"] == "upstream_unavailable"
        assert "No replica of 'engine-gone' answered (1 tried)" in answer["error"]["message"]

    run(body)
