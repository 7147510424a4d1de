"""What a standby serves (DESIGN §8): every agent stream refused with ``Refuse`` naming the
leader's stream address; on SQLite every HTTP request answered 503 naming the leader's
gateway (on PostgreSQL a standby serves the gateway itself, :mod:`llmgw.server.ha.roles`).

On SQLite the leader records where it serves in the store's meta table, read here without
writing (:func:`read_leader`).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web

from llmgw.controlpeer import require_control_plane
from llmgw.errors import ConfigError
from llmgw.listener import GuardedSite, ListenerLimits
from llmgw.log import kv
from llmgw.netaddr import parse_hostport
from llmgw.pki import CA_CERT, Identity
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.server.common.config import TLSConfig
from llmgw.server.common.tls import serving_certificate
from llmgw.server.fleet.stream import start_stream_server

__all__ = ["LEADER_HTTP", "LEADER_STREAM", "Standby", "leader_ssl", "read_leader"]

log = logging.getLogger("llmgw.server.ha")

LEADER_STREAM = "leader_stream"
LEADER_HTTP = "leader_http"


def read_leader(db: Path) -> tuple[str, str]:
    """The leader's stream and HTTP addresses as it recorded them (read-only; never writes)."""
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
    except sqlite3.Error:
        return "", ""
    try:
        rows = dict(
            conn.execute(
                "SELECT key, value FROM meta WHERE key IN (?, ?)", (LEADER_STREAM, LEADER_HTTP)
            ).fetchall()
        )
    except sqlite3.Error:
        return "", ""
    finally:
        conn.close()
    return rows.get(LEADER_STREAM, ""), rows.get(LEADER_HTTP, "")


class _Refuser(pb_grpc.ControlPlaneServicer):
    def __init__(self, standby: Standby) -> None:
        self.standby = standby

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        leader, _ = self.standby.leader()
        message = (
            f"this control plane is a standby; the leader is {leader or 'not known yet'}"
            " (add every control plane to 'servers' in agent.yaml)"
        )
        await context.write(pb.ServerMessage(refuse=pb.Refuse(leader=leader, message=message)))


class Standby:
    """What a control plane serves while another holds the leadership."""

    def __init__(
        self,
        identity: Identity,
        *,
        state_dir: Path,
        grpc_listen: str,
        http_listen: str,
        tls: TLSConfig | None,
        listeners: ListenerLimits,
        leader: Callable[[], tuple[str, str]],
    ) -> None:
        self.identity = identity
        self._leader = leader
        self.state_dir = state_dir
        self.grpc_listen = grpc_listen
        self.http_listen = http_listen
        self.tls = tls
        self.listeners = listeners
        # The ports bound (a listen address with port 0 binds a free one).
        self.grpc_port = 0
        self.http_port = 0
        self._grpc: grpc.aio.Server | None = None
        self._runner: web.AppRunner | None = None

    def leader(self) -> tuple[str, str]:
        """The leader's stream and HTTP addresses (the leadership's say)."""
        return self._leader()

    async def start(self, *, serve_http: bool = True) -> None:
        """Refuse agents' streams; with *serve_http*, answer HTTP with 503 naming the leader
        (on PostgreSQL a standby serves the gateway itself, :mod:`llmgw.server.ha.follower`)."""
        self._grpc, self.grpc_port = await start_stream_server(
            self.identity,
            self.grpc_listen,
            _Refuser(self),
            handshake_timeout=self.listeners.handshake_timeout,
        )
        if not serve_http:
            log.warning(
                "another control plane leads; serving as a standby",
                extra=kv(leader=self.leader()[0] or "unknown"),
            )
            return
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._http)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host, port = parse_hostport(self.http_listen, allow_zero=True)
        tls = serving_certificate(self.tls, self.identity)
        site = GuardedSite(
            self._runner,
            host,
            port,
            label="http",
            limits=self.listeners,
            hint="listeners.header_timeout in server.yaml",
            ssl_context=tls.context if tls else None,
        )
        try:
            await site.start()
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {self.http_listen}: {exc.strerror}", key="http_listen"
            ) from exc
        self.http_port = site.bound_port
        leader, _ = self.leader()
        log.warning(
            "another control plane leads; serving as a standby",
            extra=kv(leader=leader or "unknown", state_dir=str(self.state_dir)),
        )

    async def _http(self, request: web.Request) -> web.Response:
        _, leader_http = self.leader()
        body = {
            "status": "standby",
            "leader": leader_http,
            "error": {
                "message": f"this control plane is a standby; use the leader at {leader_http or 'unknown'}",
                "type": "server_error",
                "code": "standby",
            },
        }
        return web.json_response(body, status=503, headers={"Retry-After": "5"})

    async def stop(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace=0.5)
            self._grpc = None
        if self._runner is not None:
            with contextlib.suppress(Exception):
                await self._runner.cleanup()
            self._runner = None


def leader_ssl(tls: TLSConfig | None, pki_dir: Path) -> ssl.SSLContext | bool:
    """TLS towards the leader's admin API (a standby's proxy): its certificate is the cluster
    CA's (tls: cluster) or the operator's, which the system's trust store verifies."""
    if tls is None:
        return False
    if tls.cluster:
        # A node's certificate from the same CA passes for the leader's host name: only the
        # control plane's identity lets the operator's token through.
        cafile = pki_dir / CA_CERT
        return require_control_plane(ssl.create_default_context(cafile=str(cafile)), cafile)
    return True
