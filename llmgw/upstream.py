"""A lean HTTP/1.1 client for the two relay hops (gateway -> agent, data plane -> engine).

aiohttp's client costs more CPU per request than the rest of a relay hop together; this one
keeps a pool of keep-alive connections built on :class:`asyncio.Protocol`, writes each
request in one ``transport.write`` and parses the (small) response head itself. Bodies are
never decompressed: ``Content-Encoding`` is the caller's business.

Errors, all raised from :meth:`UpstreamPool.request` or while reading a body::

    LlmgwError
    └── UpstreamError               the upstream failed mid-response (-> 502)
        ├── UpstreamConnectError    could not connect: nothing was sent (retryable)
        ├── UpstreamDisconnected    sent, but the upstream went away before a byte of answer
        │                           (crashed, restarting, refused our certificate; retryable)
        ├── UpstreamProtocolError   the answer is not HTTP/1.x as we understand it
        ├── UpstreamTimeout         no byte from the upstream for ``read_timeout`` seconds
        └── UpstreamTooLarge        a body read whole is over ``max_body`` bytes

``retryable`` says whether the request may go to another replica: true while not a byte of
the answer arrived (a stale pooled connection is retried here, once, on a new one).

A hostile or broken upstream cannot hold a caller forever nor fill its memory: a connection
that receives nothing for ``read_timeout`` seconds while an answer is due fails with
:class:`UpstreamTimeout` (one timer per connection, re-armed lazily, not one per chunk), and
:meth:`UpstreamResponse.read` refuses a body over ``max_body`` bytes, before reading it when
its Content-Length says so.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import cast

from llmgw.errors import LlmgwError

__all__ = [
    "UpstreamConnectError",
    "UpstreamDisconnected",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTimeout",
    "UpstreamTooLarge",
]

MAX_HEAD_BYTES = 64 * 1024  # status line + headers; aiohttp's server writes a few hundred
_MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions, or one trailer line
# Pause reading from the upstream while this much body waits for a slow consumer.
_HIGH_WATER = 256 * 1024
# Bodies larger than this are written after the head instead of joined to it (one copy less),
# in pieces of _BODY_PIECE, each once the transport has room (pause_writing/resume_writing):
# TLS encrypts what it is given into a memory buffer that keeps its largest size for the life
# of the connection, and a body written at once left 8 MiB there per pooled connection.
_JOIN_BODY = 64 * 1024
_BODY_PIECE = 256 * 1024

_HEX = b"0123456789abcdefABCDEF"
_VERSIONS = frozenset(("HTTP/1.1", "HTTP/1.0"))
# Response headers that decide how the body is framed and what it is.
_H_LENGTH, _H_ENCODING, _H_CONNECTION, _H_TYPE = range(4)
_FRAMING = {
    "content-length": _H_LENGTH,
    "transfer-encoding": _H_ENCODING,
    "connection": _H_CONNECTION,
    "content-type": _H_TYPE,
}
# Parser states of a connection.
_IDLE, _HEAD, _LENGTH, _CHUNKED, _UNTIL_CLOSE = range(5)
# Sub-states of a chunked body.
_C_SIZE, _C_DATA, _C_CRLF, _C_TRAILER = range(4)


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


class _NoAnswer(UpstreamError):
    """The connection ended before any byte of the response; on a pooled connection that is
    the keep-alive race (the peer closed it as we reused it) and the request is retried."""

    def __init__(self, message: str, *, tls_refused: bool) -> None:
        super().__init__(message)
        self.tls_refused = tls_refused


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "closed by the peer"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


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
        conn: _Connection | None,
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
            conn.pool._put(conn)
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


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the parser of the response it is receiving."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, str | None]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool._loop
        self.transport: asyncio.Transport | None = None
        self.lost = False  # EOF, error or close seen: never reuse
        self._gone = False  # connection_lost() was called
        self._closed_here = False  # by close(): a response in progress was given up here
        self.paused = False
        self.idle_since = 0.0
        self._closed: asyncio.Future[None] | None = None
        self._state = _IDLE
        self._buf = b""  # an incomplete head, chunk-size line or trailer
        self._got = False  # a byte of the current response arrived
        self._head_only = False  # HEAD request: no body whatever the headers say
        self._head_waiter: asyncio.Future[UpstreamResponse] | None = None
        self._resp: UpstreamResponse | None = None
        self._remaining = 0
        self._cstate = _C_SIZE
        # The idle-read timer: one per connection, re-armed when it fires (not per chunk).
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        # Flow control of a large request body.
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports are not asyncio.Transport.
        self.transport = cast(asyncio.Transport, transport)
        self.pool._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self._gone = True
        self._stop_timer()
        self.pool._forget(self)
        self._ended(exc)
        self._wake_writer()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def eof_received(self) -> bool | None:
        self.lost = True
        self.pool._forget(self)
        self._ended(None)
        return None  # let the transport close itself

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._last_read = self.loop.time()  # the upstream is taking the body: not idle
        self._wake_writer()

    def _wake_writer(self) -> None:
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        self._got = True
        self._last_read = self.loop.time()
        try:
            state = self._state
            if state == _LENGTH:
                self._feed_length(data)
            elif state == _CHUNKED:
                self._feed_chunked(data)
            elif state == _HEAD:
                self._feed_head(data)
            elif state == _UNTIL_CLOSE:
                self._push(data)
            else:
                # Bytes nobody asked for: the connection is out of step; never reuse it.
                self.close()
        except UpstreamProtocolError as exc:
            self._fail(exc)

    # -- sending -------------------------------------------------------------------------------

    async def send(self, data: bytes, head_only: bool, body: bytes = b"") -> UpstreamResponse:
        transport = self.transport
        assert transport is not None and self._state == _IDLE
        host, port, _ = self.key
        if self.lost:
            # The peer closed it between the connect (or the last response) and now.
            raise _NoAnswer(
                f"{host}:{port} closed the connection at once",
                tls_refused=self._refused_in_tls13(),
            )
        self._state = _HEAD
        self._got = False
        self._head_only = head_only
        waiter = self._head_waiter = self.loop.create_future()
        try:
            transport.write(data)
        except (OSError, RuntimeError) as exc:
            self._state = _IDLE
            self._head_waiter = None
            self.close()
            raise _NoAnswer(
                f"cannot write to {host}:{port}: {_describe(exc)}", tls_refused=False
            ) from exc
        self._last_read = self.loop.time()
        if self._timer is None and self.pool.read_timeout is not None:
            self._timer = self.loop.call_at(
                self._last_read + self.pool.read_timeout, self._check_idle
            )
        try:
            if body:
                await self._write_body(transport, body, waiter)
            return await waiter
        except BaseException:
            # Cancelled (the client went away) or failed: the upstream must see the
            # connection go, and a half-used connection is never reused.
            self.close()
            raise
        finally:
            self._head_waiter = None

    async def _write_body(
        self, transport: asyncio.Transport, body: bytes, waiter: asyncio.Future[UpstreamResponse]
    ) -> None:
        """Write ``body`` a piece at a time, each when the transport has room; stop early if
        the answer (or the end of the connection) comes first."""
        view = memoryview(body)
        at, end = 0, len(body)
        while at < end:
            if waiter.done() or self.lost:
                # Answered before the whole body went (say, a refusal): never reuse this one.
                self.lost = True
                return
            if self._write_paused:
                drain = self._drain = self.loop.create_future()
                try:
                    await drain
                finally:
                    self._drain = None
                continue
            try:
                transport.write(view[at : at + _BODY_PIECE])
            except (OSError, RuntimeError) as exc:
                host, port, _ = self.key
                raise UpstreamError(f"cannot write to {host}:{port}: {_describe(exc)}") from exc
            at += _BODY_PIECE

    def close(self) -> None:
        self.lost = self._closed_here = True
        self._stop_timer()
        self.pool._forget(self)
        if self.transport is not None:
            self.transport.close()
        self._wake_writer()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_idle(self) -> None:
        """The idle-read timer fired: fail the answer in progress if nothing arrived for
        ``read_timeout`` seconds, else wait until that would be so."""
        self._timer = None
        timeout = self.pool.read_timeout
        if self._state == _IDLE or self.lost or timeout is None:
            return  # no answer due: the next request arms the timer again
        now = self.loop.time()
        if self.paused:
            # Reading is paused because our consumer is slow, not the upstream.
            self._last_read = now
        due = self._last_read + timeout
        if now >= due:
            host, port, _ = self.key
            self._fail(
                UpstreamTimeout(
                    f"{host}:{port} sent nothing for {timeout:g} s while an answer was due; "
                    "gave up on it (upstream_idle_timeout sets how long to wait)"
                )
            )
            if self.transport is not None:
                self.transport.abort()  # a peer that reads nothing would hold a close forever
            return
        self._timer = self.loop.call_at(due, self._check_idle)

    def resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    # -- parsing -------------------------------------------------------------------------------

    def _feed_head(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD_BYTES:
                raise UpstreamProtocolError(
                    f"the response head is longer than {MAX_HEAD_BYTES} bytes"
                )
            self._buf = buf
            return
        self._buf = b""
        resp, has_body = self._parse_head(buf[:end])
        rest = buf[end + 4 :]
        if resp is None:  # 1xx: an interim answer, the real one follows
            if rest:
                self._feed_head(rest)
            return
        self._resp = resp
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(resp)
        if not has_body:
            self._finish(rest)
        elif rest:
            state = self._state
            if state == _LENGTH:
                self._feed_length(rest)
            elif state == _CHUNKED:
                self._feed_chunked(rest)
            else:
                self._push(rest)

    def _parse_head(self, head: bytes) -> tuple[UpstreamResponse | None, bool]:
        lines = head.decode("latin-1").split("\r\n")
        line = lines[0]
        version, _, rest = line.partition(" ")
        code, _, reason = rest.partition(" ")
        if version not in _VERSIONS or len(code) != 3 or not code.isdigit() or code[0] == "0":
            raise UpstreamProtocolError(f"malformed status line {line[:100]!r}")
        status = int(code)
        del lines[0]
        headers: list[tuple[str, str]] = []
        length: int | None = None
        chunked = False
        close = version == "HTTP/1.0"
        content_type = ""
        for line in lines:
            name, sep, value = line.partition(":")
            if not sep or not name or " " in name or "\t" in name:
                raise UpstreamProtocolError(f"malformed header line {line[:100]!r}")
            value = value.strip(" \t")
            headers.append((name, value))
            kind = _FRAMING.get(name.lower())
            if kind is None:
                continue
            if kind == _H_LENGTH:
                if not value.isdigit() or not value.isascii():
                    raise UpstreamProtocolError(f"malformed Content-Length {value[:40]!r}")
                n = int(value)
                if length is not None and length != n:
                    raise UpstreamProtocolError("conflicting Content-Length headers")
                length = n
            elif kind == _H_TYPE:
                content_type = value.partition(";")[0].strip(" \t").lower()
            elif kind == _H_CONNECTION:
                tokens = {t.strip(" \t") for t in value.lower().split(",")}
                if "close" in tokens:
                    close = True
                elif "keep-alive" in tokens:
                    close = False
            else:
                codings = [c.strip(" \t") for c in value.lower().split(",")]
                if any(c not in ("chunked", "identity", "") for c in codings):
                    raise UpstreamProtocolError(f"unsupported Transfer-Encoding {value[:60]!r}")
                chunked = chunked or "chunked" in codings
        if status < 200:
            if status == 101:
                raise UpstreamProtocolError("the upstream switched protocols (101)")
            return None, False
        if self._head_only or status == 204 or status == 304:
            self._state = _IDLE
            has_body = False
        elif chunked:
            self._state = _CHUNKED
            self._cstate = _C_SIZE
            if length is not None:
                close = True  # both framings: RFC 9112 says do not reuse the connection
            has_body = True
        elif length is not None:
            self._state = _LENGTH
            self._remaining = length
            has_body = length > 0
        else:
            self._state = _UNTIL_CLOSE
            close = True
            has_body = True
        resp = UpstreamResponse(self, status, reason, headers, content_type, not close)
        resp.version = version
        resp.limit = self.pool.max_body
        if self._state == _LENGTH:
            resp.length = length
        return resp, has_body

    def _feed_length(self, data: bytes) -> None:
        n = len(data)
        remaining = self._remaining
        if n < remaining:
            self._remaining = remaining - n
            self._push(data)
        elif n == remaining:
            self._remaining = 0
            self._push(data)
            self._finish(b"")
        else:
            self._remaining = 0
            self._push(data[:remaining])
            self._finish(data[remaining:])

    def _feed_chunked(self, data: bytes) -> None:
        if self._buf:
            data = self._buf + data
            self._buf = b""
        pos = 0
        end = len(data)
        out: list[bytes] = []
        while pos < end:
            cstate = self._cstate
            if cstate == _C_DATA:
                take = min(self._remaining, end - pos)
                out.append(data[pos : pos + take] if take != end or pos else data)
                pos += take
                self._remaining -= take
                if not self._remaining:
                    self._cstate = _C_CRLF
            elif cstate == _C_CRLF:
                if end - pos < 2:
                    if data[pos:] != b"\r":
                        raise UpstreamProtocolError("chunk data not followed by CRLF")
                    self._buf = data[pos:]
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise UpstreamProtocolError("chunk data not followed by CRLF")
                pos += 2
                self._cstate = _C_SIZE
            else:
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if end - pos > _MAX_CHUNK_LINE:
                        raise UpstreamProtocolError("a chunk-size or trailer line is too long")
                    self._buf = data[pos:]
                    break
                line = data[pos:eol]
                pos = eol + 2
                if cstate == _C_SIZE:
                    size_text = line.partition(b";")[0].strip(b" \t")
                    if not size_text or len(size_text) > 16 or size_text.strip(_HEX):
                        raise UpstreamProtocolError(f"malformed chunk size {line[:40]!r}")
                    size = int(size_text, 16)
                    if size:
                        self._remaining = size
                        self._cstate = _C_DATA
                    else:
                        self._cstate = _C_TRAILER
                elif not line:  # the empty line after the last chunk and its trailers
                    if out:
                        self._push(out[0] if len(out) == 1 else b"".join(out))
                    self._finish(data[pos:])
                    return
        if out:
            self._push(out[0] if len(out) == 1 else b"".join(out))

    def _push(self, data: bytes) -> None:
        resp = self._resp
        if resp is None:
            return
        resp._chunks.append(data)
        resp._buffered += len(data)
        if resp._buffered >= _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        resp._wake()

    def _finish(self, extra: bytes) -> None:
        """The body is complete."""
        self._state = _IDLE
        resp = self._resp
        self._resp = None
        if extra:
            # More than the response: out of step, never reuse.
            self.lost = True
            if resp is not None:
                resp.keep_alive = False
        if resp is not None:
            resp._done = True
            resp._wake()

    def _fail(self, exc: UpstreamError) -> None:
        self._state = _IDLE
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        resp = self._resp
        self._resp = None
        if resp is not None:
            resp._exc = exc
            resp._wake()
        self.close()

    def _ended(self, exc: BaseException | None) -> None:
        """The connection is gone (EOF, error or our own close)."""
        state = self._state
        if state == _IDLE:
            return
        if state == _UNTIL_CLOSE and exc is None:
            self._finish(b"")
            return
        host, port, _ = self.key
        if self._closed_here and exc is None:
            self._fail(UpstreamError(f"the connection to {host}:{port} was closed on this side"))
            return
        if state == _HEAD and not self._got:
            self._fail(
                _NoAnswer(
                    f"{host}:{port} closed the connection before answering ({_describe(exc)})",
                    tls_refused=isinstance(exc, ssl.SSLError) or self._refused_in_tls13(),
                )
            )
            return
        if state == _HEAD:
            what = "in the middle of the response head"
        elif state == _LENGTH:
            what = f"with {self._remaining} bytes of the body still to come"
        else:
            what = "before the end of the chunked body"
        self._fail(UpstreamError(f"{host}:{port} closed the connection {what} ({_describe(exc)})"))

    def _refused_in_tls13(self) -> bool:
        """Whether a TLS 1.3 server most likely refused our certificate: in 1.3 the client's
        handshake ends before the server checks the client certificate, and a server that
        refuses it may just close (asyncio's does, without an alert). One that accepted it
        sends a session ticket at once; none came."""
        sslobj = self.transport.get_extra_info("ssl_object") if self.transport else None
        if sslobj is None or sslobj.version() != "TLSv1.3":
            return False
        session = sslobj.session
        return session is None or not session.has_ticket

    async def wait_closed(self) -> None:
        if self.transport is None or self._gone:
            return
        if self._closed is None:
            self._closed = self.loop.create_future()
        await self._closed


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections, pooled per (host, port, server_hostname).

    Made inside the running event loop that uses it. ``ssl`` is used for every connection
    (the gateway's client identity towards agents);
    ``server_hostname`` names the certificate expected from the peer. Idle connections are
    closed after ``idle_timeout`` seconds; keep it below the upstream's own keep-alive
    timeout, so that the upstream rarely closes a connection as we reuse it.
    """

    def __init__(
        self,
        *,
        ssl: ssl.SSLContext | None = None,
        connect_timeout: float = 5.0,
        idle_timeout: float = 60.0,
        max_idle_per_key: int = 256,
        peer_check: Callable[[bytes, str | None], str | None] | None = None,
        read_timeout: float | None = None,
        max_body: int | None = None,
    ) -> None:
        self._ssl = ssl
        # With TLS: called once per new connection with the peer's certificate (DER) and the
        # expected server_hostname; a message refuses the connection (e.g. a revoked serial).
        self._peer_check = peer_check
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self.max_idle_per_key = max_idle_per_key
        # Seconds without a byte while an answer is due before it fails (None: wait forever).
        self.read_timeout = read_timeout
        # The largest body UpstreamResponse.read() accepts (None: any); streams are not capped.
        self.max_body = max_body
        self._loop = asyncio.get_running_loop()
        # LIFO per key (dicts pop their last item): the warmest connection is reused first.
        self._idle: dict[tuple[str, int, str | None], dict[_Connection, None]] = {}
        self._conns: set[_Connection] = set()  # every open connection, idle or busy
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def connections(self) -> int:
        """Open connections, idle or busy."""
        return len(self._conns)

    async def request(
        self,
        method: str,
        host: str,
        port: int,
        path: str,
        *,
        body: bytes = b"",
        headers: Sequence[tuple[str, str]] = (),
        server_hostname: str | None = None,
    ) -> UpstreamResponse:
        """Send one request and return once the response head is in.

        Raises :class:`UpstreamConnectError` when nothing could be sent,
        :class:`UpstreamDisconnected` when the upstream closed the connection without
        answering (both ``retryable``), :class:`UpstreamError` when it failed after that.
        Call ``release()`` on the response.
        """
        if self._closed:
            raise UpstreamConnectError("the upstream pool is closed")
        key = (host, port, server_hostname)
        if len(body) > _JOIN_BODY:
            data, rest = _encode(method, host, port, path, b"", headers, length=len(body)), body
        else:
            data, rest = _encode(method, host, port, path, body, headers), b""
        head_only = method == "HEAD"
        conn = self._pop_idle(key)
        if conn is not None:
            try:
                return await conn.send(data, head_only, rest)
            except _NoAnswer:
                pass  # the peer closed it as we reused it: once more on a new connection
        conn = await self._connect(key)
        try:
            return await conn.send(data, head_only, rest)
        except _NoAnswer as exc:
            if exc.tls_refused:
                raise UpstreamConnectError(
                    f"{host}:{port} closed the connection right after the TLS handshake, "
                    "before answering: it is going away, or it refused our client "
                    "certificate (then check that it trusts the CA that issued it)"
                ) from exc
            raise UpstreamDisconnected(str(exc)) from exc

    async def close(self) -> None:
        """Close every connection, idle or busy, and wait (briefly) until they are gone."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        self._idle.clear()
        conns = list(self._conns)
        for conn in conns:
            conn.close()
        if conns:
            waits = [asyncio.ensure_future(c.wait_closed()) for c in conns]
            _, pending = await asyncio.wait(waits, timeout=1.0)
            for wait in pending:
                wait.cancel()

    # -- connections ---------------------------------------------------------------------------

    async def _connect(self, key: tuple[str, int, str | None]) -> _Connection:
        host, port, server_hostname = key
        ssl_context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self._loop.create_connection(
                    lambda: _Connection(self, key),
                    host,
                    port,
                    ssl=ssl_context,
                    server_hostname=(server_hostname or host) if ssl_context else None,
                )
        except TimeoutError as exc:
            raise UpstreamConnectError(
                f"connecting to {host}:{port} timed out after {self.connect_timeout:g}s"
            ) from exc
        except ssl.SSLCertVerificationError as exc:
            raise UpstreamConnectError(
                f"{host}:{port} presented a certificate we do not trust for "
                f"{server_hostname or host!r}: {exc.verify_message}"
            ) from exc
        except ssl.SSLError as exc:
            raise UpstreamConnectError(f"TLS with {host}:{port} failed: {exc}") from exc
        except OSError as exc:
            raise UpstreamConnectError(
                f"cannot connect to {host}:{port}: {_describe(exc)}"
            ) from exc
        if self._closed:
            conn.close()
            raise UpstreamConnectError("the upstream pool is closed")
        if self._peer_check is not None and ssl_context is not None:
            sslobj = conn.transport.get_extra_info("ssl_object") if conn.transport else None
            der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
            problem = (
                self._peer_check(der, server_hostname)
                if der
                else f"{host}:{port} presented no certificate"
            )
            if problem:
                conn.close()
                raise UpstreamConnectError(f"{host}:{port}: {problem}")
        return conn

    def forget(self, server_hostname: str) -> int:
        """Close every connection, idle or busy, made to ``server_hostname`` (its certificate
        was revoked); returns how many were closed."""
        gone = [c for c in self._conns if c.key[2] == server_hostname]
        for conn in gone:
            conn.close()
        for key in [k for k in self._idle if k[2] == server_hostname]:
            del self._idle[key]
        return len(gone)

    def _pop_idle(self, key: tuple[str, int, str | None]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        deadline = self._loop.time() - self.idle_timeout
        while idle:
            conn, _ = idle.popitem()
            transport = conn.transport
            if conn.lost or transport is None or transport.is_closing():
                conn.close()
            elif conn.idle_since < deadline:
                conn.close()
            else:
                return conn
        return None

    def _put(self, conn: _Connection) -> None:
        if conn.lost or self._closed or conn.transport is None or conn.transport.is_closing():
            conn.close()
            return
        conn.resume()
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = {}
        if len(idle) >= self.max_idle_per_key:
            conn.close()
            return
        conn.idle_since = self._loop.time()
        idle[conn] = None
        if self._sweeper is None:
            self._sweeper = self._loop.call_later(self.idle_timeout, self._sweep)

    def _forget(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        idle = self._idle.get(conn.key)
        if idle is not None:
            idle.pop(conn, None)

    def _sweep(self) -> None:
        self._sweeper = None
        deadline = self._loop.time() - self.idle_timeout
        oldest: float | None = None
        for idle in list(self._idle.values()):
            for conn in list(idle):
                if conn.idle_since <= deadline:
                    conn.close()
                elif oldest is None or conn.idle_since < oldest:
                    oldest = conn.idle_since
        if oldest is not None and not self._closed:
            delay = max(oldest + self.idle_timeout - self._loop.time(), 0.05)
            self._sweeper = self._loop.call_later(delay, self._sweep)


def _encode(
    method: str,
    host: str,
    port: int,
    path: str,
    body: bytes,
    headers: Sequence[tuple[str, str]],
    *,
    length: int | None = None,
) -> bytes:
    """The request as bytes: request line, headers, Content-Length, body (``length``: only
    the head of a request whose body of that length is written separately)."""
    if not path.startswith("/") or not path.isprintable() or " " in path:
        raise ValueError(f"not a valid request target: {path!r}")
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    head = f"{method} {path} HTTP/1.1\r\nHost: {authority}\r\n"
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} contains a line break")
        head += f"{name}: {value}\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    elif body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        head += f"Content-Length: {len(body)}\r\n"
    head += "\r\n"
    return head.encode("utf-8", "surrogateescape") + body
