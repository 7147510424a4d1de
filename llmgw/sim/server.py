"""The built-in simulated inference engine ``sim``.

An OpenAI-compatible HTTP server that needs no GPU and no weights: it answers
``/v1/chat/completions`` and ``/v1/completions`` with words drawn from a fixed
vocabulary, deterministically for a given (seed, prompt), at a configurable
speed (``ttft_ms`` before the first token, ``tps`` tokens per second after it).
The text comes from :mod:`llmgw.sim.generate`, the settings from :mod:`llmgw.sim.config`.
It is what the tests run against and the baseline of the latency benchmark, so
the request path is kept lean: everything that does not depend on the request
is computed once in :func:`build_app`, and stream chunks are assembled from
pre-serialised pieces. The other endpoints live beside it: the Responses API in
:mod:`llmgw.sim.responses`, embeddings, rerank, score and the tokenizer in
:mod:`llmgw.sim.pooling`; what they share (errors, the body's check) in
:mod:`llmgw.sim.protocol`; a chat or completions request's prompts and options are read by
:mod:`llmgw.sim.request`.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /v1/models/{id}``,
``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/responses``,
``POST /v1/embeddings``, ``POST /v1/rerank``, ``POST /v1/score``, ``POST /tokenize``,
``POST /detokenize``, ``POST /reset_prefix_cache`` (as vLLM's: the prefix cache emptied);
with ``sleep_mode``, vLLM's sleep routes (:mod:`llmgw.sim.sleep`). It serves all of them whatever the catalog profile's ``task``
says: the gateway routes each path only to replicas deployed for its task.

The prefix cache and the cost of a prompt: chat and completions prompts (each prompt of a
list; with ``n`` > 1 once per prompt) go through the engine's prefix cache
(:mod:`llmgw.sim.kvcache`), whose changes are published as vLLM's KV cache events when
``kv_events_config`` asks for them (:mod:`llmgw.sim.publisher`). ``usage.prompt_tokens`` is
the prompts' length by the sim's tokenizer and ``usage.prompt_tokens_details.cached_tokens``
the tokens found cached, as vLLM reports them. Prefill is modelled as a GPU does it,
compute-bound and one request at a time: each request's uncached prompt tokens cost
``prefill_us_per_token`` each on the engine's one prefill lane, served in arrival order in
virtual time (start = max(arrival, lane free), lane free = start + cost; the request sleeps
until then, and one whose client left still used its slot). Its first token comes
``ttft_ms`` after its prefill ends, the others at ``tps``. So a replica has a finite prefill
capacity and a queue builds under load, which is what cache-aware routing saves. The
Responses API stays outside the cache: its prompts cost no prefill and report no cached
tokens.

With ``step_model`` the lane gives way to one loop of steps (:mod:`llmgw.sim.steps`): the
prefill and every stream's tokens share the steps, so prefill work stalls decoding as in a
batched engine. ``GET /metrics`` shows the KV transfer counters.

Disaggregated prefill/decode (:mod:`llmgw.sim.handover`, over :mod:`llmgw.sim.transfer`): a
request's ``kv_transfer_params`` make the engine a prefill that keeps the prompt's blocks and
names them in its answer, or a decode that pulls them over TCP instead of paying the prefill
(and recomputes the prompt when the pull fails), as vLLM's NixlConnector does.

Resuming (what the gateway does with a stream whose replica died): a chat request with
``continue_final_message`` (and ``add_generation_prompt`` false) continues the assistant's
final message, and a completions prompt that ends in the engine's own answer so far to what
precedes it continues that answer; for the seed, the text is what the uninterrupted answer
would have carried (:func:`llmgw.sim.generate.resume`). ``usage.prompt_tokens`` counts the
prompt and the text given back. The bad combinations are refused as vLLM refuses them (400,
``BadRequestError``): both flags true, or a final message that is not the assistant's.

Multi-node (``nodes`` > 1): the replica assembles over TCP first
(:mod:`llmgw.sim.rendezvous`). Rank 0 binds ``dist_init_addr`` and opens its HTTP port
only once every worker has joined, so its ``/health`` answers only for a whole replica; it
exits with an error naming the rank when a worker goes away. Workers serve nothing: they
join, log ``rank R joined rank 0 at HOST:PORT``, and stay until rank 0 goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from llmgw.engines.kvevents import Event
from llmgw.errors import EngineError
from llmgw.loop import run as run_loop
from llmgw.netaddr import parse_hostport
from llmgw.sim.config import SimConfig
from llmgw.sim.generate import TOKEN_JSON, tokenize
from llmgw.sim.handover import PARAM as KV_PARAM
from llmgw.sim.handover import Handover, Role
from llmgw.sim.kvcache import PrefixCache
from llmgw.sim.pooling import PoolingHandlers
from llmgw.sim.probe import probe_paths
from llmgw.sim.protocol import (
    DISCONNECT_POLL_S,
    SSE_HEADERS,
    BadRequest,
    answer_limit,
    dumps,
    error_response,
    gone,
    parse_body,
    unknown_model_message,
)
from llmgw.sim.publisher import EventPublisher
from llmgw.sim.rendezvous import Leader, Worker
from llmgw.sim.request import parse_options, parse_prompts
from llmgw.sim.responses import ResponsesHandlers
from llmgw.sim.sleep import SleepMode
from llmgw.sim.steps import StepLoop, StepPace

log = logging.getLogger("llmgw.engine.sim")

_MAX_BODY_BYTES = 64 * 1024 * 1024
_SHUTDOWN_GRACE_S = 5.0

_SSE_DONE = b"data: [DONE]\n\n"


# --------------------------------------------------------------------------- the server


class _Handlers:
    """Request handlers of one engine; holds everything computed once per app."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.ttft_s = cfg.ttft_ms / 1000.0
        self.interval_s = 1.0 / cfg.tps if cfg.tps > 0 else 0.0
        self.model_json = json.dumps(cfg.model)
        model_obj = {
            "id": cfg.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llmgw",
        }
        self.model_body = dumps(model_obj).encode()
        self.models_body = dumps({"object": "list", "data": [model_obj]}).encode()
        self.health_body = b'{"status":"ok"}'
        self.cache = PrefixCache(cfg.block_size, cfg.kv_blocks)
        self.publisher: EventPublisher | None = None  # set while the app runs
        self.prefill_s_per_token = cfg.prefill_us_per_token / 1e6
        # The loop time the prefill lane is next free at (see the module docstring).
        self.lane_free_at = 0.0
        self.handover = Handover(cfg)
        # The step model's loop (llmgw.sim.steps), started with the app; None: the lane.
        self.steps: StepLoop | None = None

    # ----------------------------------------------------------------- simple endpoints

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.health_body, content_type="application/json")

    async def models(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.models_body, content_type="application/json")

    async def model(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["model_id"]
        if name != self.cfg.model:
            return error_response(
                404, unknown_model_message(name, self.cfg.model), "model", "model_not_found"
            )
        return web.Response(body=self.model_body, content_type="application/json")

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        # vLLM's POST /reset_prefix_cache: every block dropped, AllBlocksCleared published.
        events = self.cache.clear()
        if events and self.publisher is not None:
            self.publisher.publish(events)
        return web.Response(status=200)

    # ----------------------------------------------------------------- completions

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def _complete(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        raw = await request.read()
        try:
            body = parse_body(raw, self.cfg.model)
            opts = parse_options(body, self.cfg, chat=chat)
            prompts = parse_prompts(body, chat, opts.seed)
        except BadRequest as e:
            return e.response()

        cfg = self.cfg
        prompt_ids = [tokenize(p.head) + tokenize(p.done) for p in prompts]
        role = None
        if (kv_params := body.get(KV_PARAM)) is not None:
            try:
                role = self.handover.role(
                    kv_params,
                    prompts=len(prompts),
                    n=opts.n,
                    stream=opts.stream,
                    prompt_tokens=sum(len(ids) for ids in prompt_ids),
                )
            except BadRequest as e:
                return e.response()
        try:
            limits = [
                answer_limit(
                    cfg.max_length, cfg.max_tokens, len(ids), opts.max_tokens, opts.limit_name
                )
                for ids in prompt_ids
            ]
        except BadRequest as e:
            return e.response()
        jobs = [
            p.answer(limit, opts, j)
            for p, limit in zip(prompts, limits, strict=True)
            for j in range(opts.n)
        ]
        prompt_tokens = cached = 0
        events: list[Event] = []
        for ids in prompt_ids:
            prompt_tokens += len(ids)
            found = self.cache.lookup(ids)
            cached += found.cached_tokens
            events += found.events
        if events and self.publisher is not None:
            self.publisher.publish(events)
        uncached = prompt_tokens - cached
        if role is not None and role.remote is not None:
            # A remote prefill: the blocks cross the wire instead of being computed here,
            # unless the pull fails and the prompt is recomputed (llmgw.sim.handover).
            if await self.handover.pull(role.remote, prompt_tokens, cached):
                uncached = 0
                cached = max(prompt_tokens - 1, cached)
            t0 = loop.time()
        pace = None
        if self.steps is not None:
            pace = StepPace(self.steps, uncached, self.ttft_s)
            first_at = 0.0
        else:
            # The prefill lane: one request's uncached tokens at a time, in arrival order.
            start = max(t0, self.lane_free_at)
            self.lane_free_at = start + uncached * self.prefill_s_per_token
            first_at = self.lane_free_at + self.ttft_s
        completion_tokens = sum(len(tokens) for tokens, _ in jobs)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        rid = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        created = int(time.time())
        try:
            if opts.stream:
                return await self._stream(
                    request,
                    chat,
                    rid,
                    created,
                    jobs,
                    usage if opts.include_usage else None,
                    first_at,
                    pace,
                )
            return await self._respond(
                request, chat, rid, created, jobs, usage, first_at, pace, role
            )
        finally:
            if pace is not None:
                pace.close()

    async def _respond(
        self,
        request: web.Request,
        chat: bool,
        rid: str,
        created: int,
        jobs: list[tuple[list[str], str]],
        usage: dict[str, Any],
        first_at: float,
        pace: StepPace | None = None,
        role: Role | None = None,
    ) -> web.StreamResponse:
        steps = max(len(tokens) for tokens, _ in jobs)
        if pace is not None:
            for k in range(steps):
                await pace.token(k)
                if gone(request):
                    break
        else:
            deadline = first_at + (steps - 1) * self.interval_s
            loop = asyncio.get_running_loop()
            while (remaining := deadline - loop.time()) > 0:
                if gone(request):
                    break
                await asyncio.sleep(min(remaining, DISCONNECT_POLL_S))
        choices: list[dict[str, Any]]
        if chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "".join(tokens)},
                    "logprobs": None,
                    "finish_reason": finish,
                }
                for i, (tokens, finish) in enumerate(jobs)
            ]
        else:
            choices = [
                {"index": i, "text": "".join(tokens), "logprobs": None, "finish_reason": finish}
                for i, (tokens, finish) in enumerate(jobs)
            ]
        obj: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.cfg.model,
            "choices": choices,
            "usage": usage,
        }
        if role is not None:
            # The prefill keeps its blocks (vLLM's request_finished), unless its client left
            # (vLLM frees an aborted request's); a decode's answer carries null, as vLLM's.
            kept: dict[str, Any] | None = None
            if role.remote is None and not gone(request):
                kept = self.handover.keep(usage["prompt_tokens"], jobs[0][1])
            obj[KV_PARAM] = kept
        return web.Response(body=dumps(obj).encode(), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        rid: str,
        created: int,
        jobs: list[tuple[list[str], str]],
        usage: dict[str, Any] | None,
        first_at: float,
        pace: StepPace | None = None,
    ) -> web.StreamResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = (
            f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
            f'"model":{self.model_json},"choices":[{{"index":'
        )
        if chat:
            token_pre = [f'{head}{i},"delta":{{"content":' for i in range(len(jobs))]
            token_post = '},"logprobs":null,"finish_reason":null}]}\n\n'
            finish_pre = [
                f'{head}{i},"delta":{{}},"logprobs":null,"finish_reason":"'
                for i in range(len(jobs))
            ]
            role = [
                f'{head}{i},"delta":{{"role":"assistant","content":""}},'
                '"logprobs":null,"finish_reason":null}]}\n\n'
                for i in range(len(jobs))
            ]
        else:
            token_pre = [f'{head}{i},"text":' for i in range(len(jobs))]
            token_post = ',"logprobs":null,"finish_reason":null}]}\n\n'
            finish_pre = [
                f'{head}{i},"text":"","logprobs":null,"finish_reason":"' for i in range(len(jobs))
            ]
            role = []
        finish_post = '"}]}\n\n'

        response = web.StreamResponse(headers=SSE_HEADERS)
        loop = asyncio.get_running_loop()
        steps = max(len(tokens) for tokens, _ in jobs)
        try:
            await response.prepare(request)
            for k in range(steps):
                if pace is not None:
                    await pace.token(k)
                elif (delay := first_at + k * self.interval_s - loop.time()) > 0:
                    await asyncio.sleep(delay)
                if gone(request):
                    return response
                events: list[str] = []
                if k == 0:
                    events += role
                for i, (tokens, finish) in enumerate(jobs):
                    if k < len(tokens):
                        token = tokens[k]
                        events.append(
                            token_pre[i] + (TOKEN_JSON.get(token) or json.dumps(token)) + token_post
                        )
                        if k == len(tokens) - 1:
                            events.append(finish_pre[i] + finish + finish_post)
                await response.write("".join(events).encode())
            if usage is not None:
                await response.write(
                    (
                        f'data: {{"id":"{rid}","object":"{obj}","created":{created},'
                        f'"model":{self.model_json},"choices":[],"usage":{dumps(usage)}}}\n\n'
                    ).encode()
                )
            await response.write(_SSE_DONE)
            await response.write_eof()
        except ConnectionResetError:
            log.debug("sim: client went away mid-stream", extra={"id": rid})
        return response


