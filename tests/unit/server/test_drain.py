"""A stop's drain (llmgw.server.ha.drain) on a real listener: /healthz 503 during the grace
while requests are still served (each answer closing its connection), no new connection
after it, a stream in flight finishing, what outlives drain_timeout cut and counted, and a
second signal ending either wait at once. Both of :8080's listeners: the kept socket's
(PostgreSQL, :class:`Handover`) and a runner of its own (SQLite)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from llmgw.listener import GuardedSite, ListenerLimits, listening_socket
from llmgw.server.common.metrics import Metrics
from llmgw.server.ha import Drain, DrainOutcome, Handover, stop_accepting
from llmgw.server.ha.drain import Phase

pytestmark = pytest.mark.timeout(60)


class Rig:
    """An application as either role's: the drain's middleware and prepare hook, /healthz
    from the drain's status, /v1/short, and /v1/stream whose events flow until ``release``."""

    def __init__(self, drain: Drain) -> None:
        self.drain = drain
        self.release = asyncio.Event()
        self.streaming = asyncio.Event()
        self.cancelled = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.drain.middleware])
        app.on_response_prepare.append(self.drain.on_prepare)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/v1/short", self.short)
        app.router.add_get("/v1/stream", self.stream)
        return app

    async def healthz(self, _request: web.Request) -> web.Response:
        status = self.drain.status()
        if status is None:
            return web.json_response({"status": "ok"})
        return web.json_response(status, status=503)

    async def short(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            await response.write(b"data: first\n\n")
            self.streaming.set()
            await self.release.wait()
            await response.write(b"data: last\n\n")
            await response.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return response


# What each test's listener leaves to close at its end.
CLEANUPS: list[Callable[[], Awaitable[None]]] = []

Serve = Callable[[web.Application], Awaitable[tuple[int, Callable[[], Awaitable[None]]]]]


async def _handover(app: web.Application) -> tuple[int, Callable[[], Awaitable[None]]]:
    sock = listening_socket("127.0.0.1", 0)
    handover = Handover(sock, listen="127.0.0.1:0", limits=ListenerLimits())
    await handover.serve(app, None)

    async def close() -> None:
        await handover.stop_accepting()

    CLEANUPS.append(handover.close)
    return handover.port, close


async def _runner(app: web.Application) -> tuple[int, Callable[[], Awaitable[None]]]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = GuardedSite(runner, "127.0.0.1", 0, label="http", limits=ListenerLimits())
    await site.start()
    CLEANUPS.append(runner.cleanup)

    async def close() -> None:
        await stop_accepting(runner)

    return site.bound_port, close


SERVES = pytest.mark.parametrize("serve", [_handover, _runner], ids=["kept-socket", "own-runner"])


def run(body: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        try:
            await body()
        finally:
            for cleanup in reversed(CLEANUPS):
                await cleanup()
            CLEANUPS.clear()

    asyncio.run(main())


async def _read_stream(http: aiohttp.ClientSession, url: str, rig: Rig) -> list[bytes]:
    lines = []
    async with http.get(url + "/v1/stream") as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.strip():
                lines.append(line.strip())
    return lines


@SERVES
def test_grace_then_closed_then_the_stream_in_flight_finishes(serve: Serve) -> None:
    async def body() -> None:
        drain = Drain(grace=0.5, timeout=30)
        rig = Rig(drain)
        port, close = await serve(rig.app())
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/healthz") as resp:
                assert resp.status == 200 and resp.headers.get("Connection") != "close"
            stream = asyncio.create_task(_read_stream(http, url, rig))
            await asyncio.wait_for(rig.streaming.wait(), 10)
            draining = asyncio.create_task(drain.run(close))
            await asyncio.sleep(0)
            # The grace: /healthz 503 to the load balancer, requests still served, each
            # answer closing its connection.
            async with http.get(url + "/healthz") as resp:
                assert resp.status == 503
                got = await resp.json()
                assert got["status"] == "draining" and got["in_flight"] == 2  # stream + this
            async with http.get(url + "/v1/short") as resp:
                assert resp.status == 200
                assert resp.headers["Connection"] == "close"
            # Closed: no new connection, the stream still in flight.
            for _ in range(100):
                if drain.phase is Phase.CLOSED:
                    break
                await asyncio.sleep(0.05)
            assert drain.phase is Phase.CLOSED and not draining.done()
            with pytest.raises(aiohttp.ClientConnectionError):
                async with aiohttp.ClientSession() as fresh, fresh.get(url + "/v1/short"):
                    pass
            assert drain.in_flight == 1 and drain.streams == 1
            rig.release.set()
            assert await asyncio.wait_for(stream, 10) == [
                b"data: first",
                b"data: last",
                b"data: [DONE]",
            ]
            outcome = await asyncio.wait_for(draining, 10)
        assert outcome == DrainOutcome(
            finished=1, cut=0, streams_cut=0, hurried=False, seconds=outcome.seconds
        )
        assert drain.phase is Phase.STOPPED and rig.cancelled == 0

    run(body)


@SERVES
def test_an_idle_keep_alive_connection_is_closed_with_the_listener(serve: Serve) -> None:
    async def body() -> None:
        drain = Drain(grace=0, timeout=5)
        rig = Rig(drain)
        port, close = await serve(rig.app())
        url = f"http://127.0.0.1:{port}"
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.get(url + "/v1/short") as resp:
                assert resp.status == 200  # the connection stays open, idle
            outcome = await asyncio.wait_for(drain.run(close), 10)
            assert outcome.cut == 0 and outcome.finished == 0
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(url + "/v1/short"):
                    pass

    run(body)


def test_a_stream_past_drain_timeout_is_cut_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.server.drain")

    metrics = Metrics()

    async def body() -> None:
        drain = Drain(grace=0, timeout=0.5, metrics=metrics)
        rig = Rig(drain)
        port, close = await _runner(rig.app())
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            stream = asyncio.create_task(_read_stream(http, url, rig))
            await asyncio.wait_for(rig.streaming.wait(), 10)
            outcome = await asyncio.wait_for(drain.run(close), 10)
            assert (outcome.cut, outcome.streams_cut, outcome.hurried) == (1, 1, False)
            assert outcome.finished == 0
            assert rig.cancelled == 1
            # The client's stream ends without its [DONE].
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(stream, 10)
        assert drain.in_flight == 0

    run(body)
    text = metrics.render()
    assert "\nllmgw_instance_draining 1\n" in text
    assert '\nllmgw_drain_requests_cut_total{kind="stream",at="drain_timeout"} 1\n' in text
    assert 'kind="request"' not in text and 'at="signal"' not in text
    cut = [r for r in caplog.records if r.getMessage() == "1 streams cut at drain_timeout"]
    assert len(cut) == 1
    assert "drain_timeout" in cut[0].fields["fix"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("when", ["grace", "closed"])
def test_a_second_signal_stops_at_once(when: str) -> None:
    metrics = Metrics()

    async def body() -> None:
        # Long waits: only the second signal can end them within the test's timeout.
        drain = Drain(grace=0 if when == "closed" else 300, timeout=300, metrics=metrics)
        rig = Rig(drain)
        port, close = await _runner(rig.app())
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            stream = asyncio.create_task(_read_stream(http, url, rig))
            await asyncio.wait_for(rig.streaming.wait(), 10)
            started = time.monotonic()
            draining = asyncio.create_task(drain.run(close))
            expected = Phase.DRAINING if when == "grace" else Phase.CLOSED
            for _ in range(100):
                if drain.phase is expected:
                    break
                await asyncio.sleep(0.02)
            assert drain.phase is expected
            drain.hurry()
            outcome = await asyncio.wait_for(draining, 10)
            assert time.monotonic() - started < 30  # not the 300 s waits
            assert (outcome.cut, outcome.streams_cut, outcome.hurried) == (1, 1, True)
            assert rig.cancelled == 1
            with pytest.raises(aiohttp.ClientPayloadError):
                await asyncio.wait_for(stream, 10)

    run(body)
    assert '\nllmgw_drain_requests_cut_total{kind="stream",at="signal"} 1\n' in metrics.render()


def test_serving_says_nothing_and_begin_is_once() -> None:
    metrics = Metrics()
    drain = Drain(grace=10, timeout=120, metrics=metrics)
    assert drain.status() is None and not drain.draining
    assert "\nllmgw_instance_draining 0\n" in metrics.render()  # scraped before any drain
    drain.begin()
    assert "\nllmgw_instance_draining 1\n" in metrics.render()
    first = drain.status()
    assert first is not None and first["status"] == "draining"
    drain.begin()  # a second begin keeps the grace's start
    assert drain.phase is Phase.DRAINING


def test_the_instances_own_streams_are_neither_awaited_nor_cut() -> None:
    """The KV events relay's stream to each standby lasts as long as the leader leads: a
    leader's drain waited drain_timeout for it (and cut it) at every stop, with nothing of a
    client's in flight. It is left to the role's stop, which ends it."""

    async def body() -> None:
        drain = Drain(grace=0, timeout=30, unawaited=frozenset({"/api/ha/kv-events"}))
        rig = Rig(drain)
        app = rig.app()
        following = asyncio.Event()
        role_stopped = asyncio.Event()

        async def relay(request: web.Request) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": "application/x-llmgw-kv-relay"})
            await out.prepare(request)
            await out.write(b"\0\0\0\0")
            following.set()
            await role_stopped.wait()
            return out

        app.router.add_get("/api/ha/kv-events", relay)
        port, close = await _runner(app)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/api/ha/kv-events") as resp:
                assert resp.status == 200
                await asyncio.wait_for(following.wait(), 10)
                assert drain.in_flight == 0
                outcome = await asyncio.wait_for(drain.run(close), 10)  # not the 30 s
                assert (outcome.finished, outcome.cut, outcome.hurried) == (0, 0, False)
                role_stopped.set()  # the leader's stop ends the relay

    run(body)
