"""Stand-in engines of a disaggregated model for the gateway's hand-over tests: small aiohttp
apps behind one stand-in data plane (``/s/{shard}/...``) that answer as vLLM's (with its
NixlConnector) and SGLang's servers do in each role, with the bodies recorded in
``tests/fixtures/disagg`` (its README says where each came from).

Every replica records the bodies it was sent; each request may be failed as the test says
(:attr:`Replica.fails`, one mode a request). The text a decode (or a request run whole)
generates is the same for a given limit (``w0 w1 ...``), so that a handed-over answer, an
aggregated fallback and a resumed stream can be compared. :func:`run` serves them behind a
gateway with the official ``openai`` client (:class:`Rig`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
from aiohttp import web

from llmgw.contracts.catalog import Routing
from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.http.relay import ENGINE_FAILED, NOT_PROCESSED, error_event
from llmgw.server.common.config import ServerConfig, load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.gateway import Gateway
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import Handover, ServedModel
from tests.unit.gateway_rig import gateway_of, serving_of
from tests.unit.server.fakes import api_key
from tests.unit.serving import serving

__all__ = [
    "FIXTURES",
    "MESSAGES",
    "TRANSFER_ADDR",
    "Engines",
    "Replica",
    "Rig",
    "chat",
    "chat_stream",
    "fixture",
    "run",
    "words",
]

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "disagg"
PROMPT_TOKENS = 12


def fixture(name: str) -> Any:
    return json.loads((FIXTURES / name).read_text())


def words(start: int, count: int) -> list[str]:
    """The tokens a stand-in generates: ``w0``, `` w1``, ...; from ``start``."""
    return [f"w{i}" if i == 0 else f" w{i}" for i in range(start, start + count)]


@dataclasses.dataclass
class Replica:
    shard: str
    role: str  # prefill | decode
    # How its next requests fail, one mode each: refuse (its agent says it never passed it
    # on), reset (the connection cut before an answer), engine (its agent's 502: the engine
    # failed mid-answer), 500, 400, hang (a stream's status line, then nothing: a transfer
    # that never completes; a prefill: no answer), break (a stream cut after 3 tokens, as
    # the agent ends it when its engine dies); "" answers.
    fails: list[str] = dataclasses.field(default_factory=list)
    got: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)


class Engines:
    """The replicas of one disaggregated model speaking ``protocol`` (vllm or sglang)."""

    def __init__(self, protocol: str, replicas: list[Replica]) -> None:
        self.protocol = protocol
        self.replicas = {r.shard: r for r in replicas}
        # SGLang: the rooms whose prefill has come (a decode waits for its room's).
        self.rooms: dict[int, asyncio.Event] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/s/{shard}/{path:.+}", self.handle)
        return app

    def room(self, room: int) -> asyncio.Event:
        return self.rooms.setdefault(room, asyncio.Event())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rep = self.replicas[request.match_info["shard"]]
        path = request.match_info["path"]
        body = await request.json()
        rep.got.append((path, body))
        mode = rep.fails.pop(0) if rep.fails else ""
        if mode == "refuse":
            return web.json_response(
                {"error": "draining"}, status=503, headers={NOT_PROCESSED: "1"}
            )
        if mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if mode == "engine":  # the agent's 502: its engine took it and failed mid-answer
            error = {"message": "engine of the shard did not answer", "code": "x"}
            return web.json_response({"error": error}, status=502, headers={ENGINE_FAILED: "reset"})
        if mode in ("500", "400"):
            error = {"message": f"the stand-in answered {mode}", "type": "x", "code": int(mode)}
            return web.json_response({"error": error}, status=int(mode))
        if path == "tokenize":  # vLLM's /tokenize: an endpoint no hand-over is made for
            return web.json_response({"count": 3, "max_model_len": 4096, "tokens": [1, 2, 3]})
        chat = path == "v1/chat/completions"
        params = body.get("kv_transfer_params") or {}
        if self.protocol == "vllm" and params.get("do_remote_decode"):
            if mode == "hang":  # a prefill that never answers
                await asyncio.sleep(60)
            return web.json_response(_prefill_answer(chat))
        if self.protocol == "sglang" and rep.role == "prefill":
            self.room(body["bootstrap_room"]).set()
            return web.json_response(_answer(chat, 0, 1, cached=0))
        room = body.get("bootstrap_room") if self.protocol == "sglang" else None
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        start = 0
        if body.get("continue_final_message"):
            start = len(str(body["messages"][-1]["content"]).split())
        if not body.get("stream"):
            if room is not None:  # SGLang's decode waits for its room's KV from the prefill
                await self.room(room).wait()
            return web.json_response(_answer(chat, start, limit, cached=0))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if room is not None:
            await self.room(room).wait()
        if mode == "hang":
            await asyncio.sleep(60)
            return resp
        usage = (body.get("stream_options") or {}).get("include_usage")
        for i, event in enumerate(_stream(chat, start, limit, usage)):
            if mode == "break" and i > 3:
                await resp.write(error_event("the engine went away"))
                return resp
            await resp.write(event)
        return resp


def _prefill_answer(chat: bool) -> dict[str, Any]:
    answer: dict[str, Any] = fixture("vllm_chat_prefill_response.json")
    if not chat:
        answer = {
            **answer,
            "object": "text_completion",
            "choices": [{"index": 0, "text": "w0", "logprobs": None, "finish_reason": "length"}],
        }
    return answer


def _usage(completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": completion,
        "total_tokens": PROMPT_TOKENS + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _answer(chat: bool, start: int, count: int, cached: int) -> dict[str, Any]:
    text = "".join(words(start, count))
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": "cmpl-stand-in",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": "m",
        "choices": [choice],
        "usage": _usage(count, cached),
    }


def _stream(chat: bool, start: int, count: int, usage: bool) -> list[bytes]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": "cmpl-stand-in", "object": kind, "created": int(time.time()), "model": "m"}
    events = []

    def event(choices: list[dict[str, Any]], **more: Any) -> None:
        events.append(
            b"data: " + json.dumps({**head, "choices": choices, **more}).encode() + b"\n\n"
        )

    if chat:
        event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    tokens = words(start, count)
    for i, token in enumerate(tokens):
        last = "length" if i == len(tokens) - 1 else None
        if chat:
            event([{"index": 0, "delta": {"content": token}, "finish_reason": last}])
        else:
            event([{"index": 0, "text": token, "finish_reason": last}])
    if usage:
        event([], usage=_usage(count, 0))
    events.append(b"data: [DONE]\n\n")
    return events


MESSAGES: Any = [{"role": "user", "content": "Tell me about rivers"}]
TRANSFER_ADDR = "10.0.0.7:8998"


@dataclasses.dataclass
class Rig:
    client: openai.AsyncOpenAI
    metrics: Metrics
    engines: Engines
    gateway: Gateway
    port: int

    def replica(self, shard: str) -> Replica:
        return self.engines.replicas[shard]

    def sent(self, role: str) -> list[dict[str, Any]]:
        """The bodies the ``role`` pool's replicas were sent, in the order of their shards."""
        return [body for r in self.engines.replicas.values() if r.role == role for _, body in r.got]

    def counted(self, metric: str) -> dict[tuple[str, ...], float]:
        return {k: v for k, v in getattr(self.metrics, metric).values.items() if v}