def build_app(cfg: SimConfig) -> web.Application:
    """The aiohttp application of a ``sim`` engine serving ``cfg.model``."""
    sim = _Handlers(cfg)
    # The sleep guard is a middleware only where sleep mode is on: the request path of a
    # sim without it stays as lean as before.
    sleep = SleepMode(cfg) if cfg.sleep_mode else None
    middlewares = [sleep.guard] if sleep is not None else []
    app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=middlewares)
    if sleep is not None:
        app.router.add_routes(sleep.routes())
    app.router.add_get("/health", sim.health)
    app.router.add_get("/v1/models", sim.models)
    app.router.add_get("/v1/models/{model_id:.+}", sim.model)
    app.router.add_post("/v1/chat/completions", sim.chat_completions)
    app.router.add_post("/v1/completions", sim.completions)
    app.router.add_post("/reset_prefix_cache", sim.reset_prefix_cache)
    app.router.add_get("/metrics", sim.handover.metrics)
    app.router.add_routes(ResponsesHandlers(cfg).routes())
    app.router.add_routes(PoolingHandlers(cfg).routes())

    async def kv_events(_app: web.Application) -> AsyncIterator[None]:
        settings = cfg.kv_events
        if settings is not None:
            sim.publisher = EventPublisher(settings)
        try:
            yield
        finally:
            if sim.publisher is not None:
                sim.publisher.close()
                sim.publisher = None

    async def engine_parts(_app: web.Application) -> AsyncIterator[None]:
        # The KV transfer listener and the step loop live as long as the app.
        await sim.handover.open()
        if cfg.step_model:
            sim.steps = StepLoop(sim.interval_s, sim.prefill_s_per_token, cfg.prefill_chunk)
            sim.steps.start()
        try:
            yield
        finally:
            if sim.steps is not None:
                await sim.steps.stop()
                sim.steps = None
            await sim.handover.close()

    app.cleanup_ctx.append(kv_events)
    app.cleanup_ctx.append(engine_parts)
    return app


