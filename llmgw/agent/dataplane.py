"""The agent's data plane on :9443: mTLS, only the control plane's certificate, relays to engines.

Only a client certificate that carries the control plane's extended key usage
(:data:`llmgw.pki.CONTROL_PLANE_OID`) is served; any other certificate of the cluster CA (a
node's) gets 403, and so does a retired control-plane instance's (its serial among those
the leader sent: :meth:`llmgw.agent.servers.KnownServers.is_retired`), checked on every
request, so that a connection open when the instance was retired is refused too.

The gateway sends ``/s/<shard-id>/v1/...``; the data plane forwards the body unchanged to
the shard's engine on 127.0.0.1 (kept-alive connections from :mod:`llmgw.http.pool`) and
relays the answer back chunk by chunk. A client that goes away cancels the handler, which
closes its engine connection: that is how the engine learns to stop.

Bodies are read under limits (:mod:`llmgw.bodies`): the request's limit is the one the
gateway names in ``X-Llmgw-Max-Body`` (its model's, from the catalog), else agent.yaml's
``max_request_body``; all requests together hold at most ``max_inflight_body_bytes``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aiohttp import HttpVersion11, hdrs, web
from cryptography import x509

from llmgw.agent.traffic import ShardTraffic
from llmgw.bodies import (
    DEFAULT_MAX_INFLIGHT_BODY_BYTES,
    DEFAULT_MAX_REQUEST_BODY,
    DEFAULT_MAX_RESPONSE_BODY,
    DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    MAX_BODY_HEADER,
    BodiesBusy,
    BodyBudget,
    BodyIncomplete,
    BodyTimeout,
    BodyTooLarge,
    read_body,
    return_large_buffers,
)
from llmgw.errors import CertificateError, ConfigError
from llmgw.http.errors import (
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamTooLarge,
)
from llmgw.http.pool import UpstreamPool
from llmgw.http.relay import ENGINE_FAILED, NOT_PROCESSED, relay
from llmgw.listener import GuardedSite, ListenerLimits, connection_state
from llmgw.netaddr import parse_hostport
from llmgw.pki import control_plane_problem, serial_hex

__all__ = ["DataPlane", "server_ssl_context"]

log = logging.getLogger("llmgw.agent.dataplane")


def server_ssl_context(cert: Path, key: Path, ca: Path) -> ssl.SSLContext:
    """TLS for the data plane: our node certificate, client certificates from the cluster CA."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(cafile=str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise CertificateError(
            f"cannot load the node identity ({cert}, {key}, {ca}): {exc}; "
            "re-issue it ('llmgw ctl cert issue-client NODE') or rejoin the node"
        ) from exc
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _error(
    status: int,
    message: str,
    code: str,
    *,
    unprocessed: bool = False,
    headers: dict[str, str] | None = None,
) -> web.Response:
    if unprocessed:
        headers = {**(headers or {}), NOT_PROCESSED: "1"}
    return web.json_response(
        {"error": {"message": message, "type": "llmgw_dataplane_error", "code": code}},
        status=status,
        headers=headers,
    )


