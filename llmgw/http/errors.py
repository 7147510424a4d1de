"""The errors of the upstream client (:mod:`llmgw.http.pool`), raised from
:meth:`~llmgw.http.pool.UpstreamPool.request` or while reading a body::

    LlmgwError
    └── UpstreamError               the upstream failed mid-response (-> 502)
        ├── UpstreamConnectError    could not connect: nothing was sent (retryable)
        ├── UpstreamDisconnected    sent, but the upstream went away before a byte of answer
        │                           (crashed, restarting, refused our certificate; retryable)
        ├── UpstreamProtocolError   the answer is not HTTP/1.x as we understand it
        ├── UpstreamTimeout         no byte from the upstream for ``read_timeout`` seconds
        └── UpstreamTooLarge        a body read whole is over ``max_body`` bytes

``retryable`` says whether the request may go to another replica: true while not a byte of
the answer arrived (a stale pooled connection is retried by the pool, once, on a new one).
"""

from __future__ import annotations

from llmgw.errors import LlmgwError

__all__ = [
    "NoAnswer",
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamTimeout",
    "UpstreamTooLarge",
    "describe",
]


class UpstreamError(LlmgwError):
    """The upstream failed after the request was sent, or answered something unusable."""


class UpstreamConnectError(UpstreamError):
    """The upstream could not be reached (refused, timed out, TLS refused); nothing was sent,
    so the request may be sent to another replica."""

    retryable = True


class UpstreamDisconnected(UpstreamError):
    """The upstream took the request, then closed the connection without a byte of answer: it
    went away (crashed, is restarting) or refused our certificate. Nothing was answered, so
    the request may be sent to another replica."""

    retryable = True


class UpstreamProtocolError(UpstreamError):
    """The upstream's answer is not a valid HTTP/1.x response."""


class UpstreamTimeout(UpstreamError):
    """The upstream sent nothing for the pool's ``read_timeout`` while an answer was due (a
    stalled or hostile engine); the connection is closed."""


class UpstreamTooLarge(UpstreamError):
    """A body read whole (not streamed) is larger than the pool's ``max_body``."""


class NoAnswer(UpstreamError):
    """The connection ended before any byte of the response; on a pooled connection that is
    the keep-alive race (the peer closed it as we reused it) and the request is retried."""

    def __init__(self, message: str, *, tls_refused: bool) -> None:
        super().__init__(message)
        self.tls_refused = tls_refused


def describe(exc: BaseException | None) -> str:
    """Why a connection ended, in words: the OS error's message, or the exception."""
    if exc is None:
        return "closed by the peer"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
