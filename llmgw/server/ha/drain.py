"""An instance's stop without dropping a request (SIGTERM: ``systemctl stop``, an upgrade).

The phases, in order: **serving**; **draining** for ``drain_grace``, where ``/healthz``
answers 503 ``{"status": "draining"}`` so that load balancers take the instance out while it
still serves what they send; **closed**, where :8080 takes no new connection (its listening
sockets closed, idle keep-alive connections closed) and the requests and streams in flight
have ``drain_timeout`` to end; then what is left is cut (counted and logged) and the process
stops (the leader hands its lease over: :meth:`llmgw.server.app.ControlPlane.stop`). Every
answer from the start of the drain carries ``Connection: close``, so that a client holding a
keep-alive connection opens its next one through the load balancer, elsewhere. A second
signal (:meth:`Drain.hurry`) skips what is left of either wait and cuts at once.

The requests in flight are counted by :meth:`Drain.middleware` (the outermost middleware of
either role's application: every request on :8080 passes it), each with the task aiohttp
runs it in, which is what cutting it cancels; but not those of the instances themselves
(``unawaited``: the KV events relay's streams), which end with the role at the stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum

from aiohttp import web
from aiohttp.typedefs import Handler

from llmgw.log import kv
from llmgw.server.common.metrics import Metrics

__all__ = ["Drain", "DrainOutcome", "Phase", "stop_accepting"]

log = logging.getLogger("llmgw.server.drain")

EVENT_STREAM = "text/event-stream"


class Phase(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"  # /healthz 503, still serving what comes
    CLOSED = "closed"  # no new connection; what is in flight finishing
    STOPPED = "stopped"


@dataclass(frozen=True)
class DrainOutcome:
    """How a drain ended: the requests that ended by themselves after the listeners closed,
    those cut (of which streams), and whether a second signal hurried it."""

    finished: int
    cut: int
    streams_cut: int
    hurried: bool
    seconds: float


class Drain:
    """The drain's phase, the requests in flight, and the two waits."""

    def __init__(
        self,
        *,
        grace: float,
        timeout: float,
        metrics: Metrics | None = None,
        unawaited: frozenset[str] = frozenset(),
    ) -> None:
        self.grace = grace
        self.timeout = timeout
        # Paths whose requests are the instances' own, not clients': neither awaited nor cut
        # (the KV events relay's streams to the standbys, which last as long as the role and
        # end with it at the stop; awaited, every leader's drain would last drain_timeout).
        self.unawaited = unawaited
        self.metrics = metrics  # llmgw_instance_draining, llmgw_drain_requests_cut_total
        self.phase = Phase.SERVING
        self._requests: set[asyncio.Task[object]] = set()
        self._streams: set[asyncio.Task[object]] = set()
        self._ended = asyncio.Event()  # set whenever a request ends
        self._hurry = asyncio.Event()
        self._since = 0.0

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    @property
    def streams(self) -> int:
        return len(self._streams & self._requests)

    @property
    def draining(self) -> bool:
        return self.phase is not Phase.SERVING

    # -- what :8080 applies --------------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is None or request.path in self.unawaited:
            return await handler(request)
        self._requests.add(task)
        try:
            return await handler(request)
        finally:
            self._requests.discard(task)
            self._streams.discard(task)
            self._ended.set()

    async def on_prepare(self, _request: web.Request, response: web.StreamResponse) -> None:
        """``on_response_prepare`` of either role's application: a stream is noted (the
        log's count of streams cut); from the drain's start, every answer closes its
        connection after it."""
        if response.content_type == EVENT_STREAM:
            task = asyncio.current_task()
            if task is not None and task in self._requests:
                self._streams.add(task)
        if self.draining:
            response.force_close()  # the connection closed after this answer
            response.headers["Connection"] = "close"  # (the header is set before this hook)

    def status(self) -> dict[str, object] | None:
        """What /healthz says while draining (None while serving)."""
        if not self.draining:
            return None
        return {
            "status": "draining",
            "phase": str(self.phase),
            "in_flight": self.in_flight,
            "draining_for": round(time.monotonic() - self._since, 1),
        }

    # -- the stop ------------------------------------------------------------------------------

    def hurry(self) -> None:
        """A second signal: end either wait now, and cut what is left."""
        if not self._hurry.is_set():
            log.warning(
                "second stop signal: stopping now",
                extra=kv(phase=str(self.phase), in_flight=self.in_flight),
            )
        self._hurry.set()

    def begin(self) -> None:
        """/healthz answers 503 from now on (the grace's start)."""
        if self.phase is not Phase.SERVING:
            return
        self.phase = Phase.DRAINING
        self._since = time.monotonic()
        if self.metrics is not None:
            self.metrics.draining.set((), 1)
        log.info(
            "draining: /healthz answers 503 so that load balancers take this instance out; "
            "a second stop signal (Ctrl-C again) stops at once",
            extra=kv(grace=self.grace, timeout=self.timeout, in_flight=self.in_flight),
        )

    async def run(self, close: Callable[[], Awaitable[None]]) -> DrainOutcome:
        """The drain (begun here unless :meth:`begin` was called): the rest of the grace,
        *close* (the listeners), the requests in flight awaited up to the timeout, the rest
        cut."""
        self.begin()
        started = self._since
        await self._wait_hurry(self.grace - (time.monotonic() - started))
        self.phase = Phase.CLOSED
        await close()
        before = self.in_flight
        log.info(
            "draining: no new connections; waiting for the requests in flight",
            extra=kv(in_flight=before, streams=self.streams, timeout=self.timeout),
        )
        deadline = time.monotonic() + self.timeout
        while self._requests and not self._hurry.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._ended.clear()
            await self._wait_hurry(left, self._ended)
        cut, streams = await self.cut()
        self.phase = Phase.STOPPED
        outcome = DrainOutcome(
            finished=before - cut,
            cut=cut,
            streams_cut=streams,
            hurried=self._hurry.is_set(),
            seconds=round(time.monotonic() - started, 1),
        )
        if cut:
            why = "at a second signal" if outcome.hurried else "at drain_timeout"
            if self.metrics is not None:
                at = "signal" if outcome.hurried else "drain_timeout"
                self.metrics.drain_cut.inc(("stream", at), streams)
                if cut > streams:
                    self.metrics.drain_cut.inc(("request", at), cut - streams)
            log.warning(
                f"{streams} streams cut {why}",
                extra=kv(
                    requests_cut=cut,
                    streams_cut=streams,
                    timeout=self.timeout,
                    fix="raise drain_timeout in server.yaml (and the unit's TimeoutStopSec)"
                    if not outcome.hurried
                    else "",
                ),
            )
        log.info("drained", extra=kv(finished=outcome.finished, cut=cut, seconds=outcome.seconds))
        return outcome

    async def cut(self) -> tuple[int, int]:
        """Cancel the requests still in flight; how many, and how many of them streams."""
        tasks = list(self._requests)
        streams = len(self._streams & set(tasks))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks), streams

    async def _wait_hurry(self, seconds: float, other: asyncio.Event | None = None) -> None:
        """Up to *seconds*, or until hurried (or *other* is set)."""
        waits = [asyncio.ensure_future(self._hurry.wait())]
        if other is not None:
            waits.append(asyncio.ensure_future(other.wait()))
        try:
            await asyncio.wait(waits, timeout=max(seconds, 0), return_when="FIRST_COMPLETED")
        finally:
            for wait in waits:
                wait.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*waits, return_exceptions=True)


async def stop_accepting(runner: web.BaseRunner, *extra: socket.socket) -> None:
    """Close :8080's listening sockets (the runner's sites and *extra*, a kept socket whose
    duplicate the site served) and its idle keep-alive connections; the requests in flight
    go on, each connection closed after its answer."""
    for site in list(runner.sites):
        await site.stop()
    for sock in extra:
        sock.close()
    server = runner.server
    if server is not None:
        for conn in server.connections:
            if conn._request_in_progress:
                conn.close()  # closed once its answer is out
            else:
                # Idle: closed now (what aiohttp's own shutdown does; close() alone would
                # leave it open until the header timeout).
                conn.force_close()