class DataPlane:
    """The mTLS listener that relays control-plane requests to local engines."""

    def __init__(
        self,
        listen: str,
        ssl_context: ssl.SSLContext,
        port_of: Callable[[str], int | None],
        *,
        limits: ListenerLimits | None = None,
        max_request_body: int = DEFAULT_MAX_REQUEST_BODY,
        max_inflight_body_bytes: int = DEFAULT_MAX_INFLIGHT_BODY_BYTES,
        max_response_body: int = DEFAULT_MAX_RESPONSE_BODY,
        upstream_idle_timeout: float = DEFAULT_UPSTREAM_IDLE_TIMEOUT,
        retired: Callable[[str], bool] = lambda _serial: False,
        traffic: ShardTraffic | None = None,
    ) -> None:
        self.host, self.port = parse_hostport(listen, allow_zero=True)
        self.limits = limits or ListenerLimits()
        self.max_request_body = max_request_body
        self.bodies = BodyBudget(max_inflight_body_bytes)
        self.max_response_body = max_response_body
        self.upstream_idle_timeout = upstream_idle_timeout
        self.ssl_context = ssl_context
        self.port_of = port_of
        # Whether a certificate serial is a retired control-plane instance's.
        self.retired = retired
        self.inflight = 0
        # Per shard, what a retired shard's drain waits on (llmgw.agent.traffic).
        self.traffic = traffic if traffic is not None else ShardTraffic()
        self.accepting = True
        self._idle = asyncio.Event()
        self._runner: web.ServerRunner | None = None
        self._session: UpstreamPool | None = None
        self.bound_port: int = 0

    def _server(self) -> web.Server:
        # aiohttp's low-level server: one handler for every path, without an Application's
        # router and middleware chain (a tenth of the hop's Python time, profiled, went there).
        return web.Server(
            self._serve,
            handler_cancellation=True,
            access_log=None,
            # Longer than the gateway's pool keeps idle connections, so it closes first.
            keepalive_timeout=300,
        )

    async def start(self) -> None:
        return_large_buffers()  # large bodies' memory goes back to the system once freed
        # Plain HTTP to engines on 127.0.0.1. Idle connections go after 4 s: engines served by
        # uvicorn (vLLM) close theirs after 5 s, and closing first avoids the keep-alive race.
        self._session = UpstreamPool(
            connect_timeout=5.0,
            idle_timeout=4.0,
            read_timeout=self.upstream_idle_timeout,
            max_body=self.max_response_body,
        )
        self._runner = web.ServerRunner(self._server(), shutdown_timeout=30.0)
        await self._runner.setup()
        site = GuardedSite(
            self._runner,
            self.host,
            self.port,
            label="dataplane",
            limits=self.limits,
            ssl_context=self.ssl_context,
            backlog=1024,
            hint="listeners in agent.yaml",
        )
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(
                f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}; free the port "
                "or change listen in agent.yaml",
                key="listen",
            ) from exc
        self.bound_port = site.bound_port
        log.info(
            "data plane listening", extra={"fields": {"addr": f"{self.host}:{self.bound_port}"}}
        )

    async def drain(self, timeout: float = 30.0) -> None:
        """Stop taking new requests and wait (up to ``timeout``) for in-flight ones."""
        self.accepting = False
        if self.inflight:
            self._idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _peer_refusal(self, request: web.BaseRequest) -> str | None:
        """None when the connection's client certificate is a current control-plane
        instance's, else the answer's message. The certificate is read once per connection
        (decoding it on every request costs more than relaying), its serial looked up among
        the retired on every request; a refusal is logged once per connection."""
        # Kept with the connection (not in a map keyed by its transport: uvloop's cannot be
        # weakly referenced, and a strong map would need its own cleanup).
        state = connection_state(request)
        peer = state.get(_PEER)
        if not isinstance(peer, _Peer):
            transport = request.transport
            if transport is None:
                return "only the control plane may use the data plane"
            peer = state[_PEER] = _peer(transport)
            if peer.problem:  # once per connection, however many requests it sends
                log.warning(
                    "refused a data-plane request from a certificate that is not the control "
                    "plane's",
                    extra={"fields": {"peer": str(request.remote), "reason": peer.problem}},
                )
        if peer.problem:
            return "only the control plane may use the data plane"
        if self.retired(peer.serial):
            if not peer.retired:
                peer.retired = True
                log.warning(
                    f"refused a data-plane request from a retired control-plane instance's "
                    f"certificate (serial {peer.serial}); only current instances are served",
                    extra={"fields": {"peer": str(request.remote), "serial": peer.serial}},
                )
            return (
                f"this certificate (serial {peer.serial}) is a retired control-plane "
                "instance's; only current instances may use the data plane"
            )
        return None

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        """``/s/<shard>/<anything>``, any method; any other path is not found (as the
        Application's route ``/s/{shard}/{tail:.*}`` answered)."""
        match = _ROUTE.fullmatch(request.rel_url.path_safe)
        if match is None:
            raise web.HTTPNotFound()
        shard_id = match.group(1)
        if "%" in shard_id:  # path_safe keeps %2F and %25 encoded, as the router undid them
            shard_id = shard_id.replace("%2F", "/").replace("%25", "%")
        if request.version == HttpVersion11 and hdrs.EXPECT in request.headers:
            await _expect(request)
        return await self._handle(request, shard_id)

    async def _handle(self, request: web.BaseRequest, shard_id: str) -> web.StreamResponse:
        refusal = self._peer_refusal(request)
        if refusal is not None:
            return _error(403, refusal, "forbidden")
        if not self.accepting:
            return _error(
                503,
                "agent is shutting down; retry on another replica",
                "draining",
                unprocessed=True,
            )
        port = self.port_of(shard_id)
        if port is None:
            return _error(
                503,
                f"shard {shard_id} is not ready on this node",
                "shard_not_ready",
                unprocessed=True,
            )
        assert self._session is not None
        try:
            body = await read_body(request, self._body_limit(request), self.bodies)
        except BodyTooLarge as exc:
            return _error(
                413,
                f"{exc}; raise max_request_body in the model's catalog profile (the gateway "
                "passes it on), or in agent.yaml for requests that name no limit",
                "request_too_large",
            )
        except BodiesBusy as exc:
            # Not handed to an engine: the gateway may try another replica.
            return _error(
                503, str(exc), "overloaded", unprocessed=True, headers={"Retry-After": "1"}
            )
        except BodyIncomplete as exc:
            return _error(400, str(exc), "incomplete_body")
        except BodyTimeout as exc:
            return _error(408, str(exc), "body_timeout")
        try:
            return await self._relay(request, shard_id, port, body)
        finally:
            self.bodies.give(len(body))

    def _body_limit(self, request: web.BaseRequest) -> int:
        """The gateway's limit for this request's model (only the control plane gets here),
        else agent.yaml's; never more than the whole budget."""
        given = request.headers.get(MAX_BODY_HEADER)
        limit = self.max_request_body
        if given is not None and given.isascii() and given.isdigit() and len(given) <= 12:
            limit = int(given)
        return min(limit, self.bodies.capacity)

    async def _relay(
        self, request: web.BaseRequest, shard_id: str, port: int, body: bytes
    ) -> web.StreamResponse:
        assert self._session is not None
        # The target as the gateway sent it (still percent-encoded, with its query), less
        # the /s/<shard> prefix.
        url = request.rel_url
        raw = url.raw_path
        target = raw[raw.index("/", 3) :]
        if url.raw_query_string:
            target += "?" + url.raw_query_string
        ctype = request.headers.get("Content-Type")
        self.inflight += 1
        self.traffic.enter(shard_id)
        try:
            upstream = await self._session.request(
                request.method,
                "127.0.0.1",
                port,
                target,
                body=body,
                headers=(("Content-Type", ctype),) if ctype else (),
            )
            try:
                return await relay(request, upstream)
            finally:
                # Closed unless read to the end: a cancelled handler closes the engine's
                # connection, which is how the engine learns that the client went away.
                upstream.release()
        except UpstreamConnectError as exc:
            # Nothing reached the engine (it is stopping, or restarting): the gateway may send
            # the request to another replica.
            return _error(
                502,
                f"engine of shard {shard_id} did not answer: {exc}",
                "engine_unreachable",
                unprocessed=True,
            )
        except (UpstreamError, ValueError) as exc:
            failed = None
            if isinstance(exc, UpstreamError) and not isinstance(exc, UpstreamTooLarge):
                # The engine took it and failed before its answer was whole (killed, reset,
                # silent): the gateway may ask another replica, whole.
                failed = {ENGINE_FAILED: "timeout" if isinstance(exc, UpstreamTimeout) else "reset"}
            return _error(
                502,
                f"engine of shard {shard_id} did not answer: {exc}",
                "engine_unreachable",
                headers=failed,
            )
        finally:
            self.inflight -= 1
            self.traffic.leave(shard_id)
            if not self.inflight:
                self._idle.set()


