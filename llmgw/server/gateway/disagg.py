"""A disaggregated model's requests: the gateway's hand-over from a replica of its prefill pool
to one of its decode pool (:mod:`llmgw.contracts.disagg`), in the protocol its engine speaks.

- ``vllm`` (vLLM's NixlConnector, and the sim), as vLLM's own proxy does it: the client's
  body is sent to a prefill replica asking for a remote decode (``kv_transfer_params`` with
  ``do_remote_decode``; ``stream`` false, ``max_tokens`` 1, no ``stream_options``) and read
  whole; then the client's own body with the ``kv_transfer_params`` the prefill answered goes
  to a decode replica, which pulls the KV blocks and generates; its answer is the client's.
- ``sglang``, as SGLang's router does it: the client's body with the prefill replica's
  bootstrap address (:attr:`~llmgw.server.gateway.routing.Endpoint.transfer_addr`) and a
  random ``bootstrap_room`` goes to both replicas at once; the decode's answer is the
  client's, the prefill's is read and dropped.

The prefill replica is the one the model's routing chooses among the prefill pool's (its KV
events are indexed under the pool's name) and takes a place there through the admission
(queued per pool); the decode replica is the decode pool's with the fewest output tokens to
generate (:attr:`~llmgw.server.gateway.routing.Endpoint.decoding`). The decode goes down the
gateway's ordinary path (:meth:`Gateway._route`), so a decode replica that fails before its
first byte gets the request again whole (recomputed, no KV to pull) on another, and a
stream that breaks after its first tokens is resumed on another (:mod:`.resume`).

What fails: a prefill that fails (not taken, reset, 5xx, timed out) is sent to another
prefill replica, at most :data:`MAX_PREFILL_TRIES` in all; with no prefill replica ready (the
pool at zero while it scales up, every one tried failed) or none free within queue_timeout,
the request runs whole on a decode replica (the aggregated fallback); so does a streamed
decode whose first token does not come within the profile's ``transfer_timeout`` (the
transfer never completed: the decode is cancelled). A non-streamed decode shows no first
token before its whole answer: a transfer that fails under it is the engine's to recompute
(vLLM's and the sim's kv_load_failure_policy), one that hangs ends at upstream_idle_timeout
and is sent again whole to another decode replica, if one is ready. A prefill's 4xx is the
request's own fault: the client gets it. Each fallback is counted (``llmgw_disagg_fallbacks_total``) and
logged with the request's id.

The client sees one ordinary answer: the decode's, whose usage counts the prompt once and
the decode's completion; the key is charged once, with the prefill's cached tokens as the
prompt's cached, in the answer's ``prompt_tokens_details`` (streamed or not).

What a hand-over moved is counted per model: the prompt tokens whose KV the decode took
rather than computed (``llmgw_disagg_transfer_tokens_total``: the prompt tokens the prefill
reported, SGLang's from the decode's usage; a decode whose own prefix cache held part of
the prompt pulls less, which no engine reports per request) and, where the model's KV bytes per token are known (:class:`Handover`), the bytes
(``llmgw_disagg_transfer_bytes_total``). The engines report no bytes per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from aiohttp import web

from llmgw.contracts.disagg import split_pool
from llmgw.errors import ConfigError
from llmgw.http.errors import UpstreamError
from llmgw.http.response import UpstreamResponse
from llmgw.log import kv
from llmgw.netaddr import parse_hostport
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.capacity import Capacity
from llmgw.server.gateway.forwarding import ConnectFailed, Forwarder
from llmgw.server.gateway.metering import Outcome
from llmgw.server.gateway.modelrequest import Charge, ModelRequest
from llmgw.server.gateway.queueing import Admission, QueueTimeout
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import Handover, ServingCache

__all__ = [
    "HANDOVER_PATHS",
    "MAX_PREFILL_TRIES",
    "Disagg",
    "GatewayParts",
    "PrefillFailed",
    "TransferTimeout",
    "charge_decoding",
    "prefill_body",
]

log = logging.getLogger("llmgw.server.gateway")

HANDOVER_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The endpoints handed over (those vLLM's proxy and SGLang's router hand over); a
disaggregated model's other requests run whole on a decode replica."""
MAX_PREFILL_TRIES = 3
"""Prefill replicas one request is sent to at most before it runs whole on a decode one."""

