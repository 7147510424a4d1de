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
        └── BodyIncomplete      the client stopped sending, or the framing is broken (-> 400)
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.client_exceptions import ClientPayloadError
from aiohttp.http_exceptions import HttpProcessingError

from llmgw.config_util import format_size
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
    "BodyTooLarge",
    "read_body",
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


class BodyBudget:
    """The body bytes a process holds at once, at most ``capacity``."""

    __slots__ = ("capacity", "used")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.capacity:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


async def read_body(request: web.Request, limit: int, budget: BodyBudget) -> bytes:
    """The whole body of ``request``, at most ``limit`` bytes, charged to ``budget``.

    The caller gives ``len(body)`` back to ``budget`` when done with it; on an error
    nothing stays charged. Raises :class:`BodyTooLarge` (at once when Content-Length is over
    the limit), :class:`BodiesBusy` or :class:`BodyIncomplete`.
    """
    declared = request.content_length
    content = request.content
    if declared is not None:
        if declared > limit:
            raise BodyTooLarge(limit, declared)
        if not budget.take(declared):
            raise BodiesBusy(budget.capacity)
        try:
            return await content.readexactly(declared) if declared else b""
        except (ClientPayloadError, HttpProcessingError, asyncio.IncompleteReadError) as exc:
            budget.give(declared)
            raise _incomplete(exc) from exc
        except BaseException:
            budget.give(declared)
            raise
    chunks: list[bytes] = []
    taken = 0
    try:
        while True:
            chunk = await content.readany()
            if not chunk:
                break
            n = len(chunk)
            if taken + n > limit:
                raise BodyTooLarge(limit, None)
            if not budget.take(n):
                raise BodiesBusy(budget.capacity)
            taken += n
            chunks.append(chunk)
    except (ClientPayloadError, HttpProcessingError) as exc:
        budget.give(taken)
        raise _incomplete(exc) from exc
    except BaseException:
        budget.give(taken)
        raise
    if not chunks:
        return b""
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _incomplete(exc: BaseException) -> BodyIncomplete:
    what = "it ended early" if isinstance(exc, asyncio.IncompleteReadError) else str(exc)
    return BodyIncomplete(f"the request body is incomplete or malformed ({what}); send it whole")
