"""UpstreamPool (with its connections and responses) on real sockets: an aiohttp server for
the common paths, a raw asyncio server for the edge cases (odd splits, HTTP/1.0, closes at
awkward moments, malformed answers), TLS with a certificate from llmgw.pki, and the
connection's parser fed every split of a response in memory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509

from llmgw import pki
from llmgw.http.connection import UpstreamConnection
from llmgw.http.errors import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from llmgw.http.pool import UpstreamPool
from llmgw.http.response import UpstreamResponse

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("each_loop")]

STEP_S = 5.0  # the longest any one step may wait; only reached when something is broken
HOST = "127.0.0.1"
JSON = (("Content-Type", "application/json"),)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())


# --------------------------------------------------------------------------- an aiohttp server


@dataclass
class AppState:
    peers: set[tuple[str, int]] = field(default_factory=set)  # one per client connection
    first_sent: asyncio.Event = field(default_factory=asyncio.Event)
    go_on: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


def aiohttp_app(state: AppState) -> web.Application:
    @web.middleware
    async def count_peers(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        assert request.transport is not None
        state.peers.add(request.transport.get_extra_info("peername"))
        return await handler(request)

    async def echo(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        return web.json_response(
            {
                "method": request.method,
                "path": request.raw_path,
                "body": body.decode(),
                "content_type": request.headers.get("Content-Type"),
                "host": request.headers.get("Host"),
            },
            headers={"X-Twice": "a"},
        )

    async def chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for i in range(5):
            await resp.write(f"part {i};".encode())
        await resp.write_eof()
        return resp

    async def stream(request: web.Request) -> web.StreamResponse:
        """One event, then nothing until the test says so (or the client goes away)."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        state.first_sent.set()
        try:
            await state.go_on.wait()
        except asyncio.CancelledError:
            state.cancelled.set()
            raise
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    async def slow(request: web.Request) -> web.StreamResponse:
        """No answer at all until the test says so (or the client goes away)."""
        state.first_sent.set()
        try:
            await state.go_on.wait()
        except asyncio.CancelledError:
            state.cancelled.set()
            raise
        return web.Response(text="late")

    async def big(request: web.Request) -> web.StreamResponse:
        return web.Response(body=bytes(range(256)) * 8192)  # 2 MiB

    app = web.Application(middlewares=[count_peers])
    app.router.add_route("*", "/echo", echo)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/stream", stream)
    app.router.add_get("/slow", slow)
    app.router.add_get("/big", big)
    return app


