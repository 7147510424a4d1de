"""The gateway's refusals, in OpenAI's error shape (:func:`openai_error`): each says what is
wrong and what fixes it, with the ``ctl`` command an operator runs here."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from aiohttp import web

from llmgw.configfile import format_size
from llmgw.log import kv

__all__ = [
    "bodies_busy",
    "expired_key",
    "model_not_allowed",
    "no_replica",
    "no_such_model",
    "openai_error",
    "payload_of",
    "queue_timeout",
    "sentence",
    "too_large",
    "unauthorized",
]

# The gateway's logger: what an operator filters on for the request path.
log = logging.getLogger("llmgw.server.gateway")


def openai_error(
    status: int,
    message: str,
    *,
    type_: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def sentence(exc: Exception) -> str:
    """An error's message as a sentence (capital first, full stop), like the gateway's own."""
    text = str(exc)
    return f"{text[:1].upper()}{text[1:]}."


def unauthorized(ctl: str) -> web.Response:
    return openai_error(
        401,
        "Incorrect or missing API key. Pass 'Authorization: Bearer <key>'; an operator "
        f"creates keys with '{ctl} keys create NAME'.",
        code="invalid_api_key",
    )


def expired_key(name: str, expires: float, ctl: str) -> web.Response:
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(expires))
    return openai_error(
        401,
        f"The API key '{name}' expired on {when}. Ask the operator for a new key "
        f"('{ctl} keys create NAME') or to extend this one "
        f"('{ctl} keys update {name} --expires 90d').",
        code="expired_api_key",
    )


def bodies_busy(capacity: int) -> web.Response:
    return openai_error(
        503,
        f"The gateway is holding as many request bodies as it may at once "
        f"({format_size(capacity)}, max_inflight_body_bytes in server.yaml); "
        "retry in a moment.",
        type_="server_error",
        code="overloaded",
        headers={"Retry-After": "1"},
    )


def too_large(
    size: int | None,
    limit: int,
    model: str | None,
    *,
    own_limit: bool,
    inflight_cap: int,
    largest: int,
    default: int,
    ctl: str,
) -> web.Response:
    """The 413 for a body of ``size`` bytes (None: more than ``limit``, not read to its
    end). ``own_limit``: ``model``'s profile sets its own limit; ``inflight_cap``:
    max_inflight_body_bytes; ``largest``: the largest limit of any model; ``default``:
    server.yaml's max_request_body."""
    what = f"{size} bytes" if size is not None else f"more than {format_size(limit)}"
    if model is not None and own_limit:
        taken = f"model '{model}' takes at most {format_size(limit)}"
        fix = f"its catalog profile's max_request_body sets it ('{ctl} models apply')"
    elif limit == inflight_cap and limit < largest:
        taken = f"this gateway holds at most {format_size(limit)} of bodies at once"
        fix = "raise max_inflight_body_bytes in server.yaml"
    elif model is None and limit > default:
        taken = f"no model on this gateway takes more than {format_size(limit)}"
        fix = "a model's catalog profile sets its own with max_request_body"
    else:
        whose = f"model '{model}'" if model is not None else "this gateway"
        taken = f"{whose} takes at most {format_size(limit)}"
        fix = (
            "max_request_body in server.yaml sets it; for long contexts a model's catalog "
            "profile may raise it with its own max_request_body"
        )
    return openai_error(
        413,
        f"The request body is {what}; {taken} ({fix}).",
        code="request_too_large",
    )


def no_such_model(model: str, allowed: list[str]) -> web.Response:
    return openai_error(
        404,
        f"The model '{model}' does not exist. Models on this gateway: "
        f"{', '.join(allowed) or 'none'}.",
        param="model",
        code="model_not_found",
    )


def model_not_allowed(key: str, model: str, models: tuple[str, ...], ctl: str) -> web.Response:
    return openai_error(
        403,
        f"The API key '{key}' may not use the model '{model}'; it may use "
        f"{', '.join(models)}. The operator changes that with "
        f"'{ctl} keys update {key} --models ...'.",
        type_="permission_error",
        param="model",
        code="model_not_allowed",
    )


def queue_timeout(
    model: str, max_concurrency: int, waited: float, depth: int, ctl: str
) -> web.Response:
    return openai_error(
        503,
        f"Every replica of '{model}' is busy (max_concurrency "
        f"{max_concurrency} each) and this request waited "
        f"{waited:.1f} s (queue_timeout in server.yaml) with "
        f"{depth} others; retry in a moment, or the operator adds replicas "
        f"('{ctl} deploy {model} --replicas N').",
        type_="server_error",
        code="model_overloaded",
        headers={"Retry-After": "1"},
    )


def no_replica(model: str, tried: int, busy: int, ctl: str) -> web.Response:
    """No replica of ``model`` took the request: ``tried`` of them were, ``busy`` of those
    had no room for the body."""
    if tried and busy == tried:
        return openai_error(
            503,
            f"Every replica of '{model}' is holding as many request bodies as it "
            "may (max_inflight_body_bytes in agent.yaml); retry in a moment.",
            type_="server_error",
            code="overloaded",
            headers={"Retry-After": "1"},
        )
    if tried:
        return openai_error(
            502,
            f"No replica of '{model}' answered ({tried} tried); try again shortly.",
            type_="server_error",
            code="upstream_unavailable",
        )
    return openai_error(
        503,
        f"The model '{model}' has no ready replica right now; retry after a few seconds "
        f"('{ctl} replicas {model}' shows why).",
        type_="server_error",
        code="model_not_ready",
        headers={"Retry-After": "5"},
    )


def no_room(model: str, reason: str, ctl: str) -> web.Response:
    """``model`` has no ready replica and none can be placed now: said at once, with why."""
    return openai_error(
        503,
        f"The model '{model}' has no ready replica and none can be placed now: {reason}. "
        f"Retry later, or free GPUs for it ('{ctl} models' shows what each model holds).",
        type_="server_error",
        code="no_capacity",
        headers={"Retry-After": "30"},
    )


def payload_of(request: web.Request, body: bytes) -> dict[str, Any] | web.Response:
    """The body as a JSON object with a ``model`` (a string), or the 400 to answer."""
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        why = "nested too deep" if isinstance(exc, RecursionError) else "not valid JSON"
        log.info(
            "refused a request body",
            extra=kv(path=request.path[:100], peer=request.remote or "", reason=why),
        )
        return openai_error(
            400,
            f"The request body is {why}; send a JSON object such as "
            '{"model": "...", "messages": [...]}.',
            code="invalid_json",
        )
    if not isinstance(payload, dict):
        return openai_error(
            400,
            'The request body must be a JSON object such as {"model": "...", "messages": [...]}.',
            code="invalid_json",
        )
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        return openai_error(
            400, "The request needs a 'model' (a string).", param="model", code="missing_model"
        )
    return payload