def run(
    body: Callable[[Rig], Awaitable[None]],
    *,
    protocol: str = "vllm",
    prefill: int = 2,
    decode: int = 2,
    transfer_timeout: float = 5.0,
    prefill_cold: float | None = None,
    transfer_addr: str = TRANSFER_ADDR,
    routing: Routing = Routing.LEAST_OUTSTANDING,
    fails: dict[str, list[str]] | None = None,
    queue_timeout: float = 2.0,
    idle_timeout: float = 30.0,
    kv_bytes: int | None = None,
) -> None:
    async def main() -> None:
        replicas = [Replica(f"p{i}", "prefill") for i in range(prefill)]
        replicas += [Replica(f"d{i}", "decode") for i in range(decode)]
        for r in replicas:
            r.fails = list((fails or {}).get(r.shard, []))
        engines = Engines(protocol, replicas)
        async with serving(engines.app()) as dp_port:
            cfg = dataclasses.replace(
                load_server_config(None),
                replica_wait=0.0,
                queue_timeout=queue_timeout,
                upstream_idle_timeout=idle_timeout,
            )
            router = Router()
            for r in replicas:
                router.set_ready(
                    Endpoint(
                        f"m#{r.role}",
                        r.shard,
                        r.shard,
                        f"n-{r.shard}",
                        f"127.0.0.1:{dp_port}",
                        transfer_addr=transfer_addr if r.role == "prefill" else "",
                    )
                )
            engine = "vllm" if protocol == "vllm" else "sglang"
            paths = served_paths(engine, ("generate",))
            handover = Handover("m#prefill", "m#decode", protocol, transfer_timeout, kv_bytes)
            models = [
                ServedModel("m", engine, ("generate",), paths, 8, None, routing, handover=handover),
                ServedModel(
                    "m#prefill",
                    engine,
                    ("generate",),
                    paths,
                    8,
                    None,
                    routing,
                    cold_start_timeout=prefill_cold,
                ),
                ServedModel("m#decode", engine, ("generate",), paths, 8, None),
            ]
            async with gateway_serving(cfg, router, models) as (gateway, metrics, client, port):
                await body(Rig(client, metrics, engines, gateway, port))

    asyncio.run(main())


@contextlib.asynccontextmanager
async def gateway_serving(
    cfg: ServerConfig, router: Router, models: list[ServedModel]
) -> AsyncIterator[tuple[Gateway, Metrics, openai.AsyncOpenAI, int]]:
    """A gateway serving ``models`` over ``router`` for the key sk-alice on a free port: it,
    its metrics, an ``openai`` client of it, and its port."""
    metrics = Metrics()
    gateway = gateway_of(
        cfg,
        router,
        serving_of(cfg, [api_key("alice", KeyPolicy())[0]], models),
        metrics=metrics,
    )
    app = web.Application()
    gateway.add_routes(app)
    app.on_cleanup.append(lambda _app: gateway.close())
    async with serving(app) as port:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-alice", max_retries=0
        )
        try:
            yield gateway, metrics, client, port
        finally:
            await client.close()


async def chat(rig: Rig, **kw: Any) -> Any:
    return await rig.client.chat.completions.create(
        model="m", messages=MESSAGES, max_completion_tokens=8, temperature=0, **kw
    )


async def chat_stream(rig: Rig, **kw: Any) -> tuple[str, Any]:
    text, usage = "", None
    if "max_completion_tokens" not in kw:
        kw["max_tokens"] = 8
    stream = await rig.client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
    return text, usage
