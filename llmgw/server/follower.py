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
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from llmgw.errors import StoreError
from llmgw.log import kv
from llmgw.server.routing import Endpoint, Router
from llmgw.server.serving import ServingCache
from llmgw.server.states import NodeState, ReplicaState, ShardState
from llmgw.server.store import Store

__all__ = [
    "CHANNEL",
    "CLIENT_ADDR_HEADER",
    "CLIENT_MAC_HEADER",
    "LeaderProxy",
    "RouteFollower",
    "client_addr",
]

log = logging.getLogger("llmgw.server.follower")

CHANNEL = "llmgw_changes"

_ROUTES_SQL = (
    "SELECT s.id AS shard_id, s.replica_id, r.model, s.node_id, n.dataplane_addr "
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
"""HMAC-SHA256 of that address under the admin token, which every instance holds: a
client cannot claim another address by sending the header itself."""
# Without a total timeout (only between reads): the console's live event stream.
_STREAMS = frozenset({"/ui/events/stream"})
_STREAM_READ_TIMEOUT = 60.0


def _client_mac(secret: str, addr: str) -> str:
    return hmac.new(secret.encode(), b"client-addr:" + addr.encode(), hashlib.sha256).hexdigest()


def client_addr(request: web.Request, secret: str) -> str:
    """The client's address: the one a standby forwarded for, when its MAC under ``secret``
    (the admin token) holds, else the connection's own."""
    addr = request.headers.get(CLIENT_ADDR_HEADER)
    mac = request.headers.get(CLIENT_MAC_HEADER)
    if addr and mac and secret:
        if hmac.compare_digest(mac.encode(), _client_mac(secret, addr).encode()):
            return addr
    return request.remote or ""


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
    ) -> None:
        self.leader_http = leader_http
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
        leader = self.leader_http()
        if not leader:
            return _no_leader()
        if request.content_length is not None and request.content_length > self.max_body:
            return web.json_response(
                {"error": {"message": "request body too large", "type": "invalid_request_error"}},
                status=413,
            )
        body = await request.read() if request.can_read_body else None
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
            headers[CLIENT_ADDR_HEADER] = request.remote
            headers[CLIENT_MAC_HEADER] = _client_mac(secret, request.remote)
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
                leader + request.rel_url.path_qs,
                data=body,
                headers=headers,
                ssl=self.ssl(),
                allow_redirects=False,
                timeout=timeout,
            ) as upstream:
                if upstream.content_type == "text/event-stream":
                    return await _stream(request, upstream)
                payload = await upstream.read()
                out = web.Response(status=upstream.status, body=payload)
                for k, v in upstream.headers.items():
                    if k.lower() not in _HOP_HEADERS and k.lower() != "content-encoding":
                        out.headers.add(k, v)  # Set-Cookie may come twice
                if "Content-Encoding" in upstream.headers:
                    out.headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "cannot forward an admin request to the leader",
                extra=kv(leader=leader, error=str(exc) or type(exc).__name__),
            )
            return _no_leader(leader)

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


def _no_leader(leader: str = "") -> web.Response:
    where = f"the leader at {leader} does not answer" if leader else "no instance leads now"
    return web.json_response(
        {
            "error": {
                "message": f"this instance is a standby and {where} (a take-over takes "
                "seconds); retry, or point llmgw ctl at another instance",
                "type": "server_error",
                "code": "no_leader",
            }
        },
        status=503,
        headers={"Retry-After": "2"},
    )
