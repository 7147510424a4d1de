"""Relay an upstream HTTP response to a downstream client, streaming SSE chunk by chunk.

Used by both hops of a request: the gateway (client -> agent) and the agent's data plane
(gateway -> engine). Bodies pass through unchanged (:mod:`llmgw.http.pool` never
decompresses), so ``Content-Encoding`` is copied like any other end-to-end header. Event
streams are written as they arrive, never buffered and never compressed; other bodies are
read whole (up to the pool's ``max_body``) and sent with a Content-Length. A stream that
fails half-way (the upstream stalls, dies or sends what a consumer refuses) ends with an
OpenAI-shaped error event and a proper end of the body, which clients report as an error.

The gateway asks every stream for its usage; for a client that did not, the relay drops that
one chunk again (:class:`UsageChunkDropper`) and passes every other byte as it comes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web

from llmgw.http.errors import UpstreamError
from llmgw.http.response import UpstreamResponse

# Set on answers the data plane gives without having passed the request to an engine
# (draining, shard not ready): the gateway may send the request to another replica.
NOT_PROCESSED = "X-Llmgw-Not-Processed"
# Set on the data plane's 502 when the engine took the request and failed before its answer
# was whole (killed, reset, silent past the read timeout): nothing of the answer reached the
# gateway, which may send the request again, whole, to another replica. Its value: why
# (reset, timeout). An older agent does not set it (such a 502 is then relayed as it is).
ENGINE_FAILED = "X-Llmgw-Engine-Failed"

# Where relay() leaves the error that ended an event stream early, on the response it returns
# (aiohttp responses are mappings for such per-request data).
STREAM_ERROR: web.ResponseKey[UpstreamError] = web.ResponseKey("llmgw_stream_error", UpstreamError)
# An event stream the gateway began before it had a replica (SSE comments while a cold start
# kept the request waiting): the answer goes on in it, status and headers already sent.
STARTED_STREAM: web.RequestKey[web.StreamResponse] = web.RequestKey(
    "llmgw_started_stream", web.StreamResponse
)

__all__ = [
    "ENGINE_FAILED",
    "NOT_PROCESSED",
    "SSE_HEADERS",
    "STARTED_STREAM",
    "STREAM_ERROR",
    "EventFilter",
    "LineEnds",
    "UsageChunkDropper",
    "error_event",
    "is_event_stream",
    "relay",
]

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


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_event(message: str, code: str = "upstream_error") -> bytes:
    """An SSE event carrying an OpenAI-shaped error. It starts with a blank line, which ends
    an event left incomplete (and is ignored after a complete one)."""
    error = {"message": message, "type": "server_error", "param": None, "code": code}
    return b"\n\ndata: " + json.dumps({"error": error}).encode() + b"\n\n"


class LineEnds:
    """An event stream's line ends made LF across its chunks: SSE allows CRLF and CR too,
    and a CR that ends a chunk may be the first half of a CRLF. ``cr``: the last chunk ended
    in one (a LF first in the next is its pair)."""

    __slots__ = ("cr",)

    def __init__(self) -> None:
        self.cr = False

    def lf(self, chunk: bytes) -> bytes:
        if self.cr:
            self.cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            self.cr = chunk[-1:] == b"\r"
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return chunk


class UsageChunkDropper:
    """Takes OpenAI's usage chunk out of an event stream: the event whose data has empty
    ``choices`` and a ``usage`` object, sent before ``[DONE]`` when ``stream_options.
    include_usage`` asks for it (a client that did not ask may read ``choices[0]`` of every
    chunk). Every other event passes unchanged, the first usage chunk only is dropped.

    Nothing is buffered but the part of an event a chunk ends inside (rare: engines write
    whole events), held until the event ends, at most ``max_event`` bytes (then passed on).
    A chunk that ends an event and carries no ``"usage"`` goes as it came, never copied;
    once the usage chunk is dropped, every byte does. A stream with CR line ends goes on
    with LF ones (the same events to an SSE reader).

    With ``rewrite``, the usage chunk is not dropped but sent with its ``usage`` as
    ``rewrite`` changes it (the gateway's own figures for the client)."""

    __slots__ = ("_ends", "_held", "dropped", "max_event", "rewrite")

    def __init__(
        self,
        max_event: int = 1024 * 1024,
        rewrite: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.max_event = max_event
        self.rewrite = rewrite
        self._held = b""  # the start of an event not ended yet
        self._ends = LineEnds()
        self.dropped = False

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` to send now."""
        if (
            not self._held
            and not self._ends.cr
            and chunk[-2:] == b"\n\n"
            and b'"usage"' not in chunk
        ):
            # Nearly every chunk: whole events (it ends at one's end), none of them ours.
            return chunk
        return self._feed(chunk)

    def _feed(self, chunk: bytes) -> bytes:
        chunk = self._ends.lf(chunk)
        if self._held:
            chunk = self._held + chunk
            self._held = b""
        if self.dropped:
            return chunk
        if chunk.endswith(b"\n\n"):
            done = chunk
        else:
            cut = chunk.rfind(b"\n\n") + 2  # 1: no complete event in it
            if cut == 1 and chunk == b"\n":
                return chunk  # the blank line of an event already sent whole
            done, rest = (chunk[:cut], chunk[cut:]) if cut > 1 else (b"", chunk)
            if len(rest) > self.max_event:
                return chunk  # no event of ours is this long: not held any longer
            self._held = rest
        if b'"usage"' not in done:
            return done
        done = self._drop(done)
        if self.dropped and self._held:  # from here on every byte goes as it comes
            done, self._held = done + self._held, b""
        return done

    def end(self) -> bytes:
        """What is still held when the stream ends."""
        held, self._held = self._held, b""
        return held

    def _drop(self, done: bytes) -> bytes:
        events = done.split(b"\n\n")
        for i, event in enumerate(events):
            if b'"usage"' in event and _is_usage_chunk(event):
                self.dropped = True
                if self.rewrite is None:
                    del events[i]
                else:
                    events[i] = self._rewritten(event)
                return b"\n\n".join(events)
        return done

    def _rewritten(self, event: bytes) -> bytes:
        at = event.find(b"data:")
        data = json.loads(event[at + 5 :].split(b"\n", 1)[0])
        assert self.rewrite is not None
        self.rewrite(data["usage"])
        return b"data: " + json.dumps(data, separators=(",", ":")).encode()


def _is_usage_chunk(event: bytes) -> bool:
    at = event.find(b"data:")
    if at < 0 or (at > 0 and event[at - 1 : at] != b"\n"):
        return False
    try:
        data = json.loads(event[at + 5 :].split(b"\n", 1)[0])
    except ValueError:
        return False
    return (
        isinstance(data, dict) and data.get("choices") == [] and isinstance(data.get("usage"), dict)
    )


class EventFilter(Protocol):
    """What an event stream passes through before the client (the gateway's
    :class:`~llmgw.server.gateway.resume.StreamSplice`)."""

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` to send; may raise UpstreamError (the stream is broken)."""
        ...

    def end(self) -> None:
        """The upstream's body ended; UpstreamError when the stream is not whole."""
        ...

    def goes_on(self, exc: UpstreamError) -> bool:
        """The stream broke with ``exc``: True when the caller continues it in the same
        response (no error event is written)."""
        ...


async def relay(
    request: web.BaseRequest,
    upstream: UpstreamResponse,
    *,
    on_chunk: Callable[[bytes], None] | None = None,
    extra_headers: dict[str, str] | None = None,
    drop_usage: bool = False,
    events: EventFilter | None = None,
    usage: Callable[[dict[str, Any]], None] | None = None,
) -> web.StreamResponse:
    """Send ``upstream``'s status, headers and body to ``request``'s client.

    The caller releases ``upstream`` afterwards (its connection goes back to the pool only
    when the body was read to the end). An :class:`~llmgw.http.errors.UpstreamError` reading a
    body read whole propagates (nothing was sent yet: the caller answers 502); one during an
    event stream, from the upstream or from ``on_chunk``, ends the client's stream with
    :func:`error_event` and is left on the returned response under :data:`STREAM_ERROR`
    (``upstream.complete`` is then false). ``drop_usage``: the stream's usage chunk, which
    the gateway asked for on the client's behalf, is not sent (:class:`UsageChunkDropper`);
    else with ``usage``, the usage chunk's ``usage`` is sent as ``usage`` changes it.
    ``events``: an event stream's chunks pass through it first; a stream it says goes on
    after a failure gets no error event (the caller writes the rest into the response).
    """
    started = request.get(STARTED_STREAM) if isinstance(request, web.Request) else None
    if upstream.content_type != "text/event-stream":
        body = await upstream.read()
        if on_chunk is not None:
            on_chunk(body)
        if started is not None:  # the client has a 200 and an event stream already
            await started.write(error_event(_error_message(body, upstream.status)))
            return started
        return web.Response(
            status=upstream.status, body=body, headers=_copy_headers(upstream, extra_headers)
        )
    if started is not None:
        resp = started
    else:
        replace = {**extra_headers, **SSE_HEADERS} if extra_headers else SSE_HEADERS
        resp = web.StreamResponse(status=upstream.status, headers=_copy_headers(upstream, replace))
        await resp.prepare(request)
    dropper = None
    if drop_usage or usage is not None:
        dropper = UsageChunkDropper(rewrite=None if drop_usage else usage)
    try:
        async for chunk in upstream.iter_chunks():
            if on_chunk is not None:
                on_chunk(chunk)
            if events is not None:
                chunk = events.feed(chunk)
                if not chunk:
                    continue
            if dropper is not None:
                chunk = dropper.feed(chunk)
                if not chunk:
                    continue
            await resp.write(chunk)
        if events is not None:
            events.end()
        if dropper is not None and (held := dropper.end()):
            await resp.write(held)
    except UpstreamError as exc:
        # The client has the status line and part of the stream: an error response is no
        # longer possible, an error event is (OpenAI's clients raise it).
        resp[STREAM_ERROR] = exc
        held = dropper.end() if dropper is not None else b""
        if events is not None and events.goes_on(exc):
            if held:
                with contextlib.suppress(ConnectionError):
                    await resp.write(held)
            return resp
        with contextlib.suppress(ConnectionError):  # the client may be gone too
            await resp.write(held + error_event(f"the stream ended early: {exc}"))
    # aiohttp ends the stream once the handler returns, quietly if the client has gone.
    return resp


def _error_message(body: bytes, status: int) -> str:
    """What an engine's error answer says (OpenAI's shape), for an error event."""
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return f"the replica answered {status}"