@contextlib.asynccontextmanager
async def aiohttp_server(
    state: AppState, ssl_context: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    runner = web.AppRunner(aiohttp_app(state), handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0, ssl_context=ssl_context)
    await site.start()
    try:
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()


def test_post_body_and_headers_reach_the_server_and_come_back() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            body = json.dumps({"model": "m", "text": "héllo"}).encode()
            resp = await pool.request("POST", HOST, port, "/echo?x=1%202", body=body, headers=JSON)
            assert resp.status == 200
            assert resp.content_type == "application/json"
            assert resp.header("x-twice") == "a"
            assert resp.header("Content-Length") is not None
            assert resp.header("X-Missing") is None
            data = json.loads(await resp.read())
            resp.release()
            assert data == {
                "method": "POST",
                "path": "/echo?x=1%202",
                "body": body.decode(),
                "content_type": "application/json",
                "host": f"{HOST}:{port}",
            }
            await pool.close()

    run(main)


def test_keep_alive_reuses_one_connection() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            for i in range(20):
                path = "/chunked" if i % 2 else "/echo"
                async with await pool.request("GET", HOST, port, path) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert len(state.peers) == 1
            assert pool.connections == 1
            await pool.close()

    run(main)


def test_concurrent_requests_use_separate_connections_then_reuse_them() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool(max_idle_per_key=3)

            async def one(i: int) -> bytes:
                resp = await pool.request("POST", HOST, port, "/echo", body=str(i).encode())
                try:
                    return await resp.read()
                finally:
                    resp.release()

            for _ in range(3):
                bodies = await asyncio.gather(*(one(i) for i in range(5)))
                assert [json.loads(b)["body"] for b in bodies] == [str(i) for i in range(5)]
            # 5 at once need 5 connections; at most 3 stay idle between rounds.
            assert 5 <= len(state.peers) <= 9
            assert pool.connections <= 3
            await pool.close()

    run(main)


def test_chunked_body_is_decoded() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            resp = await pool.request("GET", HOST, port, "/chunked")
            assert resp.header("Transfer-Encoding") == "chunked"
            pieces = [p async for p in resp.iter_chunks()]
            resp.release()
            assert b"".join(pieces) == b"".join(f"part {i};".encode() for i in range(5))
            async with await pool.request("GET", HOST, port, "/chunked") as again:
                assert await again.read() == b"".join(pieces)
            assert len(state.peers) == 1
            await pool.close()

    run(main)


def test_event_stream_arrives_while_the_server_still_writes() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            resp = await pool.request("GET", HOST, port, "/stream")
            assert resp.content_type == "text/event-stream"
            chunks = resp.iter_chunks()
            first = await asyncio.wait_for(anext(chunks), STEP_S)
            assert first == b"data: 1\n\n"
            assert not state.go_on.is_set()
            state.go_on.set()
            rest = [c async for c in chunks]
            assert b"".join(rest) == b"data: 2\n\n"
            resp.release()
            await pool.close()

    run(main)


def test_large_body_with_a_slow_reader_is_complete() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            resp = await pool.request("GET", HOST, port, "/big")
            got = bytearray()
            async for chunk in resp.iter_chunks():
                got += chunk
                await asyncio.sleep(0.001)  # reading pauses while we are behind
            resp.release()
            assert bytes(got) == bytes(range(256)) * 8192
            async with await pool.request("GET", HOST, port, "/big") as again:
                assert len(await again.read()) == 256 * 8192
            assert len(state.peers) == 1
            await pool.close()

    run(main)


def test_release_before_the_body_is_read_closes_the_connection() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            resp = await pool.request("GET", HOST, port, "/stream")
            await asyncio.wait_for(state.first_sent.wait(), STEP_S)
            resp.release()
            await asyncio.wait_for(state.cancelled.wait(), STEP_S)  # the server saw it go
            with pytest.raises(UpstreamError):
                await resp.read()
            async with await pool.request("GET", HOST, port, "/echo") as again:
                assert again.status == 200
            assert len(state.peers) == 2
            await pool.close()

    run(main)


def test_cancelled_while_streaming_closes_the_upstream_connection() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            got_first = asyncio.Event()

            async def handler() -> None:
                resp = await pool.request("GET", HOST, port, "/stream")
                try:
                    async for _chunk in resp.iter_chunks():
                        got_first.set()
                finally:
                    resp.release()

            task = asyncio.create_task(handler())
            await asyncio.wait_for(got_first.wait(), STEP_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(state.cancelled.wait(), STEP_S)
            assert pool.connections == 0
            await pool.close()

    run(main)


def test_cancelled_while_waiting_for_the_head_closes_the_upstream_connection() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            task = asyncio.create_task(pool.request("GET", HOST, port, "/slow"))
            await asyncio.wait_for(state.first_sent.wait(), STEP_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(state.cancelled.wait(), STEP_S)
            assert pool.connections == 0
            await pool.close()

    run(main)


def test_close_closes_idle_connections() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            async with await pool.request("GET", HOST, port, "/echo") as resp:
                await resp.read()
            assert pool.connections == 1
            await pool.close()
            assert pool.connections == 0
            with pytest.raises(UpstreamConnectError):
                await pool.request("GET", HOST, port, "/echo")

    run(main)


def test_idle_connections_expire() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool(idle_timeout=0.1)
            async with await pool.request("GET", HOST, port, "/echo") as resp:
                await resp.read()
            assert pool.connections == 1
            await asyncio.sleep(0.4)
            assert pool.connections == 0
            async with await pool.request("GET", HOST, port, "/echo") as resp:
                assert resp.status == 200
            assert len(state.peers) == 2
            await pool.close()

    run(main)


def test_refused_connection_is_a_connect_error() -> None:
    async def main() -> None:
        import socket

        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]  # bound, not listening: refused
            pool = UpstreamPool()
            with pytest.raises(
                UpstreamConnectError, match=f"cannot connect to {HOST}:{port}"
            ) as info:
                await pool.request("GET", HOST, port, "/")
            assert info.value.retryable
            await pool.close()

    run(main)


# --------------------------------------------------------------------------- a raw server


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@dataclass
class Raw:
    port: int
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request (head and Content-Length body), or None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            length = int(value)
    return head + await reader.readexactly(length)


@contextlib.asynccontextmanager
async def raw_server(script: Script) -> AsyncIterator[Raw]:
    """Each connection runs ``script(reader, writer, n)``, n counting connections from 0."""
    raw = Raw(port=0)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = raw.connections
        raw.connections += 1
        try:
            await script(reader, writer, n)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, HOST, 0)
    raw.port = server.sockets[0].getsockname()[1]
    try:
        yield raw
    finally:
        server.close()
        await server.wait_closed()


async def send_pieces(writer: asyncio.StreamWriter, pieces: list[bytes]) -> None:
    """Each piece as its own segment (a short pause lets the peer read it alone)."""
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0.002)