# What vLLM's proxy asks a prefill for: compute the prompt and keep its KV blocks for a
# remote decode (vLLM's kv_transfer_params; the remote_* fields name the decode side, unknown).
_PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class TransferTimeout(Exception):
    """A decode replica's first token did not come within the transfer_timeout."""


class PrefillFailed(Exception):
    """The prefill sent beside a decode (SGLang's hand-over) failed before the decode's first
    token: the pair is sent again with another prefill replica."""


def charge_decoding(metrics: Metrics, ep: Endpoint, tokens: int) -> None:
    """``tokens`` more (or, negative, fewer) output tokens to generate on ``ep``."""
    ep.decoding += tokens
    metrics.decoding_tokens.set((ep.model, ep.replica_id), ep.decoding)


def prefill_body(body: bytes) -> bytes:
    """The prefill's body for the client's ``body``, as vLLM's proxy makes it: the remote
    decode asked for, one token, not streamed, without stream_options and the minimum
    lengths a prefill does not take."""
    payload = json.loads(body)
    payload["kv_transfer_params"] = dict(_PREFILL_PARAMS)
    payload["stream"] = False
    payload["max_tokens"] = 1
    if "max_completion_tokens" in payload:
        payload["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        payload.pop(name, None)
    return _dumps(payload)


def _with(body: bytes, fields: Mapping[str, Any]) -> bytes:
    payload = json.loads(body)
    payload.update(fields)
    return _dumps(payload)


def _dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class _Prefilled:
    """A prefill's answer: the KV it names for the decode (None: none), the prompt tokens
    its cache held, when it came (time.perf_counter()) and the prompt's tokens it reported
    (0: none)."""

    params: dict[str, Any] | None
    cached: int
    answered: float
    prompt: int = 0


class _FirstToken:
    """A streamed decode's watch (ModelRequest.on_head): its first bytes within
    ``timeout`` of its status line, else :class:`TransferTimeout`; with SGLang's hand-over,
    :class:`PrefillFailed` when the prefill beside it fails first. Observes the hand-over's
    time (the prefill's answer to the first token)."""

    def __init__(
        self,
        metrics: Metrics,
        model: str,
        timeout: float,
        answered: float | None,
        prefill: asyncio.Future[float] | None = None,
    ) -> None:
        self.metrics = metrics
        self.model = model
        self.timeout = timeout
        self.answered = answered
        self.prefill = prefill
        self.through = False  # its first bytes came: the hand-over is done

    async def __call__(self, upstream: UpstreamResponse) -> None:
        if upstream.status >= 400 or upstream.content_type != "text/event-stream":
            return  # a refusal, or an answer read whole: nothing to watch
        body = asyncio.ensure_future(upstream.until_body())
        try:
            waiting: set[asyncio.Future[Any]] = {body}
            prefill = self.prefill
            if prefill is not None and not prefill.done():
                waiting.add(prefill)
            deadline = time.perf_counter() + self.timeout
            while not body.done():
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TransferTimeout(f"no first token within {self.timeout:g} s")
                await asyncio.wait(waiting, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if prefill is not None and prefill in waiting and prefill.done():
                    waiting.discard(prefill)
                    if prefill.cancelled() or prefill.exception() is not None:
                        raise PrefillFailed(str(prefill.exception() or "cancelled"))
            body.result()
        finally:
            body.cancel()
        self.through = True
        answered = self.answered
        if self.prefill is not None and self.prefill.done() and not self.prefill.exception():
            answered = self.prefill.result()
        if answered is not None:
            seconds = max(0.0, time.perf_counter() - answered)
            self.metrics.disagg_handover.observe((self.model,), seconds)


class GatewayParts(Protocol):
    """What the hand-over uses of its gateway (:class:`~llmgw.server.gateway.gateway.Gateway`):
    its replicas, places, last hop, models, demand and settings, and its ordinary path for one
    model's request (``_route``: placed, forwarded, retried, resumed)."""

    router: Router
    admission: Admission
    forwarder: Forwarder
    serving: ServingCache
    capacity: Capacity
    metrics: Metrics

    @property
    def settings(self) -> Any: ...

    async def _route(self, req: ModelRequest, charge: Charge) -> web.StreamResponse: ...


class Disagg:
    """The hand-over of one gateway's requests to disaggregated models."""

    def __init__(self, gateway: GatewayParts) -> None:
        self.gw = gateway
        self.metrics = gateway.metrics
        # Pools at zero woken by demand (a cold start waited for in the background while
        # their requests run whole on a decode replica), by name.
        self._waking: dict[str, asyncio.Task[bool]] = {}

    def close(self) -> None:
        for task in self._waking.values():
            task.cancel()
        self._waking.clear()

    async def serve(
        self, req: ModelRequest, charge: Charge, handover: Handover
    ) -> web.StreamResponse:
        """``req`` to a disaggregated model, answered through its pools."""
        rid = req.splice.id if req.splice is not None and req.splice.id else uuid.uuid4().hex[:16]
        if req.path not in HANDOVER_PATHS:
            return await self._whole(req, charge, handover, "endpoint", rid)
        if handover.protocol == "sglang":
            return await self._sglang(req, charge, handover, rid)
        return await self._vllm(req, charge, handover, rid)

    # -- vLLM's: prefill, then decode with what it answered ---------------------------------

    async def _vllm(
        self, req: ModelRequest, charge: Charge, handover: Handover, rid: str
    ) -> web.StreamResponse:
        # The prefill weighs its prompt on its pool (the planner's figure for target_tokens).
        preq = replace(
            req,
            model=handover.prefill,
            body=prefill_body(req.body),
            stream=False,
            tokens=charge.estimate.prompt,
        )
        prefilled = await self._prefill(preq, handover, rid)
        if isinstance(prefilled, str):
            return await self._whole(req, charge, handover, prefilled, rid)
        if isinstance(prefilled, web.Response):
            charge.outcome.status = prefilled.status
            return prefilled
        if prefilled.params is None:
            return await self._whole(req, charge, handover, "no_transfer_params", rid)
        watch = None
        if req.stream:
            watch = _FirstToken(
                self.metrics, req.model, handover.transfer_timeout, prefilled.answered
            )
        decode = self._decode_request(
            req, charge, handover, _with(req.body, {"kv_transfer_params": prefilled.params})
        )
        decode = replace(decode, cached=prefilled.cached)
        try:
            answer = await self.gw._route(replace(decode, on_head=watch), charge)
        except TransferTimeout as exc:
            return await self._whole(req, charge, handover, "transfer_timeout", rid, str(exc))
        return self._handed_over(req, charge, handover, answer, prefilled.cached, prefilled.prompt)

    async def _prefill(
        self, preq: ModelRequest, handover: Handover, rid: str
    ) -> _Prefilled | web.Response | str:
        """The prefill's answer; a 4xx (the request's own fault, the client's answer); or
        the reason it runs whole on a decode replica."""
        tried: set[str] = set()
        for attempt in range(MAX_PREFILL_TRIES):
            ep = await self._prefill_place(preq, handover, tried)
            if isinstance(ep, str):
                return ep
            tried.add(ep.shard_id)
            began = time.perf_counter()
            outcome = Outcome()
            try:
                status, body = await self.gw.forwarder.fetch(preq, ep, outcome)
                failure = f"it answered {status}" if status >= 500 else ""
            except (ConnectFailed, UpstreamError) as exc:
                failure, status, body = str(exc), 0, b""
            finally:
                self.gw.admission.release(ep, preq.hint, preq.tokens)
            model = _client_model(handover.prefill)
            self.metrics.disagg_prefill.observe((model,), time.perf_counter() - began)
            if not failure:
                if status >= 400:
                    return web.Response(status=status, body=body, content_type="application/json")
                return _Prefilled(
                    _kv_params(body), outcome.cached, time.perf_counter(), outcome.prompt
                )
            again = attempt + 1 < MAX_PREFILL_TRIES and self.gw.router.has_ready(
                handover.prefill, frozenset(tried)
            )
            if again:
                self.metrics.disagg_prefill_retries.inc((model,))
            log.warning(
                "a prefill failed; trying another prefill replica"
                if again
                else "a prefill failed; no other prefill replica to try",
                extra=kv(model=model, request=rid, shard=ep.shard_id, error=failure),
            )
        return "no_prefill"

    async def _prefill_place(
        self, preq: ModelRequest, handover: Handover, tried: set[str]
    ) -> Endpoint | str:
        """A place on a prefill replica not among ``tried`` (its routing's choice, queued
        while all are full), or why there is none: no_prefill (none ready: a pool at zero
        is woken meanwhile), prefill_busy (none free within queue_timeout)."""
        gw, pool, exclude = self.gw, handover.prefill, frozenset(tried)
        ep = gw.admission.try_acquire(pool, exclude, preq.hint, preq.tokens)
        if ep is not None:
            return ep
        if not gw.router.has_ready(pool, exclude):
            if not tried:
                self._wake(pool)
            return "no_prefill"
        key = preq.key
        try:
            return await gw.admission.acquire(
                pool,
                key.id,
                key.policy.weight,
                exclude,
                gw.settings.queue_timeout,
                preq.hint,
                preq.tokens,
            )
        except QueueTimeout:
            return "prefill_busy"

    def _wake(self, pool: str) -> None:
        """A pool that scales by demand and has no replica ready: its demand is counted
        (Capacity.wait) so that the planner starts one, while the requests run whole."""
        timeout = self.gw.serving.cold_start_timeout(pool)
        if timeout is None or pool in self._waking:
            return
        task = asyncio.ensure_future(self.gw.capacity.wait(pool, timeout))
        self._waking[pool] = task

        def done(t: asyncio.Task[bool]) -> None:
            if self._waking.get(pool) is t:
                del self._waking[pool]
            if not t.cancelled():
                t.exception()  # NoRoom: the scheduler says why; the decode answers meanwhile

        task.add_done_callback(done)

    # -- SGLang's: both at once, the prefill's bootstrap address and a room -----------------

    async def _sglang(
        self, req: ModelRequest, charge: Charge, handover: Handover, rid: str
    ) -> web.StreamResponse:
        base = replace(req, model=handover.prefill, stream=False, tokens=charge.estimate.prompt)
        model = req.model
        tried: set[str] = set()
        for attempt in range(MAX_PREFILL_TRIES):
            ep = await self._prefill_place(base, handover, tried)
            if isinstance(ep, str):
                return await self._whole(req, charge, handover, ep, rid)
            tried.add(ep.shard_id)
            try:
                host, port = parse_hostport(ep.transfer_addr, what="transfer address")
            except ConfigError as exc:
                self.gw.admission.release(ep, base.hint, base.tokens)
                return await self._whole(req, charge, handover, "no_transfer_addr", rid, str(exc))
            body = _with(
                req.body,
                {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room()},
            )
            prefill = asyncio.ensure_future(self._sglang_prefill(replace(base, body=body), ep))
            prefill.add_done_callback(_failure)  # its failure read, whoever reads it first
            watch = None
            if req.stream:
                watch = _FirstToken(
                    self.metrics, model, handover.transfer_timeout, None, prefill=prefill
                )
            decode = replace(self._decode_request(req, charge, handover, body), on_head=watch)
            decoding = asyncio.ensure_future(self.gw._route(decode, charge))
            try:
                await asyncio.wait({decoding, prefill}, return_when=asyncio.FIRST_COMPLETED)
                if not decoding.done() and (watch is None or not watch.through):
                    failed = _failure(prefill)
                    if failed is not None:  # no KV will come: the decode waits in vain
                        decoding.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await decoding
                        raise PrefillFailed(failed)
                answer = await decoding
            except PrefillFailed as exc:
                prefill.cancel()
                if attempt + 1 < MAX_PREFILL_TRIES:
                    self.metrics.disagg_prefill_retries.inc((model,))
                log.warning(
                    "an SGLang prefill failed before its decode's first token; trying another",
                    extra=kv(model=model, request=rid, shard=ep.shard_id, error=str(exc)),
                )
                continue
            except TransferTimeout as exc:
                prefill.cancel()
                return await self._whole(req, charge, handover, "transfer_timeout", rid, str(exc))
            except BaseException:
                decoding.cancel()
                prefill.cancel()
                raise
            if answer.status < 400:
                # The prefill answered before its decode's last token, or is about to: a
                # while is left for it (a refused decode's prefill has nobody to send to).
                with contextlib.suppress(Exception):
                    await asyncio.wait({prefill}, timeout=handover.transfer_timeout)
            prefill.cancel()
            return self._handed_over(req, charge, handover, answer, None)
        return await self._whole(req, charge, handover, "no_prefill", rid)

    async def _sglang_prefill(self, preq: ModelRequest, ep: Endpoint) -> float:
        """The prefill beside a decode, read whole and dropped; when it answered
        (time.perf_counter()), or why it failed (:class:`PrefillFailed`)."""
        began = time.perf_counter()
        try:
            status, _body = await self.gw.forwarder.fetch(preq, ep, Outcome())
        except (ConnectFailed, UpstreamError) as exc:
            raise PrefillFailed(f"{ep.replica_id}: {exc}") from exc
        finally:
            self.gw.admission.release(ep, preq.hint, preq.tokens)
            seconds = time.perf_counter() - began
            self.metrics.disagg_prefill.observe((_client_model(preq.model),), seconds)
        if status >= 400:
            raise PrefillFailed(f"{ep.replica_id} answered {status}")
        return time.perf_counter()

    # -- the decode, and the whole request on it ---------------------------------------------

    def _decode_request(
        self, req: ModelRequest, charge: Charge, handover: Handover, body: bytes
    ) -> ModelRequest:
        return replace(
            req,
            model=handover.decode,
            body=body,
            whole=req.body,
            hint=None,
            retries=max(req.retries, 1),
            decoding=charge.estimate.output,
        )

    def _handed_over(
        self,
        req: ModelRequest,
        charge: Charge,
        handover: Handover,
        answer: web.StreamResponse,
        cached: int | None,
        prompt: int = 0,
    ) -> web.StreamResponse:
        """The decode's ``answer``; the key charged the prefill's ``cached`` tokens (None:
        the decode's own), as the client's usage says (ModelRequest.cached); the tokens and
        bytes moved counted (``prompt``: the prefill's prompt tokens, 0: not reported)."""
        ended = "handed_over" if answer.status < 400 else "failed"
        self.metrics.disagg_requests.inc((req.model, ended))
        outcome = charge.outcome
        if ended == "handed_over":
            self._moved(req.model, handover, outcome, prompt)
        if cached is not None and outcome.reported:
            outcome.cached = min(cached, outcome.prompt) if outcome.prompt else cached
        return answer

    def _moved(self, model: str, handover: Handover, outcome: Outcome, prompt: int) -> None:
        """Count what a hand-over moved: ``prompt``, the prompt tokens the prefill reported
        (SGLang's prefill answer is dropped: the decode's usage). The decode's
        own cached tokens cannot stand in: its usage is rewritten to the prefill's (the
        client's), and an engine does not tell its own prefix cache from pulled blocks."""
        tokens = prompt or (outcome.prompt if outcome.reported else 0)
        if tokens <= 0:
            return
        self.metrics.disagg_transfer_tokens.inc((model,), tokens)
        if handover.kv_bytes_per_token is not None:
            self.metrics.disagg_transfer_bytes.inc((model,), tokens * handover.kv_bytes_per_token)

    async def _whole(
        self,
        req: ModelRequest,
        charge: Charge,
        handover: Handover,
        reason: str,
        rid: str,
        detail: str = "",
    ) -> web.StreamResponse:
        """``req`` run whole on a decode replica (the aggregated fallback)."""
        self.metrics.disagg_requests.inc((req.model, "fallback"))
        self.metrics.disagg_fallbacks.inc((req.model, reason))
        log.log(
            logging.INFO if reason == "endpoint" else logging.WARNING,
            "a disaggregated model's request runs whole on a decode replica",
            extra=kv(model=req.model, request=rid, reason=reason, path=req.path, error=detail),
        )
        whole = replace(req, model=handover.decode, hint=None, decoding=charge.estimate.output)
        return await self.gw._route(whole, charge)


def room() -> int:
    """A bootstrap room: random, 63 bits (as SGLang's router draws it)."""
    return secrets.randbits(63)


def _client_model(pool: str) -> str:
    """The model clients name, for one of its pools."""
    named = split_pool(pool)
    return named[0] if named is not None else pool


def _failure(task: asyncio.Future[Any]) -> str | None:
    """Why ``task`` (a prefill) failed; None while it runs, or when it answered."""
    if not task.done():
        return None
    if task.cancelled():
        return "cancelled"
    exc = task.exception()
    return None if exc is None else str(exc)


def _kv_params(body: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a prefill answered (None: none, or not a mapping)."""
    with contextlib.suppress(ValueError, AttributeError):
        params = json.loads(body).get("kv_transfer_params")
        if isinstance(params, dict) and params:
            return params
    return None
