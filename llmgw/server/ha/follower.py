"""What a standby instance routes by, followed from the shared database: the ready replicas
(its gateway's routing table), the active API keys and deployed models (its serving cache),
and the denied certificate serials; and the admin API, forwarded to the leader.

The leader learns of replicas from its agents' reports; a standby has no agents, so it reads
them from the database, where the leader writes every shard's state: at start, when
PostgreSQL notifies a change to the tables that matter (``LISTEN llmgw_changes``, raised by
triggers of :mod:`llmgw.server.store.postgres`), and every ``resync_interval`` in case a
notification was lost (a dropped LISTEN connection). While the database is away it keeps
what it last read: the data planes serve without the control plane.

Admin requests (``/api/...``) go to the leader, which alone orders agents; the operator's
token and password pass through unchanged, so ``llmgw ctl`` works against any instance. So
does the web console (``/ui/...``): its cookie, CSRF token and Host pass through.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from yarl import URL

from llmgw.controlpeer import NotControlPlane
from llmgw.errors import StoreError
from llmgw.log import kv
from llmgw.server.fleet.meeting import transfer_addr
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServingCache
from llmgw.server.store import Store
from llmgw.server.store.states import NodeState, ReplicaState, ShardState

__all__ = [
    "CHANNEL",
    "CLIENT_ADDR_HEADER",
    "CLIENT_MAC_HEADER",
    "MAC_WINDOW",
    "LeaderProxy",
    "RouteFollower",
    "client_addr",
    "sign_client_addr",
]

log = logging.getLogger("llmgw.server.follower")

CHANNEL = "llmgw_changes"

_ROUTES_SQL = (
    "SELECT s.id AS shard_id, s.replica_id, r.model, s.node_id, n.dataplane_addr, "
    "s.dist_init_addr "
    "FROM shards s JOIN replicas r ON r.id = s.replica_id JOIN nodes n ON n.id = s.node_id "
    "WHERE s.rank = 0 AND s.state = ? AND r.state = ? AND n.state = ? AND n.lost = 0 "
    "AND n.draining = 0 AND n.dataplane_addr IS NOT NULL AND n.dataplane_addr <> '' "
    "ORDER BY s.id"
)


class RouteFollower:
    """Keeps a router, a serving cache and the denied serials equal to the database's."""

    def __init__(
        self,
        store: Store,
        router: Router,
        serving: ServingCache,
        *,
        resync_interval: float,
        on_routes_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        self.router = router
        self.serving = serving
        self.resync_interval = resync_interval
        self.on_routes_changed = on_routes_changed
        self.revoked: frozenset[str] = frozenset()
        self.synced_at = 0.0  # loop time of the last sync that read everything
        self.syncs = 0
        self._changed = asyncio.Event()

    def sync(self) -> bool:
        """Read it all again; False (and nothing changed) when the database is away."""
        try:
            rows = self.store.database.all(
                _ROUTES_SQL, (ShardState.READY, ReplicaState.READY, NodeState.APPROVED)
            )
            revoked = frozenset(self.store.revoked_serials())
            self.serving.refresh_keys()
            self.serving.refresh_models()
        except StoreError as exc:
            log.debug("cannot follow the database now", extra=kv(error=str(exc)))
            return False
        wanted = {
            str(r["shard_id"]): Endpoint(
                model=str(r["model"]),
                replica_id=str(r["replica_id"]),
                shard_id=str(r["shard_id"]),
                node_id=str(r["node_id"]),
                addr=str(r["dataplane_addr"]),
                transfer_addr=transfer_addr(str(r["model"]), str(r["dist_init_addr"] or "")),
            )
            for r in rows
        }
        changed = False
        for ep in self.router.endpoints():
            if ep.shard_id not in wanted:
                self.router.remove_shard(ep.shard_id)
                changed = True
        current = {ep.shard_id: ep for ep in self.router.endpoints()}
        for shard_id, ep in wanted.items():
            have = current.get(shard_id)
            if have is None or (have.addr, have.node_id, have.model) != (
                ep.addr,
                ep.node_id,
                ep.model,
            ):
                self.router.set_ready(ep)  # keeps nothing of a replaced endpoint
                changed = True
        self.revoked = revoked
        self.synced_at = asyncio.get_running_loop().time()
        self.syncs += 1
        if changed:
            self.on_routes_changed()
        return True

    def notified(self) -> None:
        """A change was announced: sync soon (changes close together make one sync)."""
        self._changed.set()

    async def run(self) -> None:
        """Sync on each notification and every resync_interval, forever."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.resync_interval)
            if self._changed.is_set():
                await asyncio.sleep(0.05)  # let a burst of changes land first
                self._changed.clear()
            self.sync()

    async def listen(self) -> None:
        """Turn PostgreSQL's notifications into :meth:`notified`, reconnecting when the
        connection drops (the periodic resync covers the gap)."""
        from llmgw.server.store.postgres import listen_async

        while True:
            try:
                async for _payload in listen_async(self.store.database, CHANNEL):
                    self.notified()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("notifications stopped; listening again", extra=kv(error=str(exc)))
            self.notified()  # something may have changed while we were not listening
            await asyncio.sleep(min(self.resync_interval, 2.0))


_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


CLIENT_ADDR_HEADER = "X-Llmgw-Client-Addr"
"""The address of the client a standby forwards for (the console's login limits count it)."""
CLIENT_MAC_HEADER = "X-Llmgw-Client-Mac"
"""``TIME:NONCE:MAC``: when the standby signed (Unix seconds), a random nonce, and the
HMAC-SHA256 under the admin token, which every instance holds, of the address, the time, the
nonce, the method and the raw path: a client cannot claim another address by sending the
headers itself, and headers seen once (on a network without TLS) cannot be replayed, later
or on another request."""
MAC_WINDOW = 30.0
"""Seconds a signed address is believed after (and before) it was signed. A forward takes
milliseconds, but the instances' clocks are their own (NTP keeps them within a second or
two; a VM resumed from a pause may lag more): 30 s tolerates that skew, and a nonce seen
within it is refused a second time, so a replay gains nothing in the window either."""
# Without a total timeout (only between reads): the console's live event stream.
_STREAMS = frozenset({"/ui/events/stream"})
_STREAM_READ_TIMEOUT = 60.0
# The leader's own endless streams that a standby does not forward: each would hold a
# connection of the proxy to the leader until its timeout (the KV events relay, which a
# standby dials itself: llmgw.server.ha.kvrelay.RELAY_PATH).
_NOT_FORWARDED = frozenset({"/api/ha/kv-events"})


def _client_mac(secret: str, addr: str, stamp: str, nonce: str, method: str, raw_path: str) -> str:
    signed = "\n".join(("client-addr/2", addr, stamp, nonce, method, raw_path))
    return hmac.new(secret.encode(), signed.encode(), hashlib.sha256).hexdigest()


def sign_client_addr(
    secret: str, addr: str, method: str, raw_path: str, *, now: float | None = None
) -> dict[str, str]:
    """The headers a standby adds for the leader: ``addr`` signed for this one request."""
    stamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(12)
    mac = _client_mac(secret, addr, stamp, nonce, method, raw_path)
    return {CLIENT_ADDR_HEADER: addr, CLIENT_MAC_HEADER: f"{stamp}:{nonce}:{mac}"}


class _Nonces:
    """The nonces of signed addresses believed within the last :data:`MAC_WINDOW`, so that
    each is believed once (bounded: only a holder of the admin token can make one)."""

    def __init__(self, limit: int = 100_000) -> None:
        self._seen: dict[str, float] = {}
        self._limit = limit

    def first_use(self, nonce: str, now: float) -> bool:
        # Oldest first, up to the first one still in its window (a stamp may be up to a
        # window ahead of this clock, so a nonce stays refusable for two).
        while self._seen:
            old, at = next(iter(self._seen.items()))
            if now - at <= 2 * MAC_WINDOW and len(self._seen) < self._limit:
                break
            del self._seen[old]
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        return True


_NONCES = _Nonces()


def client_addr(request: web.Request, secret: str) -> str:
    """The client's address: the one a standby forwarded for, when its MAC under ``secret``
    (the admin token) holds for this request's method and raw path, was made within
    :data:`MAC_WINDOW` and its nonce is new; else the connection's own."""
    addr = request.headers.get(CLIENT_ADDR_HEADER)
    signed = request.headers.get(CLIENT_MAC_HEADER, "")
    stamp, _, rest = signed.partition(":")
    nonce, _, mac = rest.partition(":")
    if not (addr and mac and secret and stamp.isdigit() and len(stamp) <= 12):
        return request.remote or ""
    now = time.time()
    want = _client_mac(secret, addr, stamp, nonce, request.method, request.raw_path)
    if (
        hmac.compare_digest(mac.encode(), want.encode())
        and abs(now - int(stamp)) <= MAC_WINDOW
        and _NONCES.first_use(nonce, now)
    ):
        return addr
    return request.remote or ""


def _forwardable(raw_path: str) -> str | None:
    """``raw_path`` (the request target as the client sent it) when it is under /api or /ui
    as sent, with no encoded slash or backslash and no dot-segment, plain or encoded; else
    None. The leader gets these very bytes: what was checked is what is forwarded, and no
    decoding or normalising on either side can make it another path."""
    path = raw_path.partition("?")[0].partition("#")[0]
    if not (path in ("/api", "/ui") or path.startswith(("/api/", "/ui/"))):
        return None
    lowered = path.lower()
    if "%2f" in lowered or "%5c" in lowered or "\\" in path:
        return None
    if any(unquote(segment) in (".", "..") for segment in path.split("/")):
        return None
    return raw_path


class LeaderProxy:
    """``/api/...`` and the console's ``/ui/...`` on a standby: the same request to the
    leader, its answer back (a server-sent event stream as it comes).

    The console is the leader's (its pages read the live sessions, the scheduler, the
    membership, which a standby has not), so a standby forwards it whole: the request's
    ``Host`` goes along (the console checks a POST's Origin against it), and the client's
    address with its MAC under ``secret`` (the admin token), so that login limits count the
    browser, not the standby."""

    def __init__(
        self,
        leader_http: Callable[[], str],
        *,
        ssl: Callable[[], Any] = lambda: None,
        timeout: float = 120.0,
        max_body: int = 64 * 1024 * 1024,
        secret: Callable[[], str] = lambda: "",
        database_away: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.leader_http = leader_http
        # Since when (time.time()) the database does not answer, None while it does: a
        # refusal then says so rather than that no instance leads (the leader leads on).
        self.database_away = database_away
        self.ssl = ssl
        self.timeout = timeout
        self.max_body = max_body
        self.secret = secret
        self._session: aiohttp.ClientSession | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/api/{tail:.*}", self.forward)
        app.router.add_route("*", "/api", self.forward)
        app.router.add_route("*", "/ui/{tail:.*}", self.forward)
        app.router.add_route("*", "/ui", self.forward)

    async def forward(self, request: web.Request) -> web.StreamResponse:
        target = _forwardable(request.raw_path)
        if target is None:
            return _bad_path()
        leader = self.leader_http()
        if unquote(target.partition("?")[0]).rstrip("/") in _NOT_FORWARDED:
            return _not_forwarded(target.partition("?")[0], leader)
        if not leader:
            return _no_leader(away=self.database_away())
        if request.content_length is not None and request.content_length > self.max_body:
            return web.json_response(
                {"error": {"message": "request body too large", "type": "invalid_request_error"}},
                status=413,
            )
        body = await request.read() if request.can_read_body else None
        headers = self._headers(request, target)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout), auto_decompress=False
            )
        timeout = (
            aiohttp.ClientTimeout(total=None, sock_read=_STREAM_READ_TIMEOUT)
            if request.path in _STREAMS
            else aiohttp.ClientTimeout(total=self.timeout)
        )
        try:
            async with self._session.request(
                request.method,
                URL(leader.rstrip("/") + target, encoded=True),
                data=body,
                headers=headers,
                ssl=self.ssl(),
                allow_redirects=False,
                timeout=timeout,
            ) as upstream:
                if upstream.content_type == "text/event-stream":
                    return await _stream(request, upstream)
                return await _whole(upstream)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if isinstance(exc, aiohttp.ClientConnectorCertificateError) and isinstance(
                exc.certificate_error, NotControlPlane
            ):
                log.warning(
                    "refused to forward an admin request: the leader's address answers with a "
                    "certificate of the cluster CA that is not the control plane's (a node's?); "
                    "nothing was sent",
                    extra=kv(leader=leader, reason=str(exc.certificate_error)),
                )
                return _no_leader(leader, away=self.database_away())
            log.warning(
                "cannot forward an admin request to the leader",
                extra=kv(leader=leader, error=str(exc) or type(exc).__name__),
            )
            return _no_leader(leader, away=self.database_away())

    def _headers(self, request: web.Request, target: str) -> dict[str, str]:
        """The request's headers for the leader: no hop-by-hop ones nor a client's own
        claim of its address; the address signed instead, and the console's Host kept."""
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _HOP_HEADERS
            and k.lower() not in (CLIENT_ADDR_HEADER.lower(), CLIENT_MAC_HEADER.lower())
        }
        headers["X-Forwarded-For"] = request.remote or ""
        console = request.path == "/ui" or request.path.startswith("/ui/")
        if console and request.host:
            headers["Host"] = request.host
        # Sign-ins are counted per client address: the console's and 'ctl login's.
        secret = self.secret()
        if secret and request.remote:
            headers.update(sign_client_addr(secret, request.remote, request.method, target))
        return headers

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _stream(request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
    """The leader's event stream relayed as it comes, until either side ends it."""
    out = web.StreamResponse(status=upstream.status)
    for k, v in upstream.headers.items():
        if k.lower() not in _HOP_HEADERS:
            out.headers.add(k, v)
    await out.prepare(request)
    with contextlib.suppress(ConnectionError, aiohttp.ClientError, TimeoutError):
        async for chunk in upstream.content.iter_any():
            await out.write(chunk)
    return out


def _no_leader(leader: str = "", *, away: float | None = None) -> web.Response:
    if away is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(away))
        where = (
            f"the database is unreachable since {since}, so it cannot tell which instance "
            "leads (the leader leads on meanwhile)"
            if not leader
            else f"the leader at {leader} does not answer, and the database is unreachable "
            f"since {since}"
        )
        message = (
            f"this instance is a standby and {where}; point llmgw ctl at the leader, or "
            "retry once PostgreSQL answers"
        )
    else:
        where = f"the leader at {leader} does not answer" if leader else "no instance leads now"
        message = (
            f"this instance is a standby and {where} (a take-over takes seconds); retry, or "
            "point llmgw ctl at another instance"
        )
    return web.json_response(
        {
            "error": {
                "message": message,
                "type": "server_error",
                "code": "no_leader" if away is None else "database_unreachable",
            }
        },
        status=503,
        headers={"Retry-After": "2"},
    )