def answering(*answers: list[bytes], close_after: bool = False) -> Script:
    """A script that answers the i-th request on a connection with answers[i]."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for pieces in answers:
            if await read_request(reader) is None:
                return
            await send_pieces(writer, pieces)
        if close_after:
            return
        await read_request(reader)  # hold the connection open until the client goes

    return script


async def get(pool: UpstreamPool, raw: Raw, method: str = "GET") -> tuple[UpstreamResponse, bytes]:
    resp = await pool.request(method, HOST, raw.port, "/x")
    try:
        return resp, await resp.read()
    finally:
        resp.release()


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n"
    b"1;ext=1\r\n \r\n"
    b"0B\r\nworld, 1234\r\n"
    b"0\r\nX-Trailer: yes\r\n\r\n"
)
CHUNKED_BODY = b"hello world, 1234"


def test_chunked_split_byte_by_byte_and_reused() -> None:
    async def main() -> None:
        pieces = [CHUNKED[i : i + 1] for i in range(len(CHUNKED))]
        async with raw_server(answering(pieces, [CHUNKED])) as raw:
            pool = UpstreamPool()
            resp, body = await get(pool, raw)
            assert resp.status == 200 and resp.content_type == "text/event-stream"
            assert body == CHUNKED_BODY
            resp, body = await get(pool, raw)
            assert body == CHUNKED_BODY
            assert raw.connections == 1
            await pool.close()

    run(main)


def test_content_length_body_in_pieces() -> None:
    answer = b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\n0123456789"

    async def main() -> None:
        async with raw_server(
            answering([answer[:20], answer[20:47], answer[47:]], [answer])
        ) as raw:
            pool = UpstreamPool()
            resp, body = await get(pool, raw)
            assert (resp.status, resp.reason, body) == (201, "Created", b"0123456789")
            resp, body = await get(pool, raw)
            assert body == b"0123456789"
            assert raw.connections == 1
            await pool.close()

    run(main)


def test_connection_close_is_not_reused() -> None:
    answer = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"

    async def main() -> None:
        async with raw_server(answering([answer], close_after=True)) as raw:
            pool = UpstreamPool()
            for _ in range(3):
                resp, body = await get(pool, raw)
                assert body == b"ok" and not resp.keep_alive
            assert raw.connections == 3
            await pool.close()

    run(main)


def test_http10_body_until_close() -> None:
    answer = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of "

    async def main() -> None:
        async with raw_server(answering([answer, b"it"], close_after=True)) as raw:
            pool = UpstreamPool()
            for _ in range(2):
                resp, body = await get(pool, raw)
                assert (resp.version, resp.status, body) == ("HTTP/1.0", 200, b"all of it")
            assert raw.connections == 2
            await pool.close()

    run(main)


def test_http10_keep_alive_with_length_is_reused() -> None:
    answer = b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\nabc"

    async def main() -> None:
        async with raw_server(answering([answer], [answer])) as raw:
            pool = UpstreamPool()
            for _ in range(2):
                _, body = await get(pool, raw)
                assert body == b"abc"
            assert raw.connections == 1
            await pool.close()

    run(main)


def test_bodiless_answers() -> None:
    answers = [
        [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"],
        [b"HTTP/1.1 304 Not Modified\r\nContent-Length: 99\r\n\r\n"],
        [
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        ],
        [b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n"],  # the answer to HEAD
        [b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nz"],
    ]

    async def main() -> None:
        async with raw_server(answering(*answers)) as raw:
            pool = UpstreamPool()
            got = []
            for method in ("GET", "GET", "GET", "HEAD", "GET"):
                resp, body = await get(pool, raw, method)
                got.append((resp.status, body))
            assert got == [(204, b""), (304, b""), (200, b""), (200, b""), (200, b"z")]
            assert raw.connections == 1
            await pool.close()

    run(main)


def test_peer_closing_an_idle_connection_is_noticed() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await send_pieces(writer, [answer])
        # then close the connection while it idles in the pool

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool()
            await get(pool, raw)
            for _ in range(100):
                if pool.connections == 0:
                    break
                await asyncio.sleep(0.01)
            assert pool.connections == 0  # EOF seen: out of the pool
            _, body = await get(pool, raw)
            assert body == b"ok"
            assert raw.connections == 2
            await pool.close()

    run(main)


def test_keep_alive_race_is_retried_on_a_new_connection() -> None:
    """The peer closes a pooled connection just as the next request goes out on it."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await send_pieces(writer, [answer])
        await read_request(reader)  # the second request: dropped without a word

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool()
            for _ in range(3):
                _, body = await get(pool, raw)
                assert body == b"ok"
            assert raw.connections == 3  # 1, then 2 (retry after the drop), then 3 (same)
            await pool.close()

    run(main)