async def serve(
    cfg: SimConfig,
    ready: asyncio.Event | None = None,
    on_bound: Callable[[int], None] | None = None,
) -> None:
    """Serve ``cfg`` on ``cfg.host:cfg.port`` until cancelled.

    Once listening, calls ``on_bound`` with the bound port (useful with port 0)
    and then sets ``ready``. Raises :class:`EngineError` when the address cannot
    be bound. On cancellation in-flight requests get a few seconds to finish.

    Multi-node: rank 0 first binds ``cfg.dist_init_addr`` and waits for every worker,
    then listens as above, and raises :class:`~llmgw.sim.rendezvous.RendezvousError`
    when a worker goes away (or when they do not all join in time). A worker joins (then
    sets ``ready``; ``on_bound`` is never called, it binds nothing), returns when rank 0
    ends the replica and raises ``RendezvousError`` when rank 0 is gone.
    """
    if cfg.worker:
        await _work(cfg, ready)
        return
    leader: Leader | None = None
    if cfg.nodes > 1:
        host, dist_port = parse_hostport(cfg.dist_init_addr)
        leader = Leader(
            host,
            dist_port,
            cfg.nodes,
            heartbeat_s=cfg.heartbeat_s,
            peer_timeout_s=cfg.peer_timeout_s,
        )
        await leader.open()
    # Workers hear BYE only when rank 0 is stopped on purpose; when the replica broke they
    # see the connection close, and leave with an error too.
    goodbye = False
    try:
        if leader is not None:
            await leader.gather(cfg.join_timeout_s)
        await _serve_http(cfg, ready, on_bound, leader)
    except asyncio.CancelledError:
        goodbye = True
        raise
    finally:
        if leader is not None:
            await asyncio.shield(asyncio.ensure_future(leader.close(goodbye=goodbye)))


