"""The stand-in data plane of the resume tests: each replica's relays its engine and breaks
the stream after ``after`` content events while the test's :class:`Breaker` has breaks left
(as the agent does when its engine dies: an error event, then the end of the body; by
resetting the connection; or by ending without ``[DONE]``), and the client's side."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import openai
from aiohttp import web

from llmgw.http.relay import ENGINE_FAILED, error_event
from llmgw.server.common.metrics import Metrics

__all__ = ["KEY", "MESSAGES", "Breaker", "broken", "chat_stream", "proxy", "resumes"]

KEY = "sk-alice"
MESSAGES: Any = [{"role": "user", "content": "Tell me about rivers"}]


@dataclasses.dataclass
class Breaker:
    after: int = 3  # content events relayed before the break
    mode: str = "error"  # error (the agent's error event), reset, eof (no [DONE])
    left: int = 1  # streams still to break
    # A non-streamed answer's break: engine (the agent's 502 saying its engine failed),
    # old_agent (that 502 without the saying), cut (the body cut short), "" (none)
    answer: str = ""
    answers: int = 0  # non-streamed requests the replicas got
    delay: float = 0.0  # before a non-streamed answer's break


def proxy(engine_url: str, breaker: Breaker) -> web.Application:
    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                engine_url + "/v1/" + request.match_info["path"],
                data=body,
                headers={"Content-Type": "application/json"},
            ) as upstream,
        ):
            if upstream.content_type != "text/event-stream":
                breaker.answers += 1
                if breaker.answer and breaker.left > 0:
                    breaker.left -= 1
                    await asyncio.sleep(breaker.delay)
                    return await _break_answer(request, breaker.answer, await upstream.read())
                return web.Response(
                    status=upstream.status,
                    body=await upstream.read(),
                    content_type="application/json",
                )
            breaking = breaker.left > 0
            if breaking:
                breaker.left -= 1
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            seen = 0
            async for raw in upstream.content:  # one line at a time
                token = b'"content":"' in raw or b'"text":"' in raw
                if breaking and token and b'"content":""' not in raw and b'"text":""' not in raw:
                    seen += 1
                if breaking and seen > breaker.after:
                    if breaker.mode == "error":
                        await resp.write(error_event("the engine went away"))
                        return resp
                    if breaker.mode == "reset":
                        assert request.transport is not None
                        request.transport.abort()
                        return resp
                    return resp  # eof: ends without [DONE]
                await resp.write(raw)
            return resp

    app = web.Application()
    app.router.add_post("/v1/{path:.+}", relay)
    return app


async def _break_answer(request: web.Request, how: str, whole: bytes) -> web.StreamResponse:
    """A non-streamed answer broken as the agent breaks it when its engine fails (a 502
    saying so, or an older agent's without), or as a connection lost mid-body does."""
    error = b'{"error": {"message": "engine of shard s0 did not answer", "code": "x"}}'
    if how == "engine":
        return web.Response(status=502, body=error, headers={ENGINE_FAILED: "reset"})
    if how == "old_agent":
        return web.Response(status=502, body=error, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.content_length = len(whole)
    await resp.prepare(request)
    await resp.write(whole[: len(whole) // 2])
    assert request.transport is not None
    request.transport.abort()
    return resp


async def chat_stream(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, set[str], Any, str]:
    text, ids, usage, finish = "", set(), None, ""
    stream = await client.chat.completions.create(
        model="m",
        messages=kw.pop("messages", MESSAGES),
        stream=True,
        stream_options={"include_usage": True},
        **kw,
    )
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, ids, usage, finish


def resumes(metrics: Metrics) -> dict[tuple[str, ...], float]:
    return dict(metrics.stream_resumes.values)


def broken(metrics: Metrics) -> dict[tuple[str, ...], float]:
    return dict(metrics.streams_broken.values)