def test_fresh_connection_closed_without_an_answer_is_retryable() -> None:
    """An upstream that dies (or restarts) with our request: sent, never answered."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool()
            with pytest.raises(UpstreamDisconnected, match="before answering") as info:
                await get(pool, raw)
            assert info.value.retryable  # another replica may take it
            assert not isinstance(info.value, UpstreamConnectError)  # but it was sent
            assert raw.connections == 1  # no retry on a fresh connection
            await pool.close()

    run(main)


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"HTP/1.1 200 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "malformed status line"),
        (b"HTTP/2 200\r\n\r\n", "malformed status line"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n", "malformed header line"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "conflicting"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", "switched protocols"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70000, "longer than"),
    ],
)
def test_malformed_head_is_a_protocol_error(answer: bytes, match: str) -> None:
    async def main() -> None:
        async with raw_server(answering([answer])) as raw:
            pool = UpstreamPool()
            with pytest.raises(UpstreamProtocolError, match=match):
                await get(pool, raw)
            assert pool.connections == 0
            await pool.close()

    run(main)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nab\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nab\r\n0\r\n\r\n",
    ],
)
def test_malformed_chunked_body_is_a_protocol_error(answer: bytes) -> None:
    async def main() -> None:
        async with raw_server(answering([answer])) as raw:
            pool = UpstreamPool()
            resp = await pool.request("GET", HOST, raw.port, "/x")
            with pytest.raises(UpstreamProtocolError, match="chunk"):
                await resp.read()
            resp.release()
            await pool.close()

    run(main)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part of it",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n9\r\npart",
        b"HTTP/1.1 200 OK\r\nContent-Le",
    ],
)
def test_server_dying_mid_response_is_an_upstream_error(answer: bytes) -> None:
    async def main() -> None:
        async with raw_server(answering([answer], close_after=True)) as raw:
            pool = UpstreamPool()
            with pytest.raises(UpstreamError, match="closed the connection") as info:
                resp = await pool.request("GET", HOST, raw.port, "/x")
                try:
                    async for _ in resp.iter_chunks():
                        pass
                finally:
                    resp.release()
            assert not info.value.retryable  # part of the answer came: not to be sent again
            await pool.close()

    run(main)


# --------------------------------------------------------------------------- hostile upstreams


def test_an_upstream_that_never_answers_times_out_and_is_closed() -> None:
    seen_eof = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        await reader.read()  # nothing answered; returns at EOF, when the client gives up
        seen_eof.set()

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool(read_timeout=0.3)
            with pytest.raises(UpstreamTimeout, match=r"sent nothing for 0\.3 s") as info:
                await pool.request("GET", HOST, raw.port, "/x")
            assert not info.value.retryable  # the upstream may be working on it
            await asyncio.wait_for(seen_eof.wait(), STEP_S)
            assert pool.connections == 0
            await pool.close()

    run(main)


def test_an_upstream_that_stalls_mid_stream_times_out() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n"
        )
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool(read_timeout=0.3)
            resp = await pool.request("GET", HOST, raw.port, "/x")
            got: list[bytes] = []
            with pytest.raises(UpstreamTimeout):
                async for chunk in resp.iter_chunks():
                    got.append(chunk)
            resp.release()
            assert got == [b"data: 1\n\n"]
            assert pool.connections == 0
            await pool.close()

    run(main)


def test_a_slow_but_steady_upstream_is_not_timed_out() -> None:
    """The timeout is on silence, not on the whole answer: 2 s of bytes every 50 ms pass a
    0.8 s idle timeout, and the connection is reused (the timer re-arms lazily)."""
    pieces = [b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n"] + [b"x"] * 40

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        for _ in range(2):
            await read_request(reader)
            for piece in pieces:
                writer.write(piece)
                await writer.drain()
                await asyncio.sleep(0.05)
        await reader.read()

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool(read_timeout=0.8)
            for _ in range(2):
                _, body = await get(pool, raw)
                assert body == b"x" * 40
            assert raw.connections == 1
            await pool.close()

    run(main)


def test_a_body_over_max_body_by_its_content_length_is_refused_before_reading_it() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\nabc")
        await writer.drain()
        await reader.read()  # never sends the rest

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool(max_body=1000)
            resp = await pool.request("GET", HOST, raw.port, "/x")
            assert resp.length == 1_000_000_000
            with pytest.raises(UpstreamTooLarge, match=r"1000000000 bytes.*1000 bytes"):
                await asyncio.wait_for(resp.read(), STEP_S)
            resp.release()
            assert pool.connections == 0
            await pool.close()

    run(main)


def test_a_chunked_body_over_max_body_is_refused_after_little_more_than_the_limit() -> None:
    sent = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"10000\r\n" + b"y" * 0x10000 + b"\r\n"
        for _ in range(16 * 1024):  # 1 GiB if nobody stops it
            writer.write(piece)
            await writer.drain()
            sent += 0x10000

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool(max_body=1024 * 1024)
            resp = await pool.request("GET", HOST, raw.port, "/x")
            assert resp.length is None
            with pytest.raises(UpstreamTooLarge, match="over 1048576 bytes"):
                await asyncio.wait_for(resp.read(), STEP_S)
            resp.release()
            await asyncio.sleep(0.1)
            # Stopped near the limit (socket buffers hold a few MiB more at most).
            assert sent < 64 * 1024 * 1024
            await pool.close()

    run(main)


def test_max_body_does_not_cap_a_streamed_body() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool(max_body=1000)
            async with await pool.request("GET", HOST, port, "/big") as resp:
                total = 0
                async for chunk in resp.iter_chunks():
                    total += len(chunk)
                assert total == 256 * 8192
            async with await pool.request("GET", HOST, port, "/big") as resp:
                with pytest.raises(UpstreamTooLarge):
                    await resp.read()
            await pool.close()

    run(main)


def test_a_large_request_body_arrives_whole() -> None:
    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state) as port:
            pool = UpstreamPool()
            for size in (10, 64 * 1024 + 1, 900 * 1024):  # aiohttp takes up to 1 MiB
                body = b"z" * size
                async with await pool.request("POST", HOST, port, "/echo", body=body) as resp:
                    assert json.loads(await resp.read())["body"] == body.decode()
            assert len(state.peers) == 1
            await pool.close()

    run(main)


async def read_head(reader: asyncio.StreamReader) -> int:
    """A request's head; its Content-Length."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"content-length":
            return int(value)
    return 0


