"""One keep-alive HTTP/1.1 connection to an upstream, as an :class:`asyncio.Protocol`, and
the parser of the response it is receiving.

Each request is written in one ``transport.write`` (a large body in pieces, as the transport
has room); the response head is parsed here, and the body, undone from its framing
(Content-Length, chunked, or until close), is handed to the
:class:`~llmgw.http.response.UpstreamResponse` as it arrives. A connection that receives
nothing for the pool's ``read_timeout`` seconds while an answer is due fails with
:class:`~llmgw.http.errors.UpstreamTimeout` (one timer per connection, re-armed lazily, not
one per chunk). The pool (:mod:`llmgw.http.pool`) is seen here as a :class:`ConnectionPool`.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Protocol, cast

from llmgw.http.errors import (
    NoAnswer,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
    describe,
)
from llmgw.http.response import UpstreamResponse

__all__ = ["MAX_HEAD_BYTES", "ConnectionPool", "UpstreamConnection"]

MAX_HEAD_BYTES = 64 * 1024  # status line + headers; aiohttp's server writes a few hundred
_MAX_CHUNK_LINE = 4096  # a chunk-size line with its extensions, or one trailer line
# Pause reading from the upstream while this much body waits for a slow consumer.
_HIGH_WATER = 256 * 1024
# A body the pool writes after the head (one larger than its _JOIN_BODY) goes in pieces of
# _BODY_PIECE, each once the transport has room (pause_writing/resume_writing):
# TLS encrypts what it is given into a memory buffer that keeps its largest size for the life
# of the connection, and a body written at once left 8 MiB there per pooled connection.
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


class ConnectionPool(Protocol):
    """What a connection needs of the pool that made it."""

    read_timeout: float | None  # seconds without a byte while an answer is due
    max_body: int | None  # the largest body a response reads whole

    def opened(self, conn: UpstreamConnection) -> None:
        """The connection is up (count it, idle or busy)."""

    def discard(self, conn: UpstreamConnection) -> None:
        """The connection is gone or going: never hand it out again."""

    def put_idle(self, conn: UpstreamConnection) -> None:
        """The connection is clean: keep it for the next request (or close it)."""


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection and the parser of the response it is receiving."""

    def __init__(
        self,
        pool: ConnectionPool,
        key: tuple[str, int, str | None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.pool = pool
        self.key = key
        self.loop = loop
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
        self.pool.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = self._gone = True
        self._stop_timer()
        self.pool.discard(self)
        self._ended(exc)
        self._wake_writer()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def eof_received(self) -> bool | None:
        self.lost = True
        self.pool.discard(self)
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
            raise NoAnswer(
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
            raise NoAnswer(
                f"cannot write to {host}:{port}: {describe(exc)}", tls_refused=False
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
                raise UpstreamError(f"cannot write to {host}:{port}: {describe(exc)}") from exc
            at += _BODY_PIECE

    def close(self) -> None:
        self.lost = self._closed_here = True
        self._stop_timer()
        self.pool.discard(self)
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

    def give_back(self) -> None:
        self.pool.put_idle(self)

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
                NoAnswer(
                    f"{host}:{port} closed the connection before answering ({describe(exc)})",
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
        self._fail(UpstreamError(f"{host}:{port} closed the connection {what} ({describe(exc)})"))

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
