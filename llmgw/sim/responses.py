"""The ``sim`` engine's ``POST /v1/responses``: OpenAI's Responses API, one message of output
text, streamed as its typed events or answered whole.

The text is the chat endpoint's for the same conversation (:func:`llmgw.sim.generate.draw`
of the instructions and the input's texts, one a line, with the engine's seed), paced the
same way: ``ttft_ms`` to the first token, ``tps`` after it. An answer ends by itself
(``completed``, its stream with ``response.completed``) unless ``max_output_tokens`` (else
the engine's ``max_tokens``, else the rest of the model's context) cuts it short: then it
is ``incomplete`` (reason ``max_output_tokens``) and its stream ends with
``response.incomplete``, as OpenAI's do. A stream is
``event: TYPE`` / ``data: JSON`` pairs: response.created, response.in_progress,
response.output_item.added, response.content_part.added, one response.output_text.delta per
token, response.output_text.done, response.content_part.done, response.output_item.done,
then the final event carrying the whole response and its usage; each has its
``sequence_number``. sim keeps no responses: ``previous_response_id`` is refused. Its usage
counts the prompt's tokens by the sim's tokenizer, as chat does, but the prompt stays outside
the engine's prefix cache (no cached tokens, no prefill cost).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw.sim.config import SimConfig
from llmgw.sim.generate import TOKEN_JSON, draw, tokenize
from llmgw.sim.protocol import (
    DISCONNECT_POLL_S,
    ROLES,
    SSE_HEADERS,
    BadRequest,
    answer_limit,
    dumps,
    gone,
    missing,
    parse_body,
    positive_int,
)

__all__ = ["ResponsesHandlers"]

log = logging.getLogger("llmgw.engine.sim")

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_IGNORED_PARTS = frozenset({"input_image", "input_file", "input_audio", "refusal"})
_IGNORED_ITEMS = frozenset({"function_call", "reasoning", "item_reference"})


@dataclass(frozen=True, slots=True)
class _Request:
    prompt: str
    max_tokens: int | None  # as asked; None: the engine's default, else the context's rest
    stream: bool
    echo: dict[str, Any]  # the request's settings, as the response repeats them


class ResponsesHandlers:
    """The handler of one engine's ``/v1/responses``."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.ttft_s = cfg.ttft_ms / 1000.0
        self.interval_s = 1.0 / cfg.tps if cfg.tps > 0 else 0.0

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/v1/responses", self.create)]

    async def create(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            body = parse_body(await request.read(), self.cfg.model)
            req = _parse(body, self.cfg)
        except BadRequest as e:
            return e.response()
        input_tokens = len(tokenize(req.prompt))  # as chat counts it; outside the prefix cache
        cfg = self.cfg
        try:
            limit = answer_limit(
                cfg.max_length, cfg.max_tokens, input_tokens, req.max_tokens, "max_output_tokens"
            )
        except BadRequest as e:
            return e.response()
        tokens, finish = draw(req.prompt, limit, cfg.seed)
        ids = _Ids(os.urandom(12).hex())
        created = int(time.time())
        usage = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": len(tokens),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + len(tokens),
        }
        final = "completed" if finish == "stop" else "incomplete"
        if req.stream:
            return await self._stream(request, req, ids, created, tokens, final, usage, t0)
        deadline = t0 + self.ttft_s + (len(tokens) - 1) * self.interval_s
        while (remaining := deadline - loop.time()) > 0:
            if gone(request):
                break
            await asyncio.sleep(min(remaining, DISCONNECT_POLL_S))
        text = "".join(tokens)
        obj = _response(
            ids, created, req, final, [_message(ids, final, text)], usage, int(time.time())
        )
        return web.Response(body=dumps(obj).encode(), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        req: _Request,
        ids: _Ids,
        created: int,
        tokens: list[str],
        final: str,
        usage: dict[str, Any],
        t0: float,
    ) -> web.StreamResponse:
        events = _Events()
        started = _response(ids, created, req, "in_progress", [], None, None)
        opening = [
            events.one("response.created", {"response": started}),
            events.one("response.in_progress", {"response": started}),
            events.one(
                "response.output_item.added",
                {"output_index": 0, "item": _message(ids, "in_progress", None)},
            ),
            events.one(
                "response.content_part.added",
                {**ids.part, "part": _output_text("")},
            ),
        ]
        delta_head = (
            'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            f'"item_id":"{ids.message}","output_index":0,"content_index":0,"delta":'
        )
        response = web.StreamResponse(headers=SSE_HEADERS)
        loop = asyncio.get_running_loop()
        try:
            await response.prepare(request)
            await response.write("".join(opening).encode())
            for k, token in enumerate(tokens):
                delay = t0 + self.ttft_s + k * self.interval_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if gone(request):
                    return response
                await response.write(
                    (
                        f"{delta_head}{TOKEN_JSON.get(token) or json.dumps(token)},"
                        f'"logprobs":[],"sequence_number":{events.next()}}}\n\n'
                    ).encode()
                )
            text = "".join(tokens)
            done = _response(
                ids, created, req, final, [_message(ids, final, text)], usage, int(time.time())
            )
            closing = [
                events.one("response.output_text.done", {**ids.part, "text": text, "logprobs": []}),
                events.one("response.content_part.done", {**ids.part, "part": _output_text(text)}),
                events.one(
                    "response.output_item.done",
                    {"output_index": 0, "item": _message(ids, final, text)},
                ),
                events.one(f"response.{final}", {"response": done}),
            ]
            await response.write("".join(closing).encode())
            await response.write_eof()
        except ConnectionResetError:
            log.debug("sim: client went away mid-stream", extra={"id": ids.response})
        return response