def test_a_large_body_is_written_as_the_peer_takes_it() -> None:
    """Pieces go out when the transport has room: what waits in our buffers stays small
    while a slow reader takes 16 MiB (TLS kept a whole body's worth per connection)."""
    size = 16 * 1024 * 1024

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        left = await read_head(reader)
        while left:
            left -= len(await reader.read(min(left, 256 * 1024)))
            await asyncio.sleep(0.002)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool()
            waiting: list[int] = []
            done = asyncio.Event()

            async def sample() -> None:
                while not done.is_set():
                    for conn in list(pool._conns):
                        if conn.transport is not None:
                            waiting.append(conn.transport.get_write_buffer_size())
                    await asyncio.sleep(0.001)

            sampler = asyncio.create_task(sample())
            resp = await pool.request("POST", HOST, raw.port, "/x", body=b"b" * size)
            done.set()
            await sampler
            assert resp.status == 200 and await resp.read() == b"ok"
            resp.release()
            assert waiting and max(waiting) <= 1024 * 1024, max(waiting)
            await pool.close()

    run(main)


def test_a_peer_that_never_reads_the_body_times_out() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await read_head(reader)
        await asyncio.sleep(STEP_S)  # reads nothing more, answers nothing

    async def main() -> None:
        async with raw_server(script) as raw:
            pool = UpstreamPool(read_timeout=0.5)
            with pytest.raises(UpstreamTimeout):
                await asyncio.wait_for(
                    pool.request("POST", HOST, raw.port, "/x", body=b"b" * (64 * 1024 * 1024)),
                    STEP_S,
                )
            assert pool.connections == 0
            await pool.close()

    run(main)


