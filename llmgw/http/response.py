"""One upstream response: its head at once, its body read whole or streamed as it arrives.

The connection it arrives on (:class:`~llmgw.http.connection.UpstreamConnection`, seen here
as a :class:`BodySource`) fills the body in: it appends to ``_chunks`` and ``_buffered``,
sets ``_done`` or ``_exc`` and calls ``_wake()`` directly, as that is the hot path of every
relayed byte. Bodies are never decompressed: ``Content-Encoding`` is the caller's business.
A body read whole is refused over ``limit`` bytes (the pool's ``max_body``), before it is
read when its Content-Length says so; streams are not capped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Protocol

from llmgw.http.errors import UpstreamError, UpstreamTooLarge

__all__ = ["BodySource", "UpstreamResponse"]


class BodySource(Protocol):
    """What a response needs of the connection its body arrives on."""

    paused: bool  # reading is paused while the consumer is behind
    loop: asyncio.AbstractEventLoop

    def resume(self) -> None:
        """Read from the upstream again."""

    def close(self) -> None:
        """Give the connection up: the upstream sees it go."""

    def give_back(self) -> None:
        """The whole body came in and the upstream keeps the connection: pool it."""


class UpstreamResponse:
    """One response: its head at once, its body through :meth:`read` or :meth:`iter_chunks`.

    Call :meth:`release` when done (or use ``async with``): the connection goes back to the
    pool only when the whole body came in and the upstream keeps the connection alive;
    otherwise it is closed, which is how an abandoned or cancelled request reaches the
    upstream.
    """

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_done",
        "_exc",
        "_waiter",
        "content_type",
        "headers",
        "keep_alive",
        "length",
        "limit",
        "reason",
        "status",
        "version",
    )

    def __init__(
        self,
        conn: BodySource | None,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        content_type: str,
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.version = "HTTP/1.1"
        self.status = status
        self.reason = reason
        self.headers = headers
        self.content_type = content_type
        self.keep_alive = keep_alive
        self.length: int | None = None  # the Content-Length, when the body is framed by one
        self.limit: int | None = None  # read() refuses a longer body (the pool's max_body)
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False
        self._exc: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def __repr__(self) -> str:
        return f"<UpstreamResponse {self.status} {self.content_type or '-'}>"

    def header(self, name: str, default: str | None = None) -> str | None:
        """The first header called ``name`` (any case), or ``default``."""
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return default

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived."""
        return self._done

    async def read(self) -> bytes:
        """The whole body (what :meth:`iter_chunks` has not yielded yet).

        Raises :class:`UpstreamTooLarge` when the body is longer than :attr:`limit`: at once
        when its Content-Length says so, else as soon as that much has arrived (so at most
        one read's worth more is held); the caller's ``release()`` then closes the connection.
        """
        limit = self.limit
        if limit is not None and self.length is not None and self.length > limit:
            raise self._too_large(self.length)
        while not self._done:
            if self._exc is not None:
                raise self._exc
            if limit is not None and self._buffered > limit:
                raise self._too_large(self._buffered)
            await self._wait()
        if limit is not None and self._buffered > limit:
            raise self._too_large(self._buffered)
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        return data

    async def until_body(self) -> None:
        """Wait until some of the body has arrived (or it ended, or failed), taking none of
        it: :meth:`iter_chunks` and :meth:`read` still give all of it."""
        while not self._chunks and not self._done and self._exc is None:
            await self._wait()

    def _too_large(self, size: int) -> UpstreamTooLarge:
        what = f"{size} bytes" if self.length is not None else f"over {self.limit} bytes"
        return UpstreamTooLarge(
            f"the answer's body is {what}, more than the limit of {self.limit} bytes for an "
            "answer that is not streamed (max_response_body)"
        )

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, undone from chunked encoding; pieces that came in while
        the consumer was busy are joined into one."""
        chunks = self._chunks
        while True:
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                self._buffered = 0
                conn = self._conn
                if conn is not None and conn.paused:
                    conn.resume()
                yield data
            elif self._done:
                return
            elif self._exc is not None:
                raise self._exc
            else:
                await self._wait()

    async def _wait(self) -> None:
        conn = self._conn
        if conn is None:
            raise UpstreamError("the response was released before its body was read")
        conn.resume()
        waiter = self._waiter = conn.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def release(self) -> None:
        """Give the connection back to the pool if it is clean, else close it. Idempotent."""
        conn = self._conn
        if conn is None:
            return
        self._conn = None
        if self._done and self.keep_alive:
            conn.give_back()
        else:
            conn.close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
