"""Relay an upstream HTTP response to a downstream client, streaming SSE chunk by chunk.

Used by both hops of a request: the gateway (client -> agent) and the agent's data plane
(gateway -> engine). Bodies pass through unchanged (:mod:`llmgw.upstream` never
decompresses), so ``Content-Encoding`` is copied like any other end-to-end header. Event
streams are written as they arrive, never buffered and never compressed; other bodies are
read whole and sent with a Content-Length.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from llmgw.upstream import UpstreamError, UpstreamResponse

# Set on answers the data plane gives without having passed the request to an engine
# (draining, shard not ready): the gateway may send the request to another replica.
NOT_PROCESSED = "X-Llmgw-Not-Processed"

__all__ = ["NOT_PROCESSED", "is_event_stream", "relay"]

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


async def relay(
    request: web.Request,
    upstream: UpstreamResponse,
    *,
    on_chunk: Callable[[bytes], None] | None = None,
    extra_headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Send ``upstream``'s status, headers and body to ``request``'s client.

    The caller releases ``upstream`` afterwards (its connection goes back to the pool only
    when the body was read to the end). An :class:`~llmgw.upstream.UpstreamError` from a
    body that fails half-way through an event stream also closes the client's connection.
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
    except UpstreamError:
        # The client has the status line and part of the stream: all that is left is to cut
        # its connection, so that it sees the stream end early. (An error response now
        # would land in the middle of the stream.)
        if request.transport is not None:
            request.transport.close()
        raise
    # aiohttp ends the stream once the handler returns, quietly if the client has gone.
    return resp
