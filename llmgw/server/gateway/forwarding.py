"""The gateway's last hop: a request sent over mTLS to the agent of the replica it was given,
its answer relayed to the client (an event stream chunk by chunk), and the tokens the answer
reports counted (:mod:`llmgw.server.gateway.usage`) into the request's outcome and the metrics.

A replica that did not take the request (no connection, or its agent said it never passed it
on: draining, no room for the body, its engine stopping) raises :class:`ConnectFailed`, so
that the gateway tries another. One that took it and failed before a byte of its answer
reached the client (a body read whole cut short, the engine killed under its agent, the
replica silent past the read timeout) raises :class:`AnswerFailed` when the gateway may send
the request again, whole, to another replica (``may_retry``); otherwise, and when it failed
mid-stream, it is the client's 502 (or the stream's error event).
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable, Set
from functools import partial
from typing import Any

from aiohttp import web
from cryptography import x509

from llmgw.bodies import MAX_BODY_HEADER
from llmgw.errors import ConfigError
from llmgw.http.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from llmgw.http.pool import UpstreamPool, UpstreamResponse
from llmgw.http.relay import ENGINE_FAILED, NOT_PROCESSED, STREAM_ERROR, relay
from llmgw.log import kv
from llmgw.netaddr import parse_hostport
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.metering import Outcome
from llmgw.server.gateway.modelrequest import Charge, ModelRequest
from llmgw.server.gateway.refusals import openai_error
from llmgw.server.gateway.resume import StreamSplice
from llmgw.server.gateway.routing import Endpoint
from llmgw.server.gateway.usage import (
    StreamTokenCounter,
    body_usage,
    usage_numbers,
    with_cached,
)

__all__ = ["AnswerFailed", "ConnectFailed", "Forwarder"]

# The gateway's logger: what an operator filters on for the request path.
log = logging.getLogger("llmgw.server.gateway")

_JSON_HEADERS = (("Content-Type", "application/json"),)


class ConnectFailed(Exception):
    """The replica could not be reached, or went away before answering, or its agent had no
    room for the body (``busy``); another may be tried."""

    def __init__(self, message: str, busy: bool = False) -> None:
        super().__init__(message)
        self.busy = busy


class AnswerFailed(Exception):
    """The replica took the request and failed before a byte of its answer reached the
    client: the request may be sent again, whole, to another replica. ``cause``: reset (the
    connection broke), timeout (the replica went silent), engine_reset / engine_timeout (the
    engine failed under its living agent, which said so), protocol (an answer that is not
    HTTP)."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class Forwarder:
    """Keep-alive mTLS connections to the agents' data planes, and the requests sent on
    them."""

    def __init__(
        self,
        metrics: Metrics,
        *,
        read_timeout: float,
        max_body: int,
        revoked: Callable[[], Set[str]],
        client_ssl: Callable[[], ssl.SSLContext | None],
        history: RequestHistory | None = None,
    ) -> None:
        self.metrics = metrics
        self.read_timeout = read_timeout  # upstream_idle_timeout
        self.max_body = max_body  # max_response_body
        # The certificate serials the control plane denies (llmgw.server.fleet.nodes).
        self.revoked = revoked
        # The TLS the gateway presents to agents' data planes (None: plain, in tests).
        self.client_ssl = client_ssl
        self.history = history
        self._session: UpstreamPool | None = None
        self._hostports: dict[str, tuple[str, int]] = {}

    @property
    def session(self) -> UpstreamPool:
        """The connections (made on first use)."""
        if self._session is None:
            self._session = UpstreamPool(
                ssl=self.client_ssl(),
                peer_check=self.agent_certificate_problem,
                connect_timeout=5.0,
                # Shorter than the data plane keeps idle connections (300 s), so we close first.
                idle_timeout=290.0,
                read_timeout=self.read_timeout,
                max_body=self.max_body,
            )
        return self._session

    def agent_certificate_problem(self, der: bytes, node_id: str | None) -> str | None:
        """The data plane's certificate must not be one the control plane revoked (an old
        identity after a rekey, or a revoked node's): the CA alone still trusts those."""
        serial = format(x509.load_der_x509_certificate(der).serial_number, "x")
        if serial in self.revoked():
            return (
                f"the data plane of node {node_id} presented certificate {serial}, which was "
                f"revoked; refusing it (the node must join again: llmgw ctl join-command "
                f"--node {node_id})"
            )
        return None

    def retrust(self, client_ssl: ssl.SSLContext) -> None:
        if self._session is not None:
            self._session.retrust(client_ssl)

    def forget_node(self, node_id: str) -> None:
        if self._session is not None:
            self._session.forget(node_id)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _hostport(self, addr: str) -> tuple[str, int]:
        hostport = self._hostports.get(addr)
        if hostport is None:
            try:
                hostport = self._hostports[addr] = parse_hostport(addr)
            except ConfigError as exc:
                raise UpstreamConnectError(f"data plane address {addr!r}: {exc}") from exc
        return hostport

    # -- one request ---------------------------------------------------------------------------

    async def forward(
        self, req: ModelRequest, ep: Endpoint, charge: Charge, may_retry: bool = False
    ) -> web.StreamResponse:
        """``req`` sent to ``ep`` and its answer relayed; :class:`ConnectFailed` when the
        replica did not take it; with ``may_retry``, :class:`AnswerFailed` when it failed
        before a byte of its answer reached the client."""
        labels = (ep.model, ep.replica_id)
        metrics = self.metrics
        outcome = charge.outcome
        metrics.inflight.inc(labels)
        status = 0
        ttft: float | None = None
        try:
            upstream = await self._send(req, ep, outcome)
            try:
                if req.on_head is not None:  # a decode's watch for its first token
                    await req.on_head(upstream)
                status = outcome.engine_status = upstream.status
                headers = charge.rate_headers()
                if req.stream and upstream.content_type == "text/event-stream":
                    resp, ttft = await self._relay_stream(req, ep, upstream, outcome, headers)
                    if resp.get(STREAM_ERROR) is not None:
                        status = 502
                else:
                    if may_retry and upstream.status == 502:
                        failed = upstream.header(ENGINE_FAILED)
                        if failed is not None:
                            status = 502
                            await upstream.read()
                            raise AnswerFailed(
                                f"the engine of {ep.replica_id} failed mid-answer ({failed})",
                                f"engine_{'timeout' if failed == 'timeout' else 'reset'}",
                            )
                    resp = await relay(
                        req.http,
                        upstream,
                        on_chunk=lambda b: self._count_body_tokens(ep, b, outcome),
                        extra_headers=headers,
                    )
                    if req.cached is not None and resp.status == 200:
                        _rewrite_cached(resp, req.cached)
            finally:
                # Back to the pool when read to the end, else closed: a cancelled handler
                # (the client went away) closes the connection, and the agent sees it.
                upstream.release()
            return resp
        except UpstreamError as exc:
            status = 502
            if may_retry and not isinstance(exc, UpstreamTooLarge):
                # Before a byte of the answer reached the client (a body read whole, or the
                # status line): another replica may answer it whole.
                cause = "timeout" if isinstance(exc, UpstreamTimeout) else "reset"
                if isinstance(exc, UpstreamProtocolError):
                    cause = "protocol"
                raise AnswerFailed(f"{ep.replica_id} failed mid-answer: {exc}", cause) from exc
            return openai_error(
                502,
                f"The replica {ep.replica_id} failed mid-request: {exc}",
                type_="server_error",
                code="upstream_timeout" if isinstance(exc, UpstreamTimeout) else "upstream_error",
            )
        finally:
            metrics.inflight.dec(labels)
            if status:
                outcome.status = status
                metrics.requests.inc((ep.model, ep.replica_id, str(status)))
                metrics.latency.observe(labels, time.perf_counter() - req.started)
                if self.history is not None:
                    self.history.record(ep.model, ttft=ttft, error=status >= 500)

    async def fetch(self, req: ModelRequest, ep: Endpoint, outcome: Outcome) -> tuple[int, bytes]:
        """``req`` sent to ``ep`` and its answer read whole for the gateway itself, not
        relayed (a disaggregated model's prefill): its status and body, its usage counted into
        ``outcome`` and the pool's metrics. :class:`ConnectFailed` when the replica did not
        take it; :class:`~llmgw.http.errors.UpstreamError` when it failed answering."""
        labels = (ep.model, ep.replica_id)
        metrics = self.metrics
        metrics.inflight.inc(labels)
        status = 0
        try:
            upstream = await self._send(req, ep, outcome)
            try:
                status = upstream.status
                body = await upstream.read()
            finally:
                upstream.release()
            if status < 400:
                self._count_body_tokens(ep, body, outcome)
            return status, body
        except UpstreamError:
            status = 502
            raise
        finally:
            metrics.inflight.dec(labels)
            if status:
                metrics.requests.inc((ep.model, ep.replica_id, str(status)))
                metrics.latency.observe(labels, time.perf_counter() - req.started)

    async def _send(self, req: ModelRequest, ep: Endpoint, outcome: Outcome) -> UpstreamResponse:
        """The agent's answer to ``req``'s POST, its status and headers read."""
        body = req.body
        try:
            host, port = self._hostport(ep.addr)
            # From here the engine may be working on it (a client that leaves still pays for
            # its prompt), unless the agent says it never passed it on.
            outcome.handed = True
            upstream = await self.session.request(
                "POST",
                host,
                port,
                f"/s/{ep.shard_id}{req.path}",
                body=body,
                # The body asking for usage may be a few bytes over the model's limit.
                headers=(
                    *_JSON_HEADERS,
                    (MAX_BODY_HEADER, str(max(req.body_limit, len(body)))),
                ),
                server_hostname=ep.node_id,
            )
        except UpstreamError as exc:
            if exc.retryable:  # not a byte of answer: another replica may take it
                outcome.handed = False
                raise ConnectFailed(str(exc)) from exc
            raise
        if upstream.status in (502, 503) and upstream.header(NOT_PROCESSED):
            # The agent did not hand it to an engine (it is draining, has no room for the
            # body, or its engine refused the connection: stopping): another replica may
            # take it, as if the connection had been refused.
            busy = upstream.header("Retry-After") is not None
            upstream.release()
            why = (
                "its engine is not accepting"
                if upstream.status == 502
                else "no room for the body"
                if busy
                else "draining"
            )
            outcome.handed = False
            raise ConnectFailed(f"{ep.node_id} did not process the request ({why})", busy)
        return upstream

    async def _relay_stream(
        self,
        req: ModelRequest,
        ep: Endpoint,
        upstream: UpstreamResponse,
        outcome: Outcome,
        headers: dict[str, str] | None,
    ) -> tuple[web.StreamResponse, float | None]:
        """An event stream relayed, its tokens counted; with the time to its first token."""
        outcome.streamed = True
        counter = StreamTokenCounter()
        feed = counter.feed
        hint = req.hint
        if hint is not None and hint.charged_to is not None:
            # The prefill queued on the replica ends with the first token.
            def feed(chunk: bytes) -> None:
                counter.feed(chunk)
                if counter.first_at is not None:
                    hint.settle()

        try:
            resp = await relay(
                req.http,
                upstream,
                on_chunk=feed,
                extra_headers=headers,
                drop_usage=req.drop_usage,
                events=req.splice,
                usage=None if req.cached is None else partial(with_cached, req.cached),
            )
        finally:
            # Counted also when the client left mid-stream (the handler cancelled).
            self._count_stream_tokens(ep, counter, outcome, req.splice)
        failed = resp.get(STREAM_ERROR)
        if failed is not None and req.splice is not None and req.splice.goes_on(failed):
            log.warning(
                "a stream broke; resuming it on another replica",
                extra=kv(
                    model=ep.model,
                    shard=ep.shard_id,
                    request=req.splice.id,
                    sent=req.splice.sent,
                    error=str(failed),
                ),
            )
        elif failed is not None:
            log.warning(
                "a stream ended early",
                extra=kv(model=ep.model, shard=ep.shard_id, error=str(failed)),
            )
        ttft = None
        if counter.first_at is not None:
            ttft = counter.first_at - req.started
            self.metrics.ttft.observe((ep.model, ep.replica_id), ttft)
        return resp, ttft

    def _count_body_tokens(self, ep: Endpoint, body: bytes, outcome: Outcome) -> None:
        usage = body_usage(body)
        if usage is not None:
            self._add_usage(ep, usage, outcome)

    def _count_stream_tokens(
        self,
        ep: Endpoint,
        counter: StreamTokenCounter,
        outcome: Outcome,
        splice: StreamSplice | None = None,
    ) -> None:
        usage = counter.usage
        if splice is not None and splice.part > 0:
            # A resumed part: the outcome is the whole stream's (its usage summed with the
            # parts before, StreamSplice.summed); the metrics get what this part adds, the
            # parts before having counted their tokens already.
            if usage is not None:
                whole = splice.summed(usage)
                self._add_usage(ep, whole, outcome, counted=splice.before)
            else:
                outcome.completion = splice.sent
                self.metrics.tokens.inc((ep.model, "completion"), counter.events)
            return
        if usage is not None:
            self._add_usage(ep, usage, outcome)
        else:
            # No usage in the stream (cut short, or an engine that does not report it):
            # each content event is a token; the prompt is charged its estimate.
            outcome.completion = counter.events
            self.metrics.tokens.inc((ep.model, "completion"), counter.events)

    def _add_usage(
        self, ep: Endpoint, usage: dict[str, Any], outcome: Outcome, counted: int = 0
    ) -> None:
        """``usage`` is the request's; ``counted``: completion tokens the metrics have had
        already (a resumed stream's parts before)."""
        prompt, completion, cached = usage_numbers(usage)
        outcome.prompt, outcome.completion, outcome.cached = prompt, completion, cached
        outcome.reported = True
        model = ep.model
        tokens = self.metrics.tokens
        tokens.inc((model, "prompt"), prompt)
        tokens.inc((model, "completion"), completion - counted)
        if cached:
            tokens.inc((model, "cached"), cached)
        if prompt:
            by_replica = self.metrics.replica_tokens
            by_replica.inc((model, ep.replica_id, "prompt"), prompt)
            by_replica.inc((model, ep.replica_id, "cached"), min(cached, prompt))


def _rewrite_cached(resp: web.StreamResponse, cached: int) -> None:
    """A whole answer's usage says ``cached`` prompt tokens were cached (ModelRequest.cached)."""
    if not isinstance(resp, web.Response):
        return
    body = resp.body
    if not isinstance(body, bytes) or b'"usage"' not in body:
        return
    try:
        payload = json.loads(body)
    except ValueError:
        return
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if isinstance(usage, dict):
        with_cached(cached, usage)
        resp.body = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