def test_an_answer_before_the_whole_body_stops_it_and_the_connection_goes() -> None:
    got = 0

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        nonlocal got
        await read_head(reader)
        writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 3\r\n\r\nbig")
        await writer.drain()
        while chunk := await reader.read(65536):  # discard the rest, as servers do
            got += len(chunk)

    async def main() -> None:
        size = 256 * 1024 * 1024
        async with raw_server(script) as raw:
            pool = UpstreamPool()
            resp = await asyncio.wait_for(
                pool.request("POST", HOST, raw.port, "/x", body=b"b" * size), STEP_S
            )
            assert resp.status == 413
            assert await resp.read() == b"big"
            resp.release()
            assert pool.connections == 0  # its framing is spoilt: not reused
            await asyncio.sleep(0.1)
            assert got < size
            await pool.close()

    run(main)


def test_request_target_and_headers_are_checked() -> None:
    async def main() -> None:
        pool = UpstreamPool()
        with pytest.raises(ValueError, match="request target"):
            await pool.request("GET", HOST, 1, "/a b")
        with pytest.raises(ValueError, match="line break"):
            await pool.request("GET", HOST, 1, "/", headers=[("X", "a\r\nY: b")])
        await pool.close()

    run(main)


# --------------------------------------------------------------------------- TLS