# The route's pattern: a shard (as aiohttp's {shard}: one segment without braces) and a tail.
_ROUTE = re.compile(r"/s/([^{}/]+)/.*", re.DOTALL)


async def _expect(request: web.BaseRequest) -> None:
    """What the Application's router did for ``Expect:`` (clients such as curl send
    ``100-continue`` before a large body and wait for it)."""
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the answer's head is still to come


_PEER = "dataplane.peer"  # the connection_state key of a connection's _Peer


@dataclass
class _Peer:
    """What the data plane knows of one connection's client certificate."""

    serial: str
    problem: str  # "" when it carries the control plane's identity
    retired: bool = False  # refused as a retired instance's (and said so) already


def _peer(transport: asyncio.BaseTransport) -> _Peer:
    """The connection's client certificate: its serial, and whether it carries the control
    plane's identity (:data:`llmgw.pki.CONTROL_PLANE_OID`; the handshake verified it
    against the cluster CA). A common name proves nothing here: it is only a name."""
    ssl_object = transport.get_extra_info("ssl_object")
    if not isinstance(ssl_object, ssl.SSLObject | ssl.SSLSocket):
        return _Peer("", "the connection is not TLS")
    der = ssl_object.getpeercert(binary_form=True)
    if der is None:
        return _Peer("", control_plane_problem(None) or "")
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        return _Peer("", f"its certificate cannot be read ({exc})")
    return _Peer(serial_hex(cert), control_plane_problem(cert) or "")
