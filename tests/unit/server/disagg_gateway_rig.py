"""Stand-in engines of a disaggregated model for the gateway's hand-over tests: small aiohttp
apps behind one stand-in data plane (``/s/{shard}/...``) that answer as vLLM's (with its
NixlConnector) and SGLang's servers do in each role, with the bodies recorded in
``tests/fixtures/disagg`` (its README says where each came from).

Every replica records the bodies it was sent; each request may be failed as the test says
(:attr:`Replica.fails`, one mode a request). The text a decode (or a request run whole)
generates is the same for a given limit (``w0 w1 ...``), so that a handed-over answer, an
aggregated fallback and a resumed stream can be compared.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from llmgw.http.relay import ENGINE_FAILED, NOT_PROCESSED, error_event

__all__ = ["FIXTURES", "Engines", "Replica", "fixture", "words"]

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
