"""Every HTTP listener of llmgw (:8080, :8443, :9443) accepts connections here, so that a slow
or greedy client holds one only for a bounded time.

aiohttp bounds neither the time a client takes to send its request header (its keep-alive
timer is an hour long) nor, behind ``ssl=``, the TLS handshake beyond asyncio's 60 s, and it
cannot count connections per client address. :class:`GuardedSite` is a ``TCPSite`` whose
connections pass through a small protocol that:

* refuses a connection at once when its source address already holds ``per_source`` of them
  (counted from the TCP accept, so handshakes in progress count);
* does the TLS handshake itself (the accepted socket handed to
  ``loop.connect_accepted_socket``) with ``handshake_timeout``;
* closes a connection whose request header (request line and headers) is not complete within
  ``header_timeout`` of its first byte (or of the connection, for the first request), with
  ``408 Request Timeout`` when some of it arrived;
* closes a connection whose request body, while the server reads it, goes ``body_timeout``
  without a byte (a slow upload that keeps coming is not cut). Idle kept-alive connections
  are left to aiohttp's keep-alive timer.

Each listener logs what it closed as one summary line at most every :data:`LOG_EVERY` s.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.web_protocol import RequestHandler, _ErrInfo
from aiohttp.web_request import BaseRequest

from llmgw.configfile import Checker, join_key
from llmgw.log import kv

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_HEADER_TIMEOUT",
    "GuardedSite",
    "ListenerLimits",
    "connection_state",
    "listening_socket",
    "parse_listener_limits",
]

log = logging.getLogger("llmgw.listener")

DEFAULT_HEADER_TIMEOUT = 15.0
"""Seconds a client may take to send a request's line and headers."""
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
"""Seconds a client may take to complete the TLS handshake."""
DEFAULT_BODY_TIMEOUT = 30.0
"""Seconds a request body may pause between two bytes."""
CUT_GRACE = 2.0
"""Seconds a TLS connection that timed out has to take our close before its socket goes."""
LOG_EVERY = 60.0
"""A listener logs the connections it closed at most once per this many seconds."""

_408 = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
)


