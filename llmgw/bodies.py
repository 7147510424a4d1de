"""Request bodies read under limits, so that memory stays bounded whatever clients send.

Every listener that takes bodies (the gateway and admin API on :8080, the data plane on
:9443) reads them through :func:`read_body`, charging them to the process's
:class:`BodyBudget` before it holds them. A body with a Content-Length is admitted whole or
not at all: over the limit or over what the budget has left, it is refused before a byte is
read (so that, when many arrive at once, some are served and the others are told to retry,
rather than all of them being refused half-read); the HTTP parser delivers no more than the
length says. A chunked body is counted and charged chunk by chunk, and refused after at most
one chunk more than the limit. The caller gives the bytes of a body it got back to the
budget once it no longer holds them.

Errors::

    LlmgwError
    └── BodyError               a request body was refused
        ├── BodyTooLarge        over the limit (-> 413)
        ├── BodiesBusy          the budget of body bytes in flight is spent (-> 503)
        ├── BodyIncomplete      the client stopped sending, or the framing is broken (-> 400)
        └── BodyTimeout         the body arrives too slowly (-> 408)
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Mapping
from typing import Any

from aiohttp import StreamReader, web
from aiohttp.client_exceptions import ClientPayloadError
from aiohttp.http_exceptions import HttpProcessingError

from llmgw.configfile import Checker, format_size
from llmgw.errors import LlmgwError

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BODY_BYTES",
    "DEFAULT_MAX_REQUEST_BODY",
    "DEFAULT_MAX_RESPONSE_BODY",
    "DEFAULT_UPSTREAM_IDLE_TIMEOUT",
    "MAX_BODY_HEADER",
    "BodiesBusy",
    "BodyBudget",
    "BodyError",
    "BodyIncomplete",
    "BodyTimeout",
    "BodyTooLarge",
    "parse_body_limits",
    "read_body",
    "return_large_buffers",
]

DEFAULT_MAX_REQUEST_BODY = 8 * 1024 * 1024
DEFAULT_MAX_INFLIGHT_BODY_BYTES = 256 * 1024 * 1024
# Answers that are not streamed (a non-streamed completion, an error) are read whole.
DEFAULT_MAX_RESPONSE_BODY = 64 * 1024 * 1024
# Seconds without a byte from an engine while an answer is due; a non-streamed completion
# sends nothing until it is done, so this is generous.
DEFAULT_UPSTREAM_IDLE_TIMEOUT = 300.0

# Sent by the gateway to the data plane: the request body limit of the request's model (a
# catalog profile may raise it). Only the control plane's certificate reaches the data plane,
# so the agent takes it as it takes the control plane's orders.
MAX_BODY_HEADER = "X-Llmgw-Max-Body"

# A body must arrive within BODY_TIME_BASE seconds plus its size at BODY_MIN_RATE bytes/s
# (8 MiB: 158 s), so that a client trickling it cannot hold its share of the budget for long.
BODY_TIME_BASE = 30.0
BODY_MIN_RATE = 64 * 1024


# glibc's mallopt() parameter, and the size from which allocations get their own mapping.
_M_MMAP_THRESHOLD = -3
_LARGE_BUFFER = 256 * 1024


def return_large_buffers() -> bool:
    """Have malloc give every allocation of 256 KiB or more its own mapping, so that the
    memory a large body took goes back to the system when the body is freed.

    glibc does so by default only until the first such block is freed; it then raises its
    threshold to that block's size (up to 32 MiB), after which multi-MiB bodies come from the
    heap and its memory stays with the process (measured: 765 MiB kept by the gateway after
    bursts of 8 MiB bodies, 340 MiB with this). Setting the threshold pins it; small
    allocations, the hot path's, are unaffected. Returns whether it was set (False off glibc).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, _LARGE_BUFFER))


class BodyError(LlmgwError):
    """A request body was refused."""


class BodyTooLarge(BodyError):
    """The body is longer than the limit; ``size`` is its declared length, or None when only
    "more than ``limit``" is known (it was being read)."""

    def __init__(self, limit: int, size: int | None) -> None:
        if size is not None:
            message = f"the request body is {size} bytes; the limit is {format_size(limit)}"
        else:
            message = f"the request body is over the limit of {format_size(limit)}"
        super().__init__(message)
        self.limit = limit
        self.size = size


class BodiesBusy(BodyError):
    """Taking more body bytes would exceed the process's budget; retry shortly."""

    retryable = True

    def __init__(self, capacity: int) -> None:
        super().__init__(
            f"request bodies in flight would exceed {format_size(capacity)} "
            "(max_inflight_body_bytes); retry in a moment"
        )
        self.capacity = capacity


class BodyIncomplete(BodyError):
    """The body ended before its declared length, or its chunked framing is broken."""


class BodyTimeout(BodyError):
    """The body did not arrive within the time its size allows."""

    def __init__(self, allowed: float) -> None:
        super().__init__(
            f"the request body did not arrive within {round(allowed, 1):g} s ({BODY_TIME_BASE:g} s "
            f"plus its size at {BODY_MIN_RATE // 1024} KiB/s); send it faster"
        )
        self.allowed = allowed


