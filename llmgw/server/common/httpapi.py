"""What every handler on :8080 shares: reading the bearer credential, and the middleware that
answers whatever a handler did not (aiohttp's 404/405/413, a body that is not JSON, a bug) with
a JSON error and one log line, never a bare 500 page.

Errors have the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``, a superset of
the admin API's ``{"error": {"message", "code"}}``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from llmgw.log import kv

__all__ = ["bearer_token", "error_middleware", "json_error"]

log = logging.getLogger("llmgw.server.http")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    411: "length_required",
    413: "body_too_large",
    415: "unsupported_media_type",
    431: "headers_too_large",
}


def bearer_token(request: web.Request) -> bytes | None:
    """The credential of ``Authorization: Bearer <credential>`` as the client sent its bytes,
    or None. The scheme is matched without case (RFC 7235); a header that is not valid UTF-8
    (aiohttp keeps the bytes as surrogates) is compared byte for byte, so it can only fail."""
    header = request.headers.get("Authorization")
    if not header:
        return None
    scheme, _, credential = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    token = credential.strip().encode("utf-8", "surrogateescape")
    return token or None


def json_error(
    status: int, message: str, code: str, *, type_: str = "invalid_request_error"
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _browser_at_root(request: web.Request) -> bool:
    return (
        request.path == "/"
        and request.method in ("GET", "HEAD")
        and "text/html" in request.headers.get("Accept", "")
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise  # a redirect, or an error that already has its JSON body
        if exc.status == 404 and _browser_at_root(request):
            # Someone typed the control plane's address into a browser: the console is there.
            raise web.HTTPFound("/ui/") from None
        code = _CODES.get(exc.status, "bad_request" if exc.status < 500 else "server_error")
        path = request.path[:100]
        log.info(
            "refused a request",
            extra=kv(
                method=request.method[:16],
                path=path,
                status=exc.status,
                peer=request.remote or "",
                reason=exc.reason,
            ),
        )
        hint = (
            "the OpenAI API is under /v1 (GET /v1/models), the web console at /ui/ and the "
            "admin API under /api"
            if exc.status in (404, 405)
            else "see the API's documentation"
        )
        # aiohttp's own text says more than the reason for some (the body size limit).
        detail = exc.text or ""
        detail = "" if detail in ("", f"{exc.status}: {exc.reason}") else f" ({detail[:200]})"
        return json_error(
            exc.status,
            f"{request.method[:16]} {path}: {exc.reason}{detail}; {hint}",
            code,
            type_="invalid_request_error" if exc.status < 500 else "server_error",
        )
    except Exception:
        # A bug, not the client's doing: the traceback goes to the log, not to the client.
        log.exception(
            "a request handler failed",
            extra=kv(method=request.method[:16], path=request.path[:100], peer=request.remote),
        )
        return json_error(
            500,
            "the control plane failed on this request; its operator finds why in its log",
            "internal_error",
            type_="server_error",
        )