@dataclass
class TLS:
    server: ssl.SSLContext
    client: ssl.SSLContext
    client_without_cert: ssl.SSLContext


def tls_contexts(tmp_path: Path) -> TLS:
    ca = pki.init_ca(tmp_path / "ca")
    node = pki.issue_node_cert(ca, "node-a", tmp_path / "node")
    client = pki.issue_control_plane_client_cert(ca, tmp_path / "client")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(node.cert, node.key)
    server.load_verify_locations(cafile=str(node.ca))
    server.verify_mode = ssl.CERT_REQUIRED
    with_cert = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(client.ca))
    with_cert.load_cert_chain(client.cert, client.key)
    without = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(client.ca))
    return TLS(server, with_cert, without)


def test_tls_with_server_hostname_and_reuse(tmp_path: Path) -> None:
    tls = tls_contexts(tmp_path)

    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state, tls.server) as port:
            pool = UpstreamPool(ssl=tls.client)
            for i in range(3):
                resp = await pool.request(
                    "POST", HOST, port, "/echo", body=b"x" * i, server_hostname="node-a"
                )
                assert json.loads(await resp.read())["body"] == "x" * i
                resp.release()
            resp = await pool.request("GET", HOST, port, "/chunked", server_hostname="node-a")
            assert (await resp.read()).startswith(b"part 0;")
            resp.release()
            assert len(state.peers) == 1
            await pool.close()

    run(main)


def test_tls_wrong_server_hostname_is_a_connect_error(tmp_path: Path) -> None:
    tls = tls_contexts(tmp_path)

    async def main() -> None:
        async with aiohttp_server(AppState(), tls.server) as port:
            pool = UpstreamPool(ssl=tls.client)
            with pytest.raises(UpstreamConnectError, match="node-b"):
                await pool.request("GET", HOST, port, "/echo", server_hostname="node-b")
            await pool.close()

    run(main)


def test_peer_check_sees_the_certificate_and_can_refuse_it(tmp_path: Path) -> None:
    tls = tls_contexts(tmp_path)
    serial = format(pki.load_cert(tmp_path / "node" / "node.crt").serial_number, "x")
    seen: list[tuple[str, str | None]] = []
    denied: set[str] = set()

    def check(der: bytes, name: str | None) -> str | None:
        got = format(x509.load_der_x509_certificate(der).serial_number, "x")
        seen.append((got, name))
        return f"certificate {got} was revoked" if got in denied else None

    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state, tls.server) as port:
            pool = UpstreamPool(ssl=tls.client, peer_check=check)
            resp = await pool.request("GET", HOST, port, "/echo", server_hostname="node-a")
            resp.release()
            assert seen == [(serial, "node-a")]
            # Revoked while pooled: forget() closes it, and the next connection is refused.
            denied.add(serial)
            assert pool.forget("node-a") == 1
            assert pool.connections == 0
            with pytest.raises(UpstreamConnectError, match=f"certificate {serial} was revoked"):
                await pool.request("GET", HOST, port, "/echo", server_hostname="node-a")
            assert pool.connections == 0
            assert len(state.peers) == 1  # only the first connection sent a request
            await pool.close()

    run(main)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (briefly) for what a closing transport reports a few loop turns later."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not so within {timeout:g} s")