class _Ids:
    """The ids of one response and its one message."""

    def __init__(self, suffix: str) -> None:
        self.response = f"resp_{suffix}"
        self.message = f"msg_{suffix}"
        self.part = {"item_id": self.message, "output_index": 0, "content_index": 0}


class _Events:
    """Server-sent events numbered in order."""

    def __init__(self) -> None:
        self.sequence = 0

    def next(self) -> int:
        number = self.sequence
        self.sequence += 1
        return number

    def one(self, kind: str, fields: dict[str, Any]) -> str:
        data = {"type": kind, **fields, "sequence_number": self.next()}
        return f"event: {kind}\ndata: {dumps(data)}\n\n"


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(ids: _Ids, status: str, text: str | None) -> dict[str, Any]:
    return {
        "id": ids.message,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_output_text(text)],
    }


def _response(
    ids: _Ids,
    created: int,
    req: _Request,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    completed_at: int | None,
) -> dict[str, Any]:
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {
        "id": ids.response,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "completed_at": completed_at if status == "completed" else None,
        "error": None,
        "incomplete_details": incomplete,
        **req.echo,
        "output": output,
        "previous_response_id": None,
        "usage": usage,
    }


def _parse(body: dict[str, Any], cfg: SimConfig) -> _Request:
    if body.get("previous_response_id") is not None:
        raise BadRequest(
            "the sim engine keeps no responses, so it cannot continue one; send the earlier "
            "turns in 'input' instead of 'previous_response_id'",
            "previous_response_id",
            code="unsupported_parameter",
        )
    if body.get("conversation") is not None:
        raise BadRequest(
            "the sim engine keeps no conversations; send the earlier turns in 'input'",
            "conversation",
            code="unsupported_parameter",
        )
    if "input" not in body or body["input"] is None:
        raise missing("input")
    texts = _input_texts(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest(f"'instructions' must be a string, got {instructions!r}", "instructions")
    if instructions:
        texts.insert(0, instructions)
    max_output_tokens = positive_int(body, "max_output_tokens")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {stream!r}", "stream")
    echo: dict[str, Any] = {
        "model": cfg.model,
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "metadata": _optional(body, "metadata", dict, {}),
        "parallel_tool_calls": _optional(body, "parallel_tool_calls", bool, True),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": False,
        "temperature": _number(body, "temperature", 1.0),
        "text": _optional(body, "text", dict, {"format": {"type": "text"}}),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": _optional(body, "tools", list, []),
        "top_p": _number(body, "top_p", 1.0),
        "truncation": "disabled",
        "user": body.get("user") if isinstance(body.get("user"), str) else None,
    }
    return _Request(
        prompt="\n".join(texts),
        max_tokens=max_output_tokens,
        stream=stream,
        echo=echo,
    )


def _optional(body: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise BadRequest(f"'{name}' must be {_KINDS[kind]}, got {value!r}", name)
    return value


_KINDS: dict[type, str] = {dict: "an object", list: "an array", bool: "a boolean"}


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number, got {value!r}", name)
    return float(value)


def _input_texts(value: object) -> list[str]:
    """The texts of ``input``: a string, or input items (messages whose content is a string
    or input_text parts; function call outputs). Images and files carry no text for sim."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise BadRequest(
            "'input' must be a string or a non-empty array of input items (messages with "
            "'role' and 'content')",
            "input",
        )
    texts: list[str] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadRequest(f"'{where}' must be an object (a message with 'role')", where)
        kind = item.get("type", "message")
        if kind == "message":
            texts.extend(_message_texts(item, where))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                raise BadRequest(f"'{where}.output' must be a string", f"{where}.output")
            texts.append(output)
        elif kind not in _IGNORED_ITEMS:
            raise BadRequest(
                f"'{where}.type' {kind!r} is not an input item sim takes (message, "
                "function_call_output, function_call, reasoning, item_reference)",
                f"{where}.type",
            )
    return texts


def _message_texts(item: dict[str, Any], where: str) -> list[str]:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRequest(
            f"'{where}.role' must be one of {', '.join(sorted(ROLES))}; got {role!r}",
            f"{where}.role",
        )
    content = item.get("content")
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise BadRequest(
            f"'{where}.content' must be a string or an array of content parts",
            f"{where}.content",
        )
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            assert isinstance(part, dict)
            text = part.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"'{at}.text' must be a string", f"{at}.text")
            texts.append(text)
        elif kind not in _IGNORED_PARTS:
            raise BadRequest(
                f"'{at}' must be a content part with a 'type' (input_text, output_text, "
                "input_image, input_file)",
                at,
            )
    return texts
