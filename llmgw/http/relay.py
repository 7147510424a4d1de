"""Relay an upstream HTTP response to a downstream client, streaming SSE chunk by chunk.

Used by both hops of a request: the gateway (client -> agent) and the agent's data plane
(gateway -> engine). Bodies pass through unchanged (:mod:`llmgw.http.pool` never
decompresses), so ``Content-Encoding`` is copied like any other end-to-end header. Event
streams are written as they arrive, never buffered and never compressed; other bodies are
read whole (up to the pool's ``max_body``) and sent with a Content-Length. A stream that
fails half-way (the upstream stalls, dies or sends what a consumer refuses) ends with an
OpenAI-shaped error event and a proper end of the body, which clients report as an error.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

from aiohttp import web

from llmgw.http.errors import UpstreamError
from llmgw.http.response import UpstreamResponse

# Set on answers the data plane gives without having passed the request to an engine
# (draining, shard not ready): the gateway may send the request to another replica.
NOT_PROCESSED = "X-Llmgw-Not-Processed"

# Where relay() leaves the error that ended an event stream early, on the response it returns
# (aiohttp responses are mappings for such per-request data).
STREAM_ERROR: web.ResponseKey[UpstreamError] = web.ResponseKey("llmgw_stream_error", UpstreamError)

__all__ = ["NOT_PROCESSED", "STREAM_ERROR", "error_event", "is_event_stream", "relay"]

# Headers that describe one hop's connection, not the content.
_HOP_HEADERS = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "Content-Length",
        "Date",
        "Server",
        "Upgrade",
        "Proxy-Connection",
    )
)


def is_event_stream(resp: UpstreamResponse) -> bool:
    return resp.content_type == "text/event-stream"


def _copy_headers(
    upstream: UpstreamResponse, replace: dict[str, str] | None = None
) -> list[tuple[str, str]]:
    """End-to-end headers of ``upstream`` (repeats kept), with those in ``replace`` set."""
    if not replace:
        return [(k, v) for k, v in upstream.headers if k.lower() not in _HOP_HEADERS]
    drop = _HOP_HEADERS.union(k.lower() for k in replace)
    return [(k, v) for k, v in upstream.headers if k.lower() not in drop] + list(replace.items())


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_event(message: str, code: str = "upstream_error") -> bytes:
    """An SSE event carrying an OpenAI-shaped error. It starts with a blank line, which ends
    an event left incomplete (and is ignored after a complete one)."""
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"\n\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"


async def relay(
    request: web.BaseRequest,
    upstream: UpstreamResponse,
    *,
    on_chunk: Callable[[bytes], None] | None = None,
    extra_headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Send ``upstream``'s status, headers and body to ``request``'s client.

    The caller releases ``upstream`` afterwards (its connection goes back to the pool only
    when the body was read to the end). An :class:`~llmgw.http.errors.UpstreamError` reading a
    body read whole propagates (nothing was sent yet: the caller answers 502); one during an
    event stream, from the upstream or from ``on_chunk``, ends the client's stream with
    :func:`error_event` and is left on the returned response under :data:`STREAM_ERROR`
    (``upstream.complete`` is then false).
    """
    if upstream.content_type != "text/event-stream":
        body = await upstream.read()
        if on_chunk is not None:
            on_chunk(body)
        return web.Response(
            status=upstream.status, body=body, headers=_copy_headers(upstream, extra_headers)
        )
    replace = {**extra_headers, **_SSE_HEADERS} if extra_headers else _SSE_HEADERS
    resp = web.StreamResponse(status=upstream.status, headers=_copy_headers(upstream, replace))
    await resp.prepare(request)
    try:
        async for chunk in upstream.iter_chunks():
            if on_chunk is not None:
                on_chunk(chunk)
            await resp.write(chunk)
    except UpstreamError as exc:
        # The client has the status line and part of the stream: an error response is no
        # longer possible, an error event is (OpenAI's clients raise it).
        resp[STREAM_ERROR] = exc
        with contextlib.suppress(ConnectionError):  # the client may be gone too
            await resp.write(error_event(f"the stream ended early: {exc}"))
    # aiohttp ends the stream once the handler returns, quietly if the client has gone.
    return resp