def _not_forwarded(path: str, leader: str) -> web.Response:
    where = f"the leader ({leader})" if leader else "the leader (none leads now)"
    return web.json_response(
        {
            "error": {
                "message": f"{path} is not forwarded by a standby: it is the leader's stream "
                "of KV events to the other instances, which would hold this standby's proxy "
                f"for minutes; call GET /api/ha/kv-events on {where} itself, with the admin "
                "token (GET /healthz names the leader)",
                "type": "invalid_request_error",
                "code": "not_forwarded",
            }
        },
        status=421,
    )


def _bad_path() -> web.Response:
    return web.json_response(
        {
            "error": {
                "message": "this path is not forwarded to the leader: a standby "
                "forwards /api/... and /ui/... as sent, without encoded slashes "
                "(%2F, %5C) or '.'/'..' segments; send the plain path",
                "type": "invalid_request_error",
                "code": "bad_path",
            }
        },
        status=400,
    )


async def _whole(upstream: aiohttp.ClientResponse) -> web.Response:
    """The leader's answer, read whole, with its end-to-end headers (its encoding kept:
    the body is passed on as it came)."""
    payload = await upstream.read()
    out = web.Response(status=upstream.status, body=payload)
    for k, v in upstream.headers.items():
        if k.lower() not in _HOP_HEADERS and k.lower() != "content-encoding":
            out.headers.add(k, v)  # Set-Cookie may come twice
    if "Content-Encoding" in upstream.headers:
        out.headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
    return out
