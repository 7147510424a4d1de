"""Relay an upstream HTTP response to a downstream client, streaming SSE chunk by chunk.

Bodies pass through unchanged (callers read upstreams with ``auto_decompress=False``), so
``Content-Encoding`` is copied like any other end-to-end header. Used by both hops of a request: the gateway (client -> agent) and the agent's data plane
(gateway -> engine). Event streams are written as they arrive, never buffered and never
compressed; other bodies are read whole and sent with a Content-Length.
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web

__all__ = ["is_event_stream", "relay"]

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


def is_event_stream(resp: aiohttp.ClientResponse) -> bool:
    return resp.content_type == "text/event-stream"


def _copy_headers(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    *,
    on_chunk: Callable[[bytes], None] | None = None,
    extra_headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """Send ``upstream``'s status, headers and body to ``request``'s client."""
    headers = _copy_headers(upstream)
    if extra_headers:
        headers.update(extra_headers)
    if not is_event_stream(upstream):
        body = await upstream.read()
        if on_chunk is not None:
            on_chunk(body)
        return web.Response(status=upstream.status, body=body, headers=headers)
    headers["Cache-Control"] = "no-cache"
    headers["X-Accel-Buffering"] = "no"
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    await resp.prepare(request)
    async for chunk in upstream.content.iter_any():
        if on_chunk is not None:
            on_chunk(chunk)
        await resp.write(chunk)
    await resp.write_eof()
    return resp