def test_retrust_closes_connections_made_under_the_old_trust(tmp_path: Path) -> None:
    """After a CA's drop the gateway swaps its TLS context: no later request may ride a
    connection verified under the old trust (an idle one is closed at once, a busy one when
    it is released), and new handshakes use the new context."""
    tls = tls_contexts(tmp_path)
    other = pki.init_ca(tmp_path / "other-ca")
    trusts_other = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=str(tmp_path / "other-ca" / pki.CA_CERT)
    )
    assert other.cert is not None

    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state, tls.server) as port:
            pool = UpstreamPool(ssl=tls.client)
            idle = await pool.request("GET", HOST, port, "/echo", server_hostname="node-a")
            await idle.read()
            busy = await pool.request("GET", HOST, port, "/echo", server_hostname="node-a")
            idle.release()  # pooled, idle
            assert pool.connections == 2
            assert pool.retrust(trusts_other) == 2
            await until(
                lambda: pool.connections == 1
            )  # the idle one is gone; the busy one finishes
            assert json.loads(await busy.read())["method"] == "GET"
            busy.release()
            await until(lambda: pool.connections == 0)
            # The node's certificate is not under the new trust: refused at the handshake.
            with pytest.raises(UpstreamConnectError, match="certificate we do not trust"):
                await pool.request("GET", HOST, port, "/echo", server_hostname="node-a")
            # And back to a trust that holds it: a new connection serves.
            pool.retrust(tls.client)
            resp = await pool.request("GET", HOST, port, "/echo", server_hostname="node-a")
            await resp.read()
            resp.release()
            assert len(state.peers) == 3
            await pool.close()

    run(main)


def test_tls_refused_client_certificate_is_a_connect_error(tmp_path: Path) -> None:
    tls = tls_contexts(tmp_path)

    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state, tls.server) as port:
            pool = UpstreamPool(ssl=tls.client_without_cert)
            with pytest.raises(UpstreamConnectError):
                await pool.request("GET", HOST, port, "/echo", server_hostname="node-a")
            assert not state.peers  # no request was handled
            await pool.close()

    run(main)


def test_tls_cancellation_closes_the_upstream_connection(tmp_path: Path) -> None:
    tls = tls_contexts(tmp_path)

    async def main() -> None:
        state = AppState()
        async with aiohttp_server(state, tls.server) as port:
            pool = UpstreamPool(ssl=tls.client)
            resp = await pool.request("GET", HOST, port, "/stream", server_hostname="node-a")

            async def consume() -> None:
                try:
                    async for _ in resp.iter_chunks():
                        pass
                finally:
                    resp.release()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(state.first_sent.wait(), STEP_S)
            await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(state.cancelled.wait(), STEP_S)
            await pool.close()

    run(main)


# --------------------------------------------------------------------------- the parser alone


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False
        self.reading = True

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True


async def feed(pool: UpstreamPool, pieces: list[bytes], method: str = "GET") -> tuple[Any, ...]:
    conn = UpstreamConnection(pool, (HOST, 1, None), asyncio.get_running_loop())
    transport = FakeTransport()
    conn.connection_made(transport)
    task = asyncio.create_task(conn.send(b"GET / HTTP/1.1\r\n\r\n", method == "HEAD"))
    await asyncio.sleep(0)
    for piece in pieces:
        conn.data_received(piece)
    resp = await task
    body = await resp.read()
    return resp.status, dict(resp.headers), body, resp.keep_alive, transport.closed


def test_every_split_of_a_chunked_answer_parses_the_same() -> None:
    async def main() -> None:
        pool = UpstreamPool()
        whole = await feed(pool, [CHUNKED])
        assert whole[2] == CHUNKED_BODY
        for i in range(1, len(CHUNKED)):
            for j in range(i, len(CHUNKED), 7):
                assert await feed(pool, [CHUNKED[:i], CHUNKED[i:j], CHUNKED[j:]]) == whole
        await pool.close()

    run(main)


def test_answer_and_extra_bytes_in_one_segment_is_not_reused() -> None:
    async def main() -> None:
        pool = UpstreamPool()
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA"
        status, _, body, keep_alive, _ = await feed(pool, [answer])
        assert (status, body, keep_alive) == (200, b"ok", False)
        await pool.close()

    run(main)