@dataclass(frozen=True)
class ListenerLimits:
    """How long and how many: the slow-client limits of one listener."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    """Seconds a request body may go without a byte arriving (while the server reads it)."""
    per_source: int = 0
    """Concurrent connections one source address may hold (0: no limit)."""


def parse_listener_limits(
    check: Checker,
    value: object,
    key: str,
    *,
    extra: Mapping[str, int] | None = None,
) -> tuple[ListenerLimits, dict[str, int]]:
    """``header_timeout``, ``handshake_timeout`` and ``body_timeout`` (durations such as ``10``,
    ``500ms`` or ``2m``, 0.1 s to 10 min) of a
    ``key:`` mapping,
    plus the connection caps named in ``extra`` (name -> default; 0 means no cap).
    Returns the limits (without a cap) and the caps by name."""
    caps = dict(extra or {})
    accepted = ("header_timeout", "handshake_timeout", "body_timeout", *caps)
    data = {} if value is None else check.mapping(value, key, accepted=accepted)

    def seconds(name: str, default: float) -> float:
        item = data.get(name)
        if item is None:
            return default
        return check.duration(item, join_key(key, name), minimum=0.1, maximum=600)

    for name in caps:
        item = data.get(name)
        if item is None:
            continue
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= 1_000_000:
            check.fail(
                join_key(key, name),
                f"must be a whole number of connections from 0 (no cap) to 1000000, got {item!r}",
            )
        caps[name] = item
    limits = ListenerLimits(
        header_timeout=seconds("header_timeout", DEFAULT_HEADER_TIMEOUT),
        handshake_timeout=seconds("handshake_timeout", DEFAULT_HANDSHAKE_TIMEOUT),
        body_timeout=seconds("body_timeout", DEFAULT_BODY_TIMEOUT),
    )
    return limits, caps


class GuardedSite(web.BaseSite):
    """A TCP site (TLS when ``ssl_context`` is given) with :class:`ListenerLimits`."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        *,
        label: str,
        limits: ListenerLimits,
        ssl_context: ssl.SSLContext | None = None,
        backlog: int = 128,
        reuse_address: bool = True,
        hint: str = "",
        sock: socket.socket | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        # A listening socket that outlives this site (a control plane changing role keeps
        # its port: connections wait in the backlog instead of being refused); a duplicate
        # of it is served and closed with the site.
        self._sock = sock
        self._host = host
        self._port = port
        self._reuse_address = reuse_address
        self.label = label
        self.limits = limits
        self.hint = hint
        self.bound_port = port
        self.per_source: collections.Counter[str] = collections.Counter()
        self.closed: collections.Counter[str] = collections.Counter()
        self._unlogged: collections.Counter[str] = collections.Counter()
        self._logged_at = -LOG_EVERY
        self._last_source = ""
        self._flush: asyncio.TimerHandle | None = None
        self.handshakes: set[asyncio.Task[None]] = set()

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host}:{self.bound_port}"

    @property
    def ssl_context(self) -> ssl.SSLContext | None:
        return self._ssl_context

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        if self._sock is not None:
            self._server = await loop.create_server(
                lambda: _Gate(self, server), sock=self._sock.dup(), backlog=self._backlog
            )
        else:
            self._server = await loop.create_server(
                lambda: _Gate(self, server),
                self._host,
                self._port,
                backlog=self._backlog,
                reuse_address=self._reuse_address,
            )
        sockets = self._server.sockets
        self.bound_port = int(sockets[0].getsockname()[1]) if sockets else self._port

    async def stop(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        await super().stop()
        # The runner closes the connections it knows; these it does not know yet.
        for task in list(self.handshakes):
            task.cancel()
        await asyncio.gather(*self.handshakes, return_exceptions=True)

    # -- bookkeeping the gates call -----------------------------------------------------------

    def admit(self, source: str) -> bool:
        cap = self.limits.per_source
        if cap and self.per_source[source] >= cap:
            return False
        self.per_source[source] += 1
        return True

    def release(self, source: str) -> None:
        self.per_source[source] -= 1
        if self.per_source[source] <= 0:
            del self.per_source[source]

    def note(self, what: str, source: str) -> None:
        """Count a connection closed for ``what``; log a summary now or within LOG_EVERY."""
        self.closed[what] += 1
        self._unlogged[what] += 1
        self._last_source = source
        now = time.monotonic()
        if now - self._logged_at >= LOG_EVERY:
            self._log()
        elif self._flush is None:
            loop = asyncio.get_running_loop()
            self._flush = loop.call_later(self._logged_at + LOG_EVERY - now, self._log)

    def _log(self) -> None:
        self._flush = None
        if not self._unlogged:
            return
        self._logged_at = time.monotonic()
        counts = dict(self._unlogged)
        self._unlogged.clear()
        reasons = {
            "header_timeout": f"no complete request header within {self.limits.header_timeout:g} s",
            "handshake": f"no TLS handshake within {self.limits.handshake_timeout:g} s, or a "
            "failed one",
            "per_source": f"over {self.limits.per_source} connections from one address",
            "body_timeout": f"a request body paused for {self.limits.body_timeout:g} s",
        }
        why = "; ".join(f"{n} {reasons[k]}" for k, n in sorted(counts.items()))
        log.warning(
            f"closed slow or excess client connections ({why}); if real clients are cut off, "
            f"raise the limits{' (' + self.hint + ')' if self.hint else ''}",
            extra=kv(listener=self.label, last_source=self._last_source, **counts),
        )


def connection_state(request: BaseRequest) -> dict[str, object]:
    """A dict that lives as long as ``request``'s connection (accepted by a
    :class:`GuardedSite`), for what a handler learns once per connection: the data plane
    keeps there what the client's certificate says. Any other request gets an empty dict
    that keeps nothing."""
    handler = request.protocol
    if isinstance(handler, _Handler):
        return handler.state
    return {}


class _Handler(RequestHandler):
    """aiohttp's connection handler, answering what it cannot parse with a JSON error and one
    log line (aiohttp logs a traceback for every malformed request and answers text)."""

    __slots__ = ("_label", "state")
    _label: str
    state: dict[str, object]  # connection_state: set in _Gate._attach, gone with the handler

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        peer = request.remote or ""
        gone = request.transport is None or request.transport.is_closing()
        if isinstance(exc, ConnectionError) and gone:
            # The client went away (or was cut off) while its request was read: no bug.
            log.info(
                "a client went away during its request",
                extra=kv(listener=self._label, peer=peer, reason=str(exc)[:200]),
            )
            text = "the connection was lost while the request was read"
            kind, code = "invalid_request_error", "connection_lost"
        elif status >= 500:
            # Not the client's doing (a handler raised): keep the traceback for the bug report.
            log.error(
                "a request handler failed", extra=kv(listener=self._label, peer=peer), exc_info=exc
            )
            text = "the server failed on this request; its operator finds why in its log"
            kind, code = "server_error", "internal_error"
        else:
            reason = getattr(exc, "message", None) or str(exc or message or "")
            reason = " ".join(str(reason).split())[:200]
            log.info(
                "refused a malformed HTTP request",
                extra=kv(listener=self._label, peer=peer, status=status, reason=reason),
            )
            text = f"the request is not valid HTTP/1.1 ({reason}); send a well-formed request"
            kind, code = "invalid_request_error", "bad_http_request"
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was already under way; the connection is closed")
        body = {"error": {"message": text, "type": kind, "param": None, "code": code}}
        resp = web.json_response(body, status=status)
        resp.force_close()
        return resp


def _refuse_targetless(messages: collections.deque[Any], new: int) -> None:
    """The new requests in ``messages`` whose target aiohttp's parser left without a URL (a
    CONNECT without host:port) become parse errors, answered by _Handler.handle_error: aiohttp
    3.14's request factory fails on them outside its own error handling, and the connection
    would stay open with no answer."""
    for i in range(max(0, len(messages) - new), len(messages)):
        message, _payload = messages[i]
        if isinstance(message, RawRequestMessage) and message.url is None:
            problem = BadHttpMessage(f"{message.method} without a host:port target")
            messages[i] = (_ErrInfo(400, problem, problem.message), EMPTY_PAYLOAD)


class _Gate(asyncio.Protocol):
    """One accepted connection: admission, TLS, header timing; then aiohttp's handler."""

    def __init__(self, site: GuardedSite, server: web.Server) -> None:
        self._site = site
        self._server = server
        self._source: str | None = None
        self._raw: asyncio.Transport | None = None
        self._handler: RequestHandler | None = None
        self._handshake: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at_count = 0
        self._got_bytes = False
        self._payload: Any = None
        self._released = False
        self._body_timer: asyncio.TimerHandle | None = None
        self._body_deadline = 0.0

    # -- admission and TLS --------------------------------------------------------------------

    def connection_made(self, base: asyncio.BaseTransport) -> None:
        # A cast, not an isinstance check: uvloop's transports are not asyncio.Transport.
        transport = cast(asyncio.Transport, base)
        if self._handshake is not None:
            # The TLS transport, its handshake done (see _tls).
            self._raw = transport
            self._attach(transport)
            return
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if not self._site.admit(source):
            self._released = True
            self._site.note("per_source", source)
            transport.abort()
            return
        self._source = source
        ctx = self._site.ssl_context
        if ctx is None:
            self._raw = transport
            self._attach(transport)
            return
        # The TLS layer is given the socket itself, on a transport of its own that reads
        # nothing before the handshake starts: start_tls on this transport loses the
        # client's first flight under uvloop, which reads it (for this protocol) before a
        # task could call start_tls.
        try:
            sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
        except OSError:
            self._site.note("handshake", source)
            self._release()
            transport.abort()
            return
        transport.set_protocol(asyncio.Protocol())  # its end is not this connection's
        transport.abort()
        self._handshake = task = asyncio.ensure_future(self._tls(sock, ctx))
        self._site.handshakes.add(task)
        task.add_done_callback(self._site.handshakes.discard)

    async def _tls(self, sock: socket.socket, ctx: ssl.SSLContext) -> None:
        loop = asyncio.get_running_loop()
        try:
            # connection_made is called again, with the TLS transport, once the handshake is
            # done: that attaches aiohttp's handler.
            await loop.connect_accepted_socket(
                lambda: self,
                sock,
                ssl=ctx,
                ssl_handshake_timeout=self._site.limits.handshake_timeout,
            )
        except asyncio.CancelledError:
            sock.close()
            self._release()
            raise
        except (OSError, ssl.SSLError, TimeoutError, RuntimeError):
            # A scanner, a client that never finished, or one that does not trust us.
            sock.close()
            self._site.note("handshake", self._source or "?")
            self._release()
            return
        if self._handler is None:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            if self._source is not None:
                self._site.release(self._source)

    def _attach(self, transport: asyncio.Transport) -> None:
        server = self._server
        handler = _Handler(server, loop=asyncio.get_running_loop(), **server._kwargs)
        handler._label = self._site.label
        handler.state = {}
        self._handler = handler
        handler.connection_made(transport)
        self._arm()

    # -- header timing ------------------------------------------------------------------------
    # aiohttp's parser counts the requests whose header it completed (_request_count) and
    # queues each with its body stream (_messages): a new count means a complete header.

    def _arm(self) -> None:
        assert self._handler is not None
        self._armed_at_count = self._handler._request_count
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._site.limits.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._got_bytes = False

    def _expire(self) -> None:
        self._timer = None
        handler = self._handler
        if handler is None or handler.transport is None:
            return
        if handler._request_count != self._armed_at_count:
            return
        self._site.note("header_timeout", self._source or "?")
        if self._got_bytes:
            body = (
                b'{"error": {"message": "the request header did not arrive within %g s; '
                b'send it at once", "type": "invalid_request_error", "code": "request_timeout"}}'
                % self._site.limits.header_timeout
            )
            handler.transport.write(_408 % (len(body), body))
        self._cut(handler)

    def _cut(self, handler: RequestHandler) -> None:
        """Close a connection we gave up on. Over TLS a close waits for the client's
        close_notify (up to 30 s) while the connection still counts: a client that never
        answers is cut off at the socket after CUT_GRACE."""
        handler.force_close()
        raw = self._raw
        if raw is not None and self._site.ssl_context is not None:
            asyncio.get_running_loop().call_later(CUT_GRACE, raw.abort)

    def data_received(self, data: bytes) -> None:
        handler = self._handler
        if handler is None:
            return  # the connection is being cut (refused, or its handshake failed)
        # The first bytes of another request (not of a body still arriving)?
        starting = self._timer is None and (self._payload is None or self._payload.is_eof())
        if data:
            self._got_bytes = True
        before = handler._request_count
        handler.data_received(data)
        if handler._request_count != before:
            messages = handler._messages
            _refuse_targetless(messages, handler._request_count - before)
            self._payload = messages[-1][1] if messages else None
            self._disarm()
        elif starting:
            # Its header is not complete in these bytes: time it from now. (A header that
            # comes whole, as nearly all do, costs no timer.)
            self._arm()
        if self._payload is not None and not self._payload.is_eof():
            # A body is arriving: it may pause, but not for body_timeout.
            self._body_deadline = time.monotonic() + self._site.limits.body_timeout
            if self._body_timer is None:
                loop = asyncio.get_running_loop()
                self._body_timer = loop.call_later(self._site.limits.body_timeout, self._check_body)

    def _check_body(self) -> None:
        self._body_timer = None
        handler, payload = self._handler, self._payload
        if handler is None or handler.transport is None or payload is None or payload.is_eof():
            return
        now = time.monotonic()
        if handler._reading_paused:
            # The server is not reading (its buffer is full): the client is not the slow one.
            self._body_deadline = now + self._site.limits.body_timeout
        elif now >= self._body_deadline:
            self._site.note("body_timeout", self._source or "?")
            self._cut(handler)
            return
        loop = asyncio.get_running_loop()
        self._body_timer = loop.call_later(self._body_deadline - now, self._check_body)

    def eof_received(self) -> None:
        # aiohttp's handler ignores a half-close (returning None closes the transport); the
        # answer to a request already read still goes out.
        if self._handler is not None:
            self._handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._handshake is not None and not self._handshake.done():
            self._handshake.cancel()
        self._release()
        handler, self._handler = self._handler, None
        if handler is not None:
            handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()


def listening_socket(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A bound, listening TCP socket for *host* (a name, an IP, or a wildcard) and *port* (0:
    a free one), for :class:`GuardedSite`'s ``sock``; ``OSError`` when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    infos = socket.getaddrinfo(host or None, port, family=0, type=socket.SOCK_STREAM)
    if infos:
        family = infos[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4] if infos else (host, port))
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock
