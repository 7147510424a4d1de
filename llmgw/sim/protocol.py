"""What every endpoint of the ``sim`` engine shares: OpenAI-shaped errors (:class:`BadRequest`
and its JSON), the check of a request body and its ``model``, and the bits of streaming."""

from __future__ import annotations

import functools
import json
from typing import Any

from aiohttp import web

from llmgw.sim.config import is_int

__all__ = [
    "DISCONNECT_POLL_S",
    "ROLES",
    "SSE_HEADERS",
    "BadRequest",
    "answer_limit",
    "chat_prompt",
    "continued_message",
    "dumps",
    "error_response",
    "gone",
    "missing",
    "parse_body",
    "positive_int",
    "unknown_model_message",
]

DISCONNECT_POLL_S = 0.05
"""How often a request waiting out its simulated latency looks for a client gone."""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""The message roles the chat and responses endpoints take."""

SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}

dumps = functools.partial(json.dumps, separators=(",", ":"))
"""Compact JSON, as the engines send it."""


class BadRequest(Exception):
    """A request the engine refuses: an OpenAI error object with ``param`` and ``code``."""

    def __init__(
        self,
        message: str,
        param: str | None,
        *,
        status: int = 400,
        code: str | int | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.type = type_

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.param, self.code, self.type)


def error_response(
    status: int,
    message: str,
    param: str | None,
    code: str | int | None,
    type_: str = "invalid_request_error",
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": type_,
            "param": param,
            "code": code,
        }
    }
    return web.Response(status=status, body=dumps(body).encode(), content_type="application/json")


def missing(name: str) -> BadRequest:
    return BadRequest(f"'{name}' is required", name, code="missing_required_parameter")


def unknown_model_message(name: str, model: str) -> str:
    return f"The model '{name}' does not exist; this engine serves '{model}'"


def parse_body(raw: bytes, model: str) -> dict[str, Any]:
    """The JSON object of a request for ``model``; BadRequest (404 for another model)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}", None) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", None)
    given = body.get("model")
    if given is None:
        raise missing("model")
    if not isinstance(given, str):
        raise BadRequest(f"'model' must be a string, got {given!r}", "model")
    if given != model:
        raise BadRequest(
            unknown_model_message(given, model), "model", status=404, code="model_not_found"
        )
    return body


def positive_int(body: dict[str, Any], name: str) -> int | None:
    """``body[name]`` as a positive integer, None when absent."""
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise BadRequest(f"'{name}' must be a positive integer, got {value!r}", name)
    return int(value)


def answer_limit(
    max_length: int, default: int | None, prompt_tokens: int, asked: int | None, name: str
) -> int:
    """The most tokens an answer to a prompt of ``prompt_tokens`` may have: what the request
    ``asked`` (its ``name``), else the engine's ``default``, else the rest of the model's
    context of ``max_length`` tokens, as vLLM does; the refusal in vLLM's words when the
    prompt, or the prompt and what was asked, do not fit in the context."""
    rest = max_length - prompt_tokens
    if asked is not None and asked > rest:
        raise BadRequest(
            f"This model's maximum context length is {max_length} tokens. However, you "
            f"requested {prompt_tokens + asked} tokens ({prompt_tokens} in the messages, "
            f"{asked} in the completion). Please reduce the length of the messages or "
            "completion.",
            name,
        )
    if rest < 1:
        raise BadRequest(
            f"This model's maximum context length is {max_length} tokens. However, your "
            f"messages resulted in {prompt_tokens} tokens. Please reduce the length of the "
            "messages.",
            "messages",
        )
    if asked is not None:
        return asked
    return rest if default is None else min(default, rest)


def gone(request: web.Request) -> bool:
    """Whether the client has hung up."""
    transport = request.transport
    return transport is None or transport.is_closing()


def chat_prompt(messages: object) -> str:
    """The prompt text of a chat request's ``messages``: the text of each message's content
    joined by newlines (the sim engine's chat template; the gateway keys a sim prompt's blocks
    from the same text). BadRequest says what is wrong with them."""
    if messages is None:
        raise missing("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "'messages' must be a non-empty array of {role, content} objects", "messages"
        )
    parts: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadRequest(f"'{where}' must be an object with 'role' and 'content'", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise BadRequest(
                f"'{where}.role' must be one of {', '.join(sorted(ROLES))}; got {role!r}",
                f"{where}.role",
            )
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise BadRequest(
                        f"'{where}.content[{j}]' must be an object with a 'type'",
                        f"{where}.content[{j}]",
                    )
                if part["type"] == "text":
                    text = part.get("text")
                    if not isinstance(text, str):
                        raise BadRequest(
                            f"'{where}.content[{j}].text' must be a string",
                            f"{where}.content[{j}].text",
                        )
                    parts.append(text)
        elif content is None and role == "assistant":
            continue
        else:
            raise BadRequest(
                f"'{where}.content' must be a string or an array of content parts",
                f"{where}.content",
            )
    return "\n".join(parts)


def _vllm_refusal(message: str) -> BadRequest:
    """A refusal as vLLM words a request its validation rejects: 400, ``BadRequestError``."""
    return BadRequest(message, None, code=400, type_="BadRequestError")


def _flag(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean, got {value!r}", name)
    return value


def continued_message(body: dict[str, Any]) -> str | None:
    """The text of the assistant's final message a chat request asks to continue
    (``continue_final_message``), None when it does not. vLLM's refusals: both it and
    ``add_generation_prompt`` true (``add_generation_prompt`` left out is taken as false here,
    as vLLM's check reads the body as sent), and a final message that is not the assistant's."""
    go_on = _flag(body, "continue_final_message")
    add_prompt = _flag(body, "add_generation_prompt")
    if not go_on:
        return None
    if add_prompt:
        raise _vllm_refusal(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    role = last.get("role") if isinstance(last, dict) else None
    if role != "assistant":
        raise _vllm_refusal(
            "`continue_final_message` continues the final message, which must be the "
            f"assistant's; it is {role!r}. Send the partial answer as the last message with "
            "role 'assistant', or leave continue_final_message out."
        )
    return chat_prompt([last])