async def _work(cfg: SimConfig, ready: asyncio.Event | None) -> None:
    host, port = parse_hostport(cfg.dist_init_addr)
    worker = Worker(
        host,
        port,
        cfg.rank,
        cfg.nodes,
        heartbeat_s=cfg.heartbeat_s,
        peer_timeout_s=cfg.peer_timeout_s,
    )
    try:
        await worker.join(cfg.join_timeout_s)
        if ready is not None:
            ready.set()
        await worker.stay()
    finally:
        worker.close()


async def _serve_http(
    cfg: SimConfig,
    ready: asyncio.Event | None,
    on_bound: Callable[[int], None] | None,
    leader: Leader | None,
) -> None:
    if cfg.load_s:
        # A real engine opens its port once its weights are loaded: nothing answers before.
        log.info("sim engine loading for %gs", cfg.load_s, extra={"engine": "sim"})
        await asyncio.sleep(cfg.load_s)
    runner = web.AppRunner(build_app(cfg), access_log=None, shutdown_timeout=_SHUTDOWN_GRACE_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port, backlog=1024)
        try:
            await site.start()
        except OSError as e:
            raise EngineError(
                f"sim: cannot listen on {cfg.host}:{cfg.port}: {e.strerror or e}; "
                "choose another port or stop what holds it"
            ) from e
        port = int(runner.addresses[0][1])
        kv = cfg.kv_events
        log.info(
            "sim engine listening on %s:%d model=%s block_size=%d kv_blocks=%d "
            "prefill_us_per_token=%g kv_events=%s",
            cfg.host,
            port,
            cfg.model,
            cfg.block_size,
            cfg.kv_blocks,
            cfg.prefill_us_per_token,
            kv.endpoint if kv is not None else "off",
            extra={
                "engine": "sim",
                "host": cfg.host,
                "port": port,
                "model": cfg.model,
                "seed": cfg.seed,
                "ttft_ms": cfg.ttft_ms,
                "tps": cfg.tps,
                "max_tokens": cfg.max_tokens,
                "max_length": cfg.max_length,
                "nodes": cfg.nodes,
                "block_size": cfg.block_size,
                "kv_blocks": cfg.kv_blocks,
                "prefill_us_per_token": cfg.prefill_us_per_token,
                "kv_events_endpoint": kv.endpoint if kv is not None else "",
                "kv_events_topic": kv.topic if kv is not None else "",
            },
        )
        if on_bound is not None:
            on_bound(port)
        if ready is not None:
            ready.set()
        if leader is not None:
            await leader.lost()  # raises RendezvousError naming the worker
        await asyncio.Event().wait()
    finally:
        # Clean up in a task of its own so aiohttp's graceful shutdown does not
        # see this (cancelled) task's pending cancellation.
        await asyncio.shield(asyncio.ensure_future(runner.cleanup()))
        log.info("sim engine stopped", extra={"engine": "sim", "model": cfg.model})


async def _serve_until_signalled(cfg: SimConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):
            # Off the main thread or on a loop without signal handlers (asyncio refuses them):
            # that signal keeps its default action; only the handled ones are removed below.
            continue
        handled.append(sig)
    server = asyncio.create_task(serve(cfg))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({server, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if server.done():
            server.result()  # raises what serve raised (EngineError); a worker may return
        else:
            log.info("sim engine shutting down", extra={"engine": "sim"})
            server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await server
    finally:
        stopper.cancel()
        for sig in handled:
            loop.remove_signal_handler(sig)


def run(cfg: SimConfig) -> None:
    """Serve ``cfg`` in the foreground; returns after SIGTERM or SIGINT (and, for a worker,
    when rank 0 ends the replica). Raises :class:`EngineError` when it cannot serve, and
    ``RendezvousError`` when a multi-node replica cannot assemble or loses a member."""
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO,
            stream=sys.stderr,
            format="%(asctime)s %(levelname)s %(name)s %(message)s",
        )
    probe_paths(cfg.probe_paths, required=cfg.probe_required)
    run_loop(_serve_until_signalled(cfg), process="sim")


__all__ = ["build_app", "run", "serve"]
