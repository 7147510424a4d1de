"""A lean HTTP/1.1 client for the two relay hops (gateway -> agent, data plane -> engine):
a pool of keep-alive connections per (host, port, server_hostname).

aiohttp's client costs more CPU per request than the rest of a relay hop together; this one
keeps its connections (:mod:`llmgw.http.connection`, built on :class:`asyncio.Protocol`),
writes each request in one ``transport.write`` and parses the (small) response head itself.
Bodies are never decompressed: ``Content-Encoding`` is the caller's business. The errors
are those of :mod:`llmgw.http.errors`; a stale pooled connection is retried here, once, on
a new one.

A hostile or broken upstream cannot hold a caller forever nor fill its memory: a connection
that receives nothing for ``read_timeout`` seconds while an answer is due fails with
:class:`~llmgw.http.errors.UpstreamTimeout`, and
:meth:`~llmgw.http.response.UpstreamResponse.read` refuses a body over ``max_body`` bytes.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence

from llmgw.http.connection import UpstreamConnection
from llmgw.http.errors import NoAnswer, UpstreamConnectError, UpstreamDisconnected, describe
from llmgw.http.response import UpstreamResponse

__all__ = ["UpstreamPool"]

# Bodies larger than this are written after the head instead of joined to it (one copy less,
# see the connection's _BODY_PIECE).
_JOIN_BODY = 64 * 1024


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
        self._idle: dict[tuple[str, int, str | None], dict[UpstreamConnection, None]] = {}
        self._conns: set[UpstreamConnection] = set()  # every open connection, idle or busy
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False
        # Connections made under a TLS context that was since replaced (retrust): they
        # finish the request they carry and are closed instead of going back to idle.
        self._stale: set[UpstreamConnection] = set()

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
            except NoAnswer:
                pass  # the peer closed it as we reused it: once more on a new connection
        conn = await self._connect(key)
        try:
            return await conn.send(data, head_only, rest)
        except NoAnswer as exc:
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

    async def _connect(self, key: tuple[str, int, str | None]) -> UpstreamConnection:
        host, port, server_hostname = key
        ssl_context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self._loop.create_connection(
                    lambda: UpstreamConnection(self, key, self._loop),
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
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {describe(exc)}") from exc
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

    def retrust(self, ssl_context: ssl.SSLContext) -> int:
        """Use ``ssl_context`` for every connection from now on (a CA rotation changed
        what peers are trusted, or a dropped CA is trusted no more): idle connections are
        closed, busy ones finish their request and are closed then, so that no request after
        this rides a handshake verified under the old trust. Returns how many were open."""
        self._ssl = ssl_context
        open_now = list(self._conns)
        self._stale.update(open_now)
        for idle in self._idle.values():
            for conn in list(idle):
                conn.close()
        self._idle.clear()
        return len(open_now)

    def _pop_idle(self, key: tuple[str, int, str | None]) -> UpstreamConnection | None:
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

    # -- ConnectionPool: what the connections tell their pool ----------------------------------

    def opened(self, conn: UpstreamConnection) -> None:
        self._conns.add(conn)

    def put_idle(self, conn: UpstreamConnection) -> None:
        if (
            conn.lost
            or self._closed
            or conn in self._stale
            or conn.transport is None
            or conn.transport.is_closing()
        ):
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

    def discard(self, conn: UpstreamConnection) -> None:
        self._conns.discard(conn)
        self._stale.discard(conn)
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
