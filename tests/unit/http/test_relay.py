"""relay(): an upstream aiohttp app, a front app relaying to it through an UpstreamPool, and a
client, all on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given, settings
from hypothesis import strategies as st
from yarl import URL

from llmgw.http.errors import UpstreamError
from llmgw.http.pool import UpstreamPool
from llmgw.http.relay import UsageChunkDropper, error_event, relay

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("each_loop")]

STEP_S = 5.0  # the longest any one step may wait; only reached when something is broken
JSON_BODY = {"id": "x", "choices": [{"text": "hello " * 200}], "usage": {"completion_tokens": 3}}
SSE_EVENTS = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b'data: {"n":3}\n\n', b"data: [DONE]\n\n"]


@dataclass
class State:
    first_seen: asyncio.Event = field(default_factory=asyncio.Event)
    last_written: asyncio.Event = field(default_factory=asyncio.Event)
    upstream_waited: bool = False
    chunks: list[bytes] = field(default_factory=list)


def upstream_app(state: State) -> web.Application:
    async def json_handler(request: web.Request) -> web.StreamResponse:
        resp = web.Response(
            status=201,
            body=json.dumps(JSON_BODY).encode(),
            content_type="application/json",
            headers={
                "X-Upstream": "yes",
                "Server": "upstream-server/1.0",
                "Keep-Alive": "timeout=99",
            },
        )
        if request.query.get("gzip"):
            resp.enable_compression()  # only when the request accepts gzip
        return resp

    async def sse_handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "X-Upstream": "sse",
                "Server": "upstream-server/1.0",
            },
        )
        await resp.prepare(request)
        await resp.write(SSE_EVENTS[0])
        # Nothing more is written until the client has seen the first event.
        await asyncio.wait_for(state.first_seen.wait(), STEP_S)
        state.upstream_waited = True
        for event in SSE_EVENTS[1:]:
            await asyncio.sleep(0.01)
            # One event in two writes, so that the relay sees partial events too.
            await resp.write(event[:5])
            await asyncio.sleep(0.005)
            await resp.write(event[5:])
        state.last_written.set()
        await resp.write_eof()
        return resp

    async def error_handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "nope"}}, status=429)

    async def broken_handler(request: web.Request) -> web.StreamResponse:
        """One event, then the upstream dies: no end of the chunked body."""
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(SSE_EVENTS[0])
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    app = web.Application()
    app.router.add_get("/json", json_handler)
    app.router.add_get("/sse", sse_handler)
    app.router.add_get("/error", error_handler)
    app.router.add_get("/broken", broken_handler)
    return app


def front_app(upstream_base: str, state: State) -> web.Application:
    """Relays GET /PATH to the upstream, like the gateway and the data plane do."""
    pool: list[UpstreamPool] = []
    base = URL(upstream_base)
    assert base.host is not None and base.port is not None
    host, port = base.host, base.port

    async def on_startup(app: web.Application) -> None:
        pool.append(UpstreamPool())

    async def on_cleanup(app: web.Application) -> None:
        await pool[0].close()

    async def handler(request: web.Request) -> web.StreamResponse:
        target = "/" + request.match_info["tail"]
        if request.query_string:
            target += "?" + request.query_string
        # Passed on so that the upstream compresses: the relay must not undo it.
        accept = request.headers.get("Accept-Encoding")
        upstream = await pool[0].request(
            "GET",
            host,
            port,
            target,
            headers=[("Accept-Encoding", accept)] if accept else [],
        )
        try:
            return await relay(
                request,
                upstream,
                on_chunk=state.chunks.append,
                extra_headers={"X-Relayed-By": "front"},
            )
        except UpstreamError:
            # What the gateway does; the relay has already cut a stream that had begun.
            return web.json_response({"error": {"message": "upstream failed"}}, status=502)
        finally:
            upstream.release()

    app = web.Application()
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_get("/{tail:.*}", handler)
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        await runner.cleanup()


def run(body: Callable[[str, State, aiohttp.ClientSession], Awaitable[None]]) -> None:
    async def main() -> None:
        state = State()
        async with (
            serving(upstream_app(state)) as upstream,
            serving(front_app(upstream, state)) as front,
            aiohttp.ClientSession() as client,
        ):
            await body(front, state, client)

    asyncio.run(main())


def test_json_passes_through() -> None:
    async def body(front: str, state: State, client: aiohttp.ClientSession) -> None:
        async with client.get(front + "json") as resp:
            data = await resp.read()
            assert resp.status == 201
            assert json.loads(data) == JSON_BODY
            assert resp.content_type == "application/json"
            assert resp.headers["X-Upstream"] == "yes"
            assert resp.headers["X-Relayed-By"] == "front"
            # Connection-level headers are the front's own, not the upstream's.
            assert resp.headers.get("Server") != "upstream-server/1.0"
            assert resp.headers.get("Keep-Alive") != "timeout=99"
            assert "Transfer-Encoding" not in resp.headers
            assert int(resp.headers["Content-Length"]) == len(data)
            assert len(resp.headers.getall("Content-Length")) == 1
        assert state.chunks == [data]

    run(body)


def test_error_status_passes_through() -> None:
    async def body(front: str, state: State, client: aiohttp.ClientSession) -> None:
        async with client.get(front + "error") as resp:
            assert resp.status == 429
            assert await resp.json() == {"error": {"message": "nope"}}

    run(body)


def test_compressed_body_without_decompression_stays_readable() -> None:
    async def body(front: str, state: State, client: aiohttp.ClientSession) -> None:
        async with client.get(front + "json?gzip=1", headers={"Accept-Encoding": "gzip"}) as resp:
            data = await resp.read()
            assert resp.status == 201
            # Compressed by the upstream, passed through compressed, undone by this client.
            assert resp.headers["Content-Encoding"] == "gzip"
            assert json.loads(data) == JSON_BODY
            assert resp.headers["X-Upstream"] == "yes"

    run(body)


def test_sse_is_relayed_incrementally() -> None:
    async def body(front: str, state: State, client: aiohttp.ClientSession) -> None:
        async with client.get(front + "sse") as resp:
            assert resp.status == 200
            assert resp.content_type == "text/event-stream"
            assert resp.headers["X-Upstream"] == "sse"
            assert resp.headers["X-Relayed-By"] == "front"
            assert resp.headers["Cache-Control"] == "no-cache"
            assert resp.headers["X-Accel-Buffering"] == "no"
            assert resp.headers.get("Server") != "upstream-server/1.0"
            assert "Content-Length" not in resp.headers
            assert len(resp.headers.getall("Transfer-Encoding", [])) <= 1

            received = b""
            while b"\n\n" not in received:
                piece = await asyncio.wait_for(resp.content.readany(), STEP_S)
                assert piece, "stream ended before the first event"
                received += piece
            # The first event arrived while the upstream was still holding the rest back.
            assert received == SSE_EVENTS[0]
            assert not state.upstream_waited
            assert not state.last_written.is_set()
            state.first_seen.set()

            received += await asyncio.wait_for(resp.content.read(), STEP_S)
            assert received == b"".join(SSE_EVENTS)
            assert state.upstream_waited and state.last_written.is_set()
        assert b"".join(state.chunks) == b"".join(SSE_EVENTS)
        assert len(state.chunks) >= 2

    run(body)


def test_upstream_dying_mid_stream_ends_the_client_stream_with_an_error_event() -> None:
    async def body(front: str, state: State, client: aiohttp.ClientSession) -> None:
        async with client.get(front + "broken") as resp:
            assert resp.status == 200
            # What came before the failure, then an error event and a proper end of the body
            # (no error response inside the stream, no cut connection).
            received = await asyncio.wait_for(resp.content.read(), STEP_S)
        assert received.startswith(SSE_EVENTS[0] + b"\n\ndata: ")
        assert received.endswith(b"\n\n")
        error = json.loads(received[len(SSE_EVENTS[0]) + 8 :])["error"]
        assert error["type"] == "server_error"
        assert error["code"] == "upstream_error"
        assert error["message"].startswith("the stream ended early: ")
        assert "closed the connection" in error["message"]

    run(body)


def test_error_event_is_one_event_after_any_partial_one() -> None:
    event = error_event("stalled", code="upstream_timeout")
    # After a partial event, the leading blank line ends it; the error is its own event.
    events = (b'data: {"partial' + event).split(b"\n\n")
    assert events[0] == b'data: {"partial'
    payload = json.loads(events[1].removeprefix(b"data: "))
    assert payload == {
        "error": {
            "message": "stalled",
            "type": "server_error",
            "param": None,
            "code": "upstream_timeout",
        }
    }


# --------------------------------------------------------------------------- the usage chunk

_CHUNK = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"%s"}}],"usage":null}\n\n'
_USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
_STREAM = [*(_CHUNK % w for w in (b"a", b"b", b"c")), _USAGE, b"data: [DONE]\n\n"]


def _dropped(pieces: list[bytes]) -> tuple[bytes, list[bytes]]:
    dropper = UsageChunkDropper()
    sent = [dropper.feed(p) for p in pieces]
    return b"".join(sent) + dropper.end(), sent


def test_the_usage_chunk_is_dropped_and_nothing_else() -> None:
    whole = b"".join(_STREAM)
    assert _dropped([whole])[0] == whole.replace(_USAGE, b"")
    # Chunks that end events go on as they came, each at once.
    _, sent = _dropped(_STREAM)
    assert sent == [*_STREAM[:3], b"", _STREAM[4]]
    # A chunk whose choices are not empty keeps its usage (llama.cpp's last chunk).
    last = b'data: {"choices":[{"delta":{},"finish_reason":"stop"}],"usage":{"a":1}}\n\n'
    assert _dropped([last, _USAGE, b"data: [DONE]\n\n"])[0] == last + b"data: [DONE]\n\n"
    # Only the first usage chunk: a client's own would never be dropped (it is not asked).
    assert _dropped([_USAGE, _USAGE])[0] == _USAGE
    # CRLF line ends: the same events, LF.
    crlf = whole.replace(b"\n", b"\r\n")
    assert _dropped([crlf[:7], crlf[7:]])[0] == whole.replace(_USAGE, b"")


def test_the_usage_chunk_may_be_rewritten_instead_of_dropped() -> None:
    def cached(usage: dict[str, object]) -> None:
        usage["prompt_tokens_details"] = {"cached_tokens": 4}

    rewritten = (
        b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3,'
        b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    )
    whole = b"".join(_STREAM)
    for pieces in ([whole], _STREAM, [whole[:150], whole[150:]]):
        dropper = UsageChunkDropper(rewrite=cached)
        sent = b"".join(dropper.feed(p) for p in pieces) + dropper.end()
        assert sent == whole.replace(_USAGE, rewritten)


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=30))
def test_any_chunking_drops_the_same_and_holds_only_an_unfinished_event(cuts: list[int]) -> None:
    whole = b"".join(_STREAM)
    points = sorted({0, len(whole), *(min(c, len(whole)) for c in cuts)})
    pieces = [whole[a:b] for a, b in itertools.pairwise(points)]
    dropper = UsageChunkDropper()
    expected = whole.replace(_USAGE, b"")
    fed = sent = b""
    for piece in pieces:
        fed += piece
        sent += dropper.feed(piece)
        # Every event complete in what came is sent (but the usage chunk), nothing more;
        # once it is dropped, every byte as it comes.
        complete = fed[: fed.rfind(b"\n\n") + 2] if b"\n\n" in fed else b""
        assert sent == (fed if dropper.dropped else complete).replace(_USAGE, b"")
    assert sent + dropper.end() == expected
