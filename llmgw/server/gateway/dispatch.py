"""One model's request taken to a replica and answered: a place on one (the routing policy's
choice; else a wait in the key's queue, or for a replica to exist at all), the forward, and
another replica when one cannot be reached, failed before a byte of its answer reached the
client (the request sent again whole), or broke a stream that may be resumed
(:mod:`llmgw.server.gateway.resume`).

The gateway (:mod:`llmgw.server.gateway.gateway`) reads and admits a request, then hands it
here; a disaggregated model's decode comes here too (:mod:`llmgw.server.gateway.disagg`, by
the gateway's ``_route``). A stream that waited long for a cold start has its event stream
begun, with comments to keep it open; what comes after goes into it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace

from aiohttp import web

from llmgw.http.relay import SSE_HEADERS, STARTED_STREAM, STREAM_ERROR, error_event
from llmgw.log import kv
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway import refusals
from llmgw.server.gateway.capacity import Capacity, NoRoom
from llmgw.server.gateway.disagg import charge_decoding
from llmgw.server.gateway.forwarding import AnswerFailed, ConnectFailed, Forwarder
from llmgw.server.gateway.modelrequest import Charge, ModelRequest
from llmgw.server.gateway.queueing import Admission, QueueTimeout
from llmgw.server.gateway.refusals import openai_error, sentence
from llmgw.server.gateway.resume import RESUMABLE_PATHS, cause_of, ended_early, not_resumed
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServingCache

__all__ = ["KEEPALIVE_AFTER", "KEEPALIVE_EVERY", "Dispatch", "in_started_stream"]

log = logging.getLogger("llmgw.server.gateway")

# A stream waiting for a replica to start gets its event stream begun after KEEPALIVE_AFTER
# seconds, and an SSE comment every KEEPALIVE_EVERY (proxies close a silent connection
# after 60 s by default: nginx, haproxy's timeout server as the README sets it).
KEEPALIVE_AFTER = 1.0
KEEPALIVE_EVERY = 10.0


class Dispatch:
    """A gateway's requests placed on replicas and forwarded, retried and resumed."""

    def __init__(
        self,
        router: Router,
        admission: Admission,
        forwarder: Forwarder,
        capacity: Capacity,
        serving: ServingCache,
        metrics: Metrics,
        *,
        queue_timeout: float,
        replica_wait: float,
        ctl: str,
    ) -> None:
        self.router = router
        self.admission = admission
        self.forwarder = forwarder
        self.capacity = capacity
        self.serving = serving
        self.metrics = metrics
        # server.yaml's: how long a request waits for a free place, and for a replica that
        # is restarting; how an operator runs ctl, in the refusals' fixes.
        self.queue_timeout = queue_timeout
        self.replica_wait = replica_wait
        self.ctl = ctl

    async def route(self, req: ModelRequest, charge: Charge) -> web.StreamResponse:
        """Take a place on a replica of the model (the one its routing policy chooses;
        waiting in the key's queue when all are full) and forward; another replica when one
        cannot be reached, or failed before a byte of its answer reached the client (sent
        again whole, at most ``req.retries`` times), or when a stream that may be resumed
        broke on it."""
        tried: set[str] = set()
        busy = 0  # replicas whose agent had no room for the body
        cause = ""  # why the stream is being resumed ("" while it is not)
        failure: Exception | None = None  # what broke it
        retries = 0  # times the request was sent again whole
        retry = ""  # why the last time (its outcome not known yet: "" when none)
        while True:
            ep = await self._place(req, frozenset(tried), busy)
            if isinstance(ep, web.StreamResponse):
                charge.outcome.status = ep.status
                if retry:
                    self._retried(req, retry, "no_replica")
                if cause and failure is not None:
                    # No other replica to go on with: the stream ends as it would have.
                    self._stream_end(req, cause, "no_replica")
                    return await ended_early(req.http[STARTED_STREAM], req.model, failure)
                return await in_started_stream(req, ep)
            tried.add(ep.shard_id)
            if req.decoding:
                charge_decoding(self.metrics, ep, req.decoding)
            may_retry = (
                not cause
                and retries < req.retries
                and self.router.has_ready(req.model, frozenset(tried))
            )
            try:
                answer = await self.forwarder.forward(req, ep, charge, may_retry)
            except ConnectFailed as exc:
                busy += exc.busy
                log.warning(
                    "replica unreachable; trying another",
                    extra=kv(model=req.model, shard=ep.shard_id, error=str(exc)),
                )
                continue
            except AnswerFailed as exc:
                if retry:
                    self._retried(req, retry, "failed")
                if _client_gone(req.http):  # not a fault: nobody waits for the answer
                    return openai_error(502, sentence(exc), type_="server_error")
                retries, retry = retries + 1, exc.cause
                log.warning(
                    "a replica failed mid-answer; sending the request again to another",
                    extra=kv(model=req.model, shard=ep.shard_id, cause=exc.cause, error=str(exc)),
                )
                if req.whole is not None:  # a decode: recomputed whole, no KV to pull
                    req = replace(req, body=req.whole, whole=None, on_head=None)
                continue
            finally:
                if req.decoding:
                    charge_decoding(self.metrics, ep, -req.decoding)
                self.admission.release(ep, req.hint, req.tokens)
            if retry:
                status = answer.status
                self._retried(
                    req,
                    retry,
                    "answered" if status < 400 else "refused" if status < 500 else "failed",
                )
                retry = ""
            splice = req.splice
            broken = answer.get(STREAM_ERROR)
            if splice is None:
                if broken is not None:  # resume off for the model, or another endpoint
                    reason = "off" if req.path in RESUMABLE_PATHS else "endpoint"
                    self.metrics.streams_broken.inc((req.model, reason))
                return await in_started_stream(req, answer)
            if cause:
                # The resumed part: went to its end, broke again, or was refused (an error
                # answer, written into the stream as an error event).
                outcome = (
                    "broken" if broken is not None else "completed" if splice.done else "refused"
                )
                self._stream_end(req, cause, outcome)
            if broken is None or not answer.prepared:
                return await in_started_stream(req, answer)
            why = splice.why_not()
            if why is not None:
                self.metrics.streams_broken.inc((req.model, why))
                return answer
            # Or why not: its whole limit was sent (it ended as it would have), or the
            # template does not render the chat that a completion would continue.
            following = splice.next_body(req.body if req.whole is None else req.whole)
            if isinstance(following, str):
                self.metrics.streams_broken.inc((req.model, following))
                return await not_resumed(answer, broken)
            failure, cause = broken, cause_of(broken)
            splice.next_part(following[0])
            del answer[STREAM_ERROR]  # the next part's own, if it breaks too
            req.http[STARTED_STREAM] = answer
            req = replace(req, path=following[0], body=following[1], whole=None, on_head=None)

    def _retried(self, req: ModelRequest, cause: str, outcome: str) -> None:
        """``req``, sent again whole after its replica failed with ``cause``, ended with
        ``outcome``."""
        self.metrics.request_retries.inc((req.model, cause, outcome))
        log.info(
            "a request sent again went on",
            extra=kv(model=req.model, cause=cause, outcome=outcome, stream=req.stream),
        )

    def _stream_end(self, req: ModelRequest, cause: str, outcome: str) -> None:
        """A resumed part of ``req``'s stream ended with ``outcome``."""
        self.metrics.stream_resumes.inc((req.model, cause, outcome))
        splice = req.splice
        log.info(
            "a resumed stream went on",
            extra=kv(
                model=req.model,
                request=splice.id if splice is not None else "",
                part=splice.part if splice is not None else 0,
                cause=cause,
                outcome=outcome,
            ),
        )
        if outcome in ("no_replica", "refused"):
            self.metrics.streams_broken.inc((req.model, outcome))

    async def _place(
        self, req: ModelRequest, tried: frozenset[str], busy: int
    ) -> Endpoint | web.StreamResponse:
        """A place on a replica of ``req``'s model not among ``tried`` (``busy`` of which
        had no room for the body), or the refusal: no replica ready, or none free within
        queue_timeout."""
        model, admission, router = req.model, self.admission, self.router
        ep = admission.try_acquire(model, tried, req.hint, req.tokens)
        if ep is not None:
            return ep
        if not router.has_ready(model, tried):
            if not tried:
                refusal = await self._wait_for_replica(req)
                if refusal is not None:
                    return refusal
            if not router.has_ready(model, tried):
                return refusals.no_replica(model, len(tried), busy, self.ctl)
        key = req.key
        try:
            return await admission.acquire(
                model,
                key.id,
                key.policy.weight,
                tried,
                self.queue_timeout,
                req.hint,
                req.tokens,
            )
        except QueueTimeout as exc:
            log.info(
                "a request waited its whole queue_timeout",
                extra=kv(key=key.name, model=model, waited=round(exc.waited, 3)),
            )
            return refusals.queue_timeout(
                model,
                self.serving.max_concurrency(model),
                exc.waited,
                exc.depth,
                self.ctl,
            )

    async def _wait_for_replica(self, req: ModelRequest) -> web.StreamResponse | None:
        """No ready replica now: wait for one (a model that scales by demand: its
        cold_start_timeout, while the planner places one; otherwise replica_wait, as its
        agent may be restarting or a drain moving it). A stream that waits long gets its
        event stream begun, with comments to keep it open. The 503 naming why when the
        scheduler cannot place one; None when one is ready, or the wait ran out."""
        model = req.model
        timeout = self.serving.cold_start_timeout(model)
        if timeout is None:
            await self.router.wait_ready(model, self.replica_wait)
            return None
        started = time.perf_counter()
        self.metrics.capacity_waiting.inc((model,))
        waiting = asyncio.ensure_future(self.capacity.wait(model, timeout))
        try:
            if req.stream:
                await self._keep_alive(req, waiting)
            await waiting
        except NoRoom as exc:
            return refusals.no_room(model, exc.reason, self.ctl)
        finally:
            waiting.cancel()
            self.metrics.capacity_waiting.dec((model,))
            self.metrics.capacity_wait.observe((model,), time.perf_counter() - started)
        return None

    async def _keep_alive(self, req: ModelRequest, waiting: asyncio.Future[bool]) -> None:
        """While ``waiting`` (for a replica to exist) goes on past KEEPALIVE_AFTER, the
        client's event stream is begun and an SSE comment sent every KEEPALIVE_EVERY, so
        that neither it nor a proxy between takes the silence for a dead connection."""
        pause = KEEPALIVE_AFTER
        while not waiting.done():
            await asyncio.wait({waiting}, timeout=pause)
            if waiting.done():
                return
            http = req.http
            stream = http.get(STARTED_STREAM)
            if stream is None:
                stream = web.StreamResponse(
                    status=200,
                    headers={"Content-Type": "text/event-stream", **SSE_HEADERS},
                )
                await stream.prepare(http)
                http[STARTED_STREAM] = stream
            await stream.write(f": waiting for a replica of {req.model} to start\n\n".encode())
            pause = KEEPALIVE_EVERY


async def in_started_stream(req: ModelRequest, answer: web.StreamResponse) -> web.StreamResponse:
    """``answer`` as the client can still get it: in the event stream begun while it waited
    for a replica (a refusal as an error event), else as it is."""
    started = req.http.get(STARTED_STREAM)
    if started is None or answer is started:
        return answer
    message = f"the request was refused ({answer.status})"
    body = answer.body if isinstance(answer, web.Response) else None
    if isinstance(body, bytes):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            message = str(json.loads(body)["error"]["message"])
    code = "no_capacity" if answer.status == 503 else "upstream_error"
    with contextlib.suppress(ConnectionError):  # the client may be gone
        await started.write(error_event(message, code))
    return started


def _client_gone(http: web.Request) -> bool:
    transport = http.transport
    return transport is None or transport.is_closing()
