"""Leadership (DESIGN §8): one leader; the others are standbys that refuse agents' streams
and name it.

On SQLite, one leader per state directory (below). On PostgreSQL, one leader among the
instances sharing the database, by a lease in it (:class:`LeaseKeeper`, its SQL in
:mod:`llmgw.server.store.instances`).

Leadership is an exclusive lock on ``STATE/leader.lock``, held for the life of the leader's
process; a second control plane on the same state (a warm standby on the same machine or a
shared volume) waits for the lock. Meanwhile it answers every agent stream with ``Refuse``
naming the leader's stream address, and every HTTP request with 503 naming the leader's
gateway; when the leader's process ends it takes the lock, bumps the epoch (fencing the old
leader) and starts serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from aiohttp import web

from llmgw.errors import ConfigError, Fenced, StoreError, StoreUnavailable
from llmgw.listener import GuardedSite, ListenerLimits
from llmgw.log import kv
from llmgw.netaddr import parse_hostport
from llmgw.pki import Identity
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.server.config import TLSConfig
from llmgw.server.store import Store
from llmgw.server.stream import start_stream_server
from llmgw.server.tls import serving_certificate

__all__ = ["LeaseKeeper", "Standby", "await_leadership", "read_leader", "try_leadership"]

log = logging.getLogger("llmgw.server.leadership")

LEADER_STREAM = "leader_stream"
LEADER_HTTP = "leader_http"


def try_leadership(state_dir: Path) -> int | None:
    """The locked file descriptor when this process is the leader, else None. The lock is
    never opened through a symbolic link (``OSError`` ELOOP): root runs this too (``server
    migrate``), in a directory the control plane's user owns."""
    fd = os.open(state_dir / "leader.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


async def await_leadership(state_dir: Path, *, interval: float = 1.0) -> int:
    """Wait until this process holds the leader lock (the leader's process ended); the
    locked file descriptor."""
    while True:
        await asyncio.sleep(interval)
        fd = try_leadership(state_dir)
        if fd is not None:
            return fd


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
        leader: Callable[[], tuple[str, str]] | None = None,
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
        """The leader's stream and HTTP addresses (on SQLite: as it recorded them)."""
        if self._leader is not None:
            return self._leader()
        return read_leader(self.state_dir / "llmgw.db")

    async def start(self, *, serve_http: bool = True) -> None:
        """Refuse agents' streams; with *serve_http*, answer HTTP with 503 naming the leader
        (on PostgreSQL a standby serves the gateway itself, :mod:`llmgw.server.follower`)."""
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


class LeaseKeeper:
    """Leadership among instances sharing a PostgreSQL database: the lease in the store,
    taken by polling while a standby, renewed while the leader, and its epoch the fence of
    every write this process makes while it leads.

    The leader keeps leading while the database is away (nobody can take the lease then,
    and its writes fail anyway); it steps down when a renewal finds another holder or a
    write is fenced (:attr:`lost`).
    """

    def __init__(self, store: Store, holder: str, *, duration: float, renew: float) -> None:
        self.store = store
        self.holder = holder
        self.duration = duration
        self.renew = renew
        self.epoch = 0
        self.lost = asyncio.Event()
        self.reason = ""
        self._renewed = 0.0  # time.monotonic() of the last renewal that succeeded

    def try_take(self) -> bool:
        """Take the lease if it is free or lapsed; True when this process now leads.

        Right after the database was away, a lapsed lease is left to its holder for two
        renewals: it lapsed because nobody could write, not because the leader is gone, and a
        change of leader would only move every agent for nothing."""
        recovered = getattr(self.store.database, "recovered_at", None)
        if recovered is not None and time.monotonic() - recovered < 2 * self.renew + 1:
            return False
        try:
            lease = self.store.take_lease(self.holder, self.duration)
        except StoreUnavailable:
            return False
        if lease is None:
            return False
        self.epoch = lease.epoch
        self._renewed = time.monotonic()
        self.lost.clear()
        self.reason = ""
        return True

    async def take(self) -> int:
        """Wait until this process holds the lease; its epoch."""
        while True:
            if self.try_take():
                return self.epoch
            await asyncio.sleep(self.renew)

    def fence(self, _db: object) -> None:
        """The database's fence while leading: refuse a write once another epoch leads."""
        try:
            self.store.check_epoch(self.epoch)
        except Fenced as exc:
            self._lose(str(exc))
            raise

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()

    async def keep(self) -> str:
        """Renew the lease until it is lost; why it was."""
        while not self.lost.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lost.wait(), timeout=self.renew)
            if self.lost.is_set():
                break
            try:
                lease = self.store.renew_lease(self.holder, self.epoch, self.duration)
            except StoreUnavailable as exc:
                if time.monotonic() - self._renewed > self.duration:
                    log.warning(
                        "cannot renew the leader's lease: the database is away; leading on "
                        "without writes until it answers",
                        extra=kv(epoch=self.epoch, error=str(exc)),
                    )
                continue
            if lease is None:
                current = self._current()
                self._lose(f"the lease was taken by {current} since")
                break
            self._renewed = time.monotonic()
        return self.reason

    def _current(self) -> str:
        try:
            lease = self.store.lease()
        except StoreUnavailable:
            return "another instance"
        return f"{lease.holder} (epoch {lease.epoch})"

    def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes it at its next poll."""
        with contextlib.suppress(StoreUnavailable, Fenced):
            self.store.release_lease(self.holder, self.epoch)

    def leader_addresses(self) -> tuple[str, str]:
        """The current leader's stream and HTTP addresses ("" when none holds a live lease)."""
        try:
            lease = self.store.lease()
            if lease.expires_at <= self.store.database.server_time():
                return "", ""  # lapsed: whoever takes it next leads; naming it would mislead
            instance = self.store.get_instance(lease.holder) if lease.holder else None
        except StoreError:
            return "", ""
        if instance is None:
            return "", ""
        return instance.stream_addr, instance.http_addr