class BodyBudget:
    """The body bytes a process holds at once, at most ``capacity``.

    When the budget empties after having held ``trim_after`` bytes or more, the freed memory
    is handed back to the system (``malloc_trim``): the pieces of chunked bodies and the
    buffers of their relaying are smaller than a mapping of their own and would otherwise
    stay with the process, scattered through its heap. Under steady load the budget rarely
    empties and nothing is trimmed; the memory then stays in use, bounded by the budget.
    """

    __slots__ = ("_high", "capacity", "trim_after", "used")

    def __init__(self, capacity: int, *, trim_after: int = 64 * 1024 * 1024) -> None:
        self.capacity = capacity
        self.trim_after = trim_after
        self.used = 0
        self._high = 0  # the most held since the last trim

    def take(self, n: int) -> bool:
        used = self.used + n
        if used > self.capacity:
            return False
        self.used = used
        if used > self._high:
            self._high = used
        return True

    def give(self, n: int) -> None:
        self.used -= n
        if not self.used and self._high >= self.trim_after:
            self._high = 0
            _malloc_trim()


def _malloc_trim() -> None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return  # not glibc
    trim(0)


async def read_body(request: web.BaseRequest, limit: int, budget: BodyBudget) -> bytes:
    """The whole body of ``request``, at most ``limit`` bytes, charged to ``budget``.

    The caller gives ``len(body)`` back to ``budget`` when done with it; on an error
    nothing stays charged. Raises :class:`BodyTooLarge` (at once when Content-Length is over
    the limit), :class:`BodiesBusy`, :class:`BodyIncomplete` or :class:`BodyTimeout` (a body
    that has not arrived within ``BODY_TIME_BASE`` seconds plus its size, or the limit, at
    ``BODY_MIN_RATE``: a client cannot hold its share of the budget by trickling).
    """
    declared = request.content_length
    content = request.content
    if declared is not None:
        if declared > limit:
            raise BodyTooLarge(limit, declared)
        if not budget.take(declared):
            raise BodiesBusy(budget.capacity)
    held = [declared or 0]  # bytes charged so far, given back on failure
    try:
        if declared is not None and content.total_bytes >= declared:
            # All here already (nearly every body): taken without a coroutine in between.
            if not declared:
                return b""
            data = content.read_nowait(declared)
            if len(data) < declared:
                data += await content.readexactly(declared - len(data))
            return data
        allowed = BODY_TIME_BASE + (declared if declared is not None else limit) / BODY_MIN_RATE
        try:
            async with asyncio.timeout(allowed):
                return await _read(content, declared, limit, budget, held)
        except TimeoutError:
            raise BodyTimeout(allowed) from None
    except (ClientPayloadError, HttpProcessingError, asyncio.IncompleteReadError) as exc:
        budget.give(held[0])
        raise _incomplete(exc) from exc
    except BaseException:
        budget.give(held[0])
        raise


async def _read(
    content: StreamReader, declared: int | None, limit: int, budget: BodyBudget, held: list[int]
) -> bytes:
    if declared is not None:
        # The HTTP parser delivers no more than the declared length.
        return await content.readexactly(declared) if declared else b""
    chunks: list[bytes] = []
    while True:
        chunk = await content.readany()
        if not chunk:
            break
        n = len(chunk)
        if held[0] + n > limit:
            raise BodyTooLarge(limit, None)
        if not budget.take(n):
            raise BodiesBusy(budget.capacity)
        held[0] += n
        chunks.append(chunk)
    if not chunks:
        return b""
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _incomplete(exc: BaseException) -> BodyIncomplete:
    what = "it ended early" if isinstance(exc, asyncio.IncompleteReadError) else str(exc)
    return BodyIncomplete(f"the request body is incomplete or malformed ({what}); send it whole")


def parse_body_limits(check: Checker, top: Mapping[str, object]) -> dict[str, Any]:
    """max_request_body, max_inflight_body_bytes, max_response_body and upstream_idle_timeout
    of a configuration file's top level (server.yaml and agent.yaml take the same keys), by
    their names; the timeout in the one duration syntax (llmgw.durations)."""

    def size(name: str, default: int) -> int:
        value = top.get(name)
        return default if value is None else check.size(value, name, minimum=1024)

    request = size("max_request_body", DEFAULT_MAX_REQUEST_BODY)
    inflight = size("max_inflight_body_bytes", DEFAULT_MAX_INFLIGHT_BODY_BYTES)
    if inflight < request:
        check.fail(
            "max_inflight_body_bytes",
            f"is {format_size(inflight)}, less than max_request_body ({format_size(request)}): "
            "no request of the largest size could ever be taken; raise it",
        )
    idle = DEFAULT_UPSTREAM_IDLE_TIMEOUT
    if top.get("upstream_idle_timeout") is not None:
        idle = check.duration(top["upstream_idle_timeout"], "upstream_idle_timeout")
        if not 1 <= idle <= 86400:
            check.fail("upstream_idle_timeout", "must be from 1 s to 1 d")
    return {
        "max_request_body": request,
        "max_inflight_body_bytes": inflight,
        "max_response_body": size("max_response_body", DEFAULT_MAX_RESPONSE_BODY),
        "upstream_idle_timeout": idle,
    }
