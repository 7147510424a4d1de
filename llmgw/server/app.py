"""The control plane: state store, cluster CA, the agent stream, the scheduler and the gateway.

``ControlPlane.start()`` is the straight-line start-up of STYLE 10: open the store and bump
the leader epoch, make sure the CA and this server's certificates exist, mark every node
disconnected (streams do not survive a restart), bind the gRPC stream and the HTTP
listener, then run the reconcile loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import secrets
import ssl
import time
import uuid
from pathlib import Path

import grpc
from aiohttp import web
from cryptography import x509

from llmgw import __version__
from llmgw.bodies import BodyBudget, return_large_buffers
from llmgw.client import write_ctl_config
from llmgw.contracts.inventory import inventory_dict
from llmgw.errors import ConfigError, LlmgwError, NotFound
from llmgw.fsutil import write_private
from llmgw.listener import GuardedSite
from llmgw.log import kv
from llmgw.netaddr import RESERVED_NAMES, format_hostport, local_addresses, parse_hostport
from llmgw.pki import (
    CA_CERT,
    Authority,
    Identity,
    control_plane_names,
    ensure_server_identity,
    load_cert,
    serial_hex,
)
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.server.bundles import BundleStore, add_bundle_routes
from llmgw.server.catalog import profile_body_limit
from llmgw.server.config import ServerConfig
from llmgw.server.enroll import Enroller, EnrolmentServer
from llmgw.server.enroll import server_ssl_context as enroll_ssl_context
from llmgw.server.httpapi import error_middleware
from llmgw.server.intake import MAX_MESSAGE_BYTES, pending_inventory
from llmgw.server.metrics import Metrics
from llmgw.server.nodes import Membership
from llmgw.server.routing import Endpoint, Router
from llmgw.server.scheduler import Scheduler
from llmgw.server.standby import LEADER_HTTP, LEADER_STREAM, Standby, try_leadership
from llmgw.server.store import Node, Store
from llmgw.server.stream import ControlPlaneService, NodeSession
from llmgw.server.tls import ServingCertificate, serving_certificate
from llmgw.server.updates import Updates

__all__ = ["ControlPlane"]

log = logging.getLogger("llmgw.server")

_PB_STATE = {
    pb.SHARD_STARTING: "starting",
    pb.SHARD_READY: "ready",
    pb.SHARD_FAILED: "failed",
    pb.SHARD_EXITED: "exited",
}


def _read_or_create_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(
            f"cannot read the admin token: {exc.strerror}; it must be readable by the control "
            "plane's user",
            file=str(path),
        ) from exc
    token = "llmgw-admin-" + secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, (token + "\n").encode())
    return token


def _dns_names(cert: Path) -> list[str]:
    """The DNS names (no wildcards) a certificate file is for; none if it cannot be read."""
    try:
        san = load_cert(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (LlmgwError, x509.ExtensionNotFound):
        return []
    return [n for n in san.value.get_values_for_type(x509.DNSName) if "*" not in n]


def _inventory_summary(inv: pb.Inventory) -> str:
    gpus = f"{len(inv.gpus)} GPUs" if inv.gpus else f"no GPUs ({inv.gpu_status})"
    text = f"{gpus}; engines {', '.join(inv.engines) or 'none'}"
    if inv.warnings:
        text += "; " + "; ".join(inv.warnings)
    return text


class ControlPlane:
    """One control plane process (the leader, on SQLite)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.store: Store
        self.epoch = 0
        self.cluster_id = ""
        self.admin_token = ""
        self.sessions: dict[str, NodeSession] = {}
        self.router = Router()
        self.metrics = Metrics()
        self.scheduler = Scheduler(self)
        self.membership = Membership(self)
        self.updates = Updates(self)
        self.key_hashes: set[str] = set()
        # Engine installs ordered since start: op id -> {node, engine, version, state, error}.
        self.installs: dict[str, dict[str, object]] = {}
        self.lost: set[str] = set()
        self._loss_timers: dict[str, asyncio.TimerHandle] = {}
        self.model_names: set[str] = set()
        # Request body limits raised by a deployed profile (model -> bytes), the largest
        # limit of any model, and the body bytes the process holds at once.
        self.body_limits: dict[str, int] = {}
        self.largest_body_limit = cfg.max_request_body
        self.bodies = BodyBudget(cfg.max_inflight_body_bytes)
        self.http_port = 0
        self.grpc_port = 0
        self.ca: Authority | None = None
        self.server_identity: Identity | None = None
        self.client_identity: Identity | None = None
        # Every name in this control plane's certificates: no node may take one as its id.
        self.control_plane_names: frozenset[str] = frozenset(RESERVED_NAMES)
        self.started_at = time.time()
        self._grpc: grpc.aio.Server | None = None
        self._enrolment: EnrolmentServer | None = None
        self.enroll_port = 0
        self.bundles: BundleStore | None = None
        self._runner: web.AppRunner | None = None
        # The certificate :8080 serves when server.yaml has tls (None: plain HTTP).
        self.http_tls: ServingCertificate | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.role = "starting"
        self._lock_fd: int | None = None
        self._standby: Standby | None = None
        self._promotion: asyncio.Task[None] | None = None

    @property
    def pki_dir(self) -> Path:
        return self.cfg.state_dir / "pki"

    # -- start-up ------------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        try:
            cfg.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise ConfigError(
                f"cannot create the state directory: {exc.strerror}; create it for the control "
                "plane's user or set state_dir",
                key="state_dir",
                file=str(cfg.source) if cfg.source else None,
            ) from exc
        # 0. leadership: a second control plane on this state directory is a standby
        self._lock_fd = try_leadership(cfg.state_dir)
        if self._lock_fd is None:
            await self._start_standby()
            return
        await self._start_leader()

    async def _start_standby(self) -> None:
        self.role = "standby"
        hosts = [*local_addresses(), *self.cfg.advertise]
        _ca, identity, _client = ensure_server_identity(self.pki_dir, hosts=hosts)
        self._standby = Standby(self, identity)
        await self._standby.start()
        self._promotion = asyncio.create_task(self._await_leadership(), name="promotion")

    async def _await_leadership(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            fd = try_leadership(self.cfg.state_dir)
            if fd is None:
                continue
            self._lock_fd = fd
            log.warning(
                "the leader is gone; taking over", extra=kv(state_dir=str(self.cfg.state_dir))
            )
            assert self._standby is not None
            await self._standby.stop()
            self._standby = None
            await self._start_leader()
            return

    async def _start_leader(self) -> None:
        cfg = self.cfg
        self.role = "leader"
        # 1. state store, leader epoch
        self.store = Store.open(cfg.state_dir / "llmgw.db")
        self.epoch = self.store.bump_epoch()
        self.cluster_id = self.store.cluster_id()
        self.store.set_all_disconnected()
        self.refresh_keys()
        self.refresh_models()
        self.membership.load()
        self.lost = {n.id for n in self.store.list_nodes() if n.lost}
        # 2. CA and this server's identities
        hosts = [*local_addresses(), *cfg.advertise]
        self.ca, self.server_identity, self.client_identity = ensure_server_identity(
            self.pki_dir, hosts=hosts
        )
        self.control_plane_names = RESERVED_NAMES | control_plane_names(
            load_cert(self.server_identity.cert)
        )
        self._warn_of_nodes_named_like_the_control_plane()
        self.admin_token = _read_or_create_token(cfg.admin_token_file)
        self.updates.start()
        # 3. the Connect stream
        await self._start_grpc()
        # 4. enrolment
        await self._start_enrolment()
        # 5. gateway, admin API, metrics
        await self._start_http()
        self._write_ctl_config()
        # 6. reconcile
        self._tasks.append(asyncio.create_task(self.scheduler.run(), name="scheduler"))
        self._tasks.append(asyncio.create_task(self._watch_heartbeats(), name="heartbeats"))
        self.store.add_event("server_started", "control-plane", f"epoch {self.epoch}")
        # Nodes that do not come back within the loss timeout after this start are lost.
        for node in self.store.list_nodes():
            if self.store.list_shards(node_id=node.id):
                self._start_loss_timer(node.id)
        self.store.set_meta(LEADER_STREAM, self.stream_addresses()[0])
        self.store.set_meta(LEADER_HTTP, f"{self.cfg.http_scheme}://{self.http_addr}")
        log.info(
            "control plane started",
            extra=kv(
                version=__version__,
                epoch=self.epoch,
                cluster=self.cluster_id,
                http=self.http_addr,
                grpc=format_hostport(
                    parse_hostport(cfg.grpc_listen, allow_zero=True)[0], self.grpc_port
                ),
            ),
        )

    def _warn_of_nodes_named_like_the_control_plane(self) -> None:
        """Nodes that joined before such ids were refused keep their certificates, which no
        longer pass for the control plane's; the operator should still rename them."""
        for node in self.store.list_nodes():
            if node.id in self.control_plane_names and node.state != "revoked":
                log.warning(
                    "a node has the control plane's name as its id; it can no longer pose as "
                    "the control plane, but give it another id",
                    extra=kv(
                        node=node.id,
                        hint=f"llmgw ctl revoke {node.id}, then join the machine under another "
                        "node id",
                    ),
                )

    async def _start_grpc(self) -> None:
        assert self.server_identity is not None
        ident = self.server_identity
        creds = grpc.ssl_server_credentials(
            [(ident.key.read_bytes(), ident.cert.read_bytes())],
            root_certificates=ident.ca.read_bytes(),
            require_client_auth=True,
        )
        self._grpc = grpc.aio.server(
            options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # Larger messages end the stream with RESOURCE_EXHAUSTED (llmgw.server.intake).
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                # A connection that never completes its TLS handshake (and HTTP/2 preface)
                # is closed instead of held (grpc's own default is two minutes).
                (
                    "grpc.server_handshake_timeout_ms",
                    int(self.cfg.listeners.handshake_timeout * 1000),
                ),
            ]
        )
        pb_grpc.add_ControlPlaneServicer_to_server(ControlPlaneService(self), self._grpc)
        host, port = parse_hostport(self.cfg.grpc_listen, allow_zero=True)
        try:
            self.grpc_port = self._grpc.add_secure_port(format_hostport(host, port), creds)
        except RuntimeError as exc:
            raise ConfigError(
                f"cannot listen on {self.cfg.grpc_listen}: {exc}; free the port or change grpc_listen",
                key="grpc_listen",
            ) from exc
        await self._grpc.start()

    def stream_addresses(self) -> list[str]:
        """host:port of the Connect stream as a node should dial it."""
        host, _ = parse_hostport(self.cfg.grpc_listen, allow_zero=True)
        if host not in ("0.0.0.0", "::"):
            return [format_hostport(host, self.grpc_port)]
        hosts = list(self.cfg.advertise)
        if not hosts:
            routable = [a for a in local_addresses() if a not in ("localhost", "127.0.0.1", "::1")]
            hosts = routable[:1] or ["127.0.0.1"]
        return [format_hostport(h, self.grpc_port) for h in hosts]

    def _enrolled(self, node: Node) -> None:
        # A fresh join or a rekey denied the node's older certificates: drop the stream that
        # uses one, so the agent reconnects with its new identity.
        self.membership.load()
        session = self.sessions.get(node.id)
        if session is not None and session.serial in self.membership.revoked:
            session.close()
        # Pooled data-plane connections may still be to the old identity.
        gateway = getattr(self, "gateway", None)
        if gateway is not None:
            gateway.forget_node(node.id)

    async def _start_enrolment(self) -> None:
        assert self.ca is not None and self.server_identity is not None
        enroller = Enroller(
            self.store,
            self.ca,
            lifetime=self.cfg.cert_lifetime,
            servers=self.stream_addresses,
            on_enrolled=self._enrolled,
            control_plane_names=lambda: self.control_plane_names,
        )
        self._enrolment = EnrolmentServer(enroller)
        host, port = parse_hostport(self.cfg.enroll_listen, allow_zero=True)
        try:
            self.enroll_port = await self._enrolment.start(
                host,
                port,
                enroll_ssl_context(self.server_identity),
                limits=dataclasses.replace(
                    self.cfg.listeners, per_source=self.cfg.enroll_connections_per_source
                ),
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {self.cfg.enroll_listen}: {exc.strerror}; free the port or "
                "change enroll_listen",
                key="enroll_listen",
            ) from exc

    async def _start_http(self) -> None:
        from llmgw.server.admin import add_admin_routes
        from llmgw.server.gateway import Gateway

        assert self.server_identity is not None
        self.http_tls = serving_certificate(self.cfg.tls, self.server_identity)
        self.gateway = Gateway(self)
        return_large_buffers()  # large bodies' memory goes back to the system once freed
        # Bodies are read through llmgw.bodies; this only bounds any other reader.
        app = web.Application(client_max_size=1024 * 1024, middlewares=[error_middleware])
        self.gateway.add_routes(app)
        add_admin_routes(app, self)
        self.bundles = add_bundle_routes(app, self.cfg.bundle_dir)
        app.on_cleanup.append(lambda _app: self.gateway.close())
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await self._runner.setup()
        host, port = parse_hostport(self.cfg.http_listen, allow_zero=True)
        site = GuardedSite(
            self._runner,
            host,
            port,
            label="http",
            limits=self.cfg.listeners,
            backlog=2048,
            hint="listeners.header_timeout in server.yaml",
            ssl_context=self.http_tls.context if self.http_tls else None,
        )
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(
                f"cannot listen on {self.cfg.http_listen}: {exc.strerror}; free the port or change http_listen",
                key="http_listen",
            ) from exc
        self.http_port = site.bound_port

    def _write_ctl_config(self) -> None:
        """``STATE/ctl.yaml``: how ``llmgw ctl`` on this machine reaches this control plane
        (``LLMGW_STATE_DIR=STATE llmgw ctl ...``; /var/lib/llmgw's is found without it)."""
        tls = self.cfg.tls
        ca = None
        host = self.http_addr
        if tls is not None and tls.cluster:
            ca = self.pki_dir / CA_CERT  # the certificate covers this machine's addresses
        elif tls is not None and self.http_tls is not None:
            # The operator's certificate names the server as the world knows it.
            names = _dns_names(self.http_tls.cert)
            if names:
                host = format_hostport(names[0], self.http_port)
        try:
            write_ctl_config(
                self.cfg.state_dir / "ctl.yaml",
                f"{self.cfg.http_scheme}://{host}",
                self.cfg.admin_token_file,
                ca=ca,
            )
        except OSError as exc:
            log.warning(
                "cannot write ctl.yaml; llmgw ctl needs --server and --token",
                extra=kv(state_dir=str(self.cfg.state_dir), error=exc.strerror or str(exc)),
            )

    @property
    def http_addr(self) -> str:
        host = parse_hostport(self.cfg.http_listen, allow_zero=True)[0]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return format_hostport(host, self.http_port)

    async def stop(self) -> None:
        for timer in self._loss_timers.values():
            timer.cancel()
        self._loss_timers.clear()
        if self._promotion is not None:
            self._promotion.cancel()
            await asyncio.gather(self._promotion, return_exceptions=True)
        if self._standby is not None:
            await self._standby.stop()
        if self.role != "leader":
            self._release()
            return
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in list(self.sessions.values()):
            session.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=2.0)
        if self._runner is not None:
            await self._runner.cleanup()
        if self._enrolment is not None:
            await self._enrolment.stop()
        self.store.close()
        self._release()

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- caches the request path reads ---------------------------------------------------------

    def refresh_keys(self) -> None:
        self.key_hashes = self.store.active_key_hashes()

    def refresh_models(self) -> None:
        models = self.store.list_models()
        self.model_names = {m.name for m in models}
        limits: dict[str, int] = {}
        for m in models:
            limit = profile_body_limit(m.profiles.get(m.profile))
            if limit is not None:
                limits[m.name] = limit
        self.body_limits = limits
        self.largest_body_limit = max([self.cfg.max_request_body, *limits.values()])

    # -- sessions ------------------------------------------------------------------------------

    def certificate_refusal(self, node_id: str, cert: x509.Certificate | None) -> str | None:
        """Why a stream with this certificate must be refused, or None."""
        return self.membership.refusal(node_id, cert)

    def node_state(self, node_id: str) -> str:
        try:
            return self.store.get_node(node_id).state
        except NotFound:
            return "pending"

    def open_session(self, hello: pb.Hello, peer: str, cert: x509.Certificate) -> NodeSession:
        node_id = hello.node_id
        self.membership.admit(node_id, cert)
        # Until an operator approves it, a node's inventory is kept in memory and only a
        # bounded summary of it stored: enough to judge the node by.
        approved = self.node_state(node_id) == "approved"
        inventory = inventory_dict(
            hello.inventory if approved else pending_inventory(hello.inventory)
        )
        self.store.upsert_node(
            node_id,
            dataplane_addr=hello.dataplane_addr,
            agent_version=hello.agent_version,
            inventory=inventory,
            connected=True,
        )
        timer = self._loss_timers.pop(node_id, None)
        if timer is not None:
            timer.cancel()
        if node_id in self.lost:
            self.lost.discard(node_id)
            self.store.set_node_lost(node_id, False)
            self.store.add_event("node_back", node_id, "reconnected after being lost")
        old = self.sessions.get(node_id)
        if old is not None:
            # A node that reconnects before its old stream noticed the break: the new one wins.
            old.close()
        session = NodeSession(
            node_id=node_id,
            dataplane_addr=hello.dataplane_addr,
            epoch=self.epoch,
            engines=frozenset(hello.inventory.engines),
            serial=serial_hex(cert),
            approved=approved,
            held_inventory=None if approved else hello.inventory,
        )
        self.sessions[node_id] = session
        self.store.add_event(
            "node_connected", node_id, f"from {peer}, data plane {hello.dataplane_addr}"
        )
        log.info(
            "node connected",
            extra=kv(
                node=node_id, peer=peer, dataplane=hello.dataplane_addr, version=hello.agent_version
            ),
        )
        self._count_nodes()
        return session

    def after_hello(self, session: NodeSession, hello: pb.Hello) -> None:
        """Reconcile what the node says it runs with what the store says it should."""
        known = {s.id: s for s in self.store.list_shards(node_id=session.node_id)}
        reported = {s.shard_id: s for s in hello.shards}
        for shard_id, status in reported.items():
            if shard_id in known:
                self._apply_status(session, status)
            elif status.state in (pb.SHARD_STARTING, pb.SHARD_READY, pb.SHARD_FAILED):
                log.info(
                    "stopping a shard no replica owns",
                    extra=kv(node=session.node_id, shard=shard_id),
                )
                session.stop_shard(shard_id)
        for shard_id, shard in known.items():
            if shard_id not in reported and shard.state in ("starting", "ready", "pending"):
                # The node no longer runs it (an agent restart): start it again.
                self.store.update_shard(
                    shard_id, state="pending", reason="not running on the node after reconnect"
                )
        self.scheduler.kick()

    def close_session(self, session: NodeSession) -> None:
        if self.sessions.get(session.node_id) is not session:
            return
        del self.sessions[session.node_id]
        self.router.remove_node(session.node_id)
        try:
            self.store.set_node_connected(session.node_id, False)
            self.store.add_event("node_disconnected", session.node_id, "stream closed")
        except LlmgwError as exc:
            log.warning(
                "cannot record a disconnect", extra=kv(node=session.node_id, error=str(exc))
            )
        log.info("node disconnected", extra=kv(node=session.node_id))
        # Silent for the loss timeout already: lost now. A closed stream gets the timeout.
        self._start_loss_timer(session.node_id, 0.0 if session.silent else None)
        self._count_nodes()
        self._count_ready()

    # -- loss: a node away for the loss timeout loses its replicas to other nodes ------------------

    def _start_loss_timer(self, node_id: str, delay: float | None = None) -> None:
        old = self._loss_timers.pop(node_id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        wait = self.cfg.loss_timeout if delay is None else delay
        self._loss_timers[node_id] = loop.call_later(wait, self._node_lost, node_id)

    def _node_lost(self, node_id: str) -> None:
        self._loss_timers.pop(node_id, None)
        if node_id in self.sessions or node_id in self.lost:
            return
        try:
            shards = self.store.list_shards(node_id=node_id)
        except LlmgwError:
            return
        self.lost.add(node_id)
        self.store.set_node_lost(node_id, True)
        replicas = sorted({s.replica_id for s in shards})
        log.warning(
            "node lost; rebuilding its replicas elsewhere",
            extra=kv(node=node_id, replicas=len(replicas), after=f"{self.cfg.loss_timeout:g}s"),
        )
        self.store.add_event(
            "node_lost",
            node_id,
            f"no stream for {self.cfg.loss_timeout:g}s; {len(replicas)} replicas rebuilt elsewhere",
        )
        for replica_id in replicas:
            # No stop order can reach it; when it comes back, its Hello lists shards that
            # belong to no replica and it is told to stop them.
            self.remove_replica(replica_id, why=f"node {node_id} lost")
        self.scheduler.kick()

    def _count_nodes(self) -> None:
        nodes = self.store.list_nodes()
        connected = sum(1 for n in nodes if n.id in self.sessions)
        self.metrics.nodes.set(("connected",), connected)
        self.metrics.nodes.set(("disconnected",), len(nodes) - connected)

    def _count_ready(self) -> None:
        for model in self.model_names:
            self.metrics.ready_replicas.set((model,), len(self.router.endpoints(model)))

    async def _watch_heartbeats(self) -> None:
        """Cut streams whose heartbeats stopped (gRPC keepalive catches most, not a hung agent)."""
        while True:
            await asyncio.sleep(self.cfg.heartbeat_interval)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_heartbeat > self.cfg.loss_timeout:
                    log.warning("node stopped sending heartbeats", extra=kv(node=session.node_id))
                    session.silent = True
                    session.close()

    # -- messages from agents ------------------------------------------------------------------

    def on_agent_message(self, session: NodeSession, msg: pb.AgentMessage) -> None:
        kind = msg.WhichOneof("msg")
        session.last_heartbeat = time.monotonic()
        if kind == "heartbeat":
            session.inflight = msg.heartbeat.inflight
            self.store.touch_node(session.node_id)
        elif kind == "shard_status":
            self._apply_status(session, msg.shard_status)
        elif kind == "op_result":
            self._apply_result(session, msg.op_result)
        elif kind == "draining":
            session.draining = True
            self.router.remove_node(session.node_id)
            if session.approved:
                self.store.add_event(
                    "node_draining", session.node_id, "agent stopping; no new requests sent to it"
                )
            log.info("agent is stopping; routing around it", extra=kv(node=session.node_id))
            self._count_ready()
        elif kind == "cert_request":
            self.membership.renew(session, msg.cert_request.csr_pem)
        elif kind == "inventory":
            if session.approved:
                self.store_inventory(session, msg.inventory)
            else:
                # No churn stored before approval: the latest is stored on approval.
                session.held_inventory = msg.inventory
        else:
            log.warning("unexpected message on a stream", extra=kv(node=session.node_id, kind=kind))

    def store_inventory(self, session: NodeSession, inv: pb.Inventory) -> None:
        """Record an approved node's inventory and let the scheduler look at it."""
        session.engines = frozenset(inv.engines)
        node = self.store.get_node(session.node_id)
        self.store.upsert_node(
            session.node_id,
            dataplane_addr=session.dataplane_addr,
            agent_version=node.agent_version,
            inventory=inventory_dict(inv),
            connected=True,
        )
        self.store.add_event("inventory_changed", session.node_id, _inventory_summary(inv))
        self.scheduler.kick()

    def _apply_status(self, session: NodeSession, status: pb.ShardStatus) -> None:
        state = _PB_STATE.get(status.state)
        if state is None:
            return
        try:
            shard = self.store.get_shard(status.shard_id)
        except NotFound:
            return  # a shard we already forgot (stopped or undeployed)
        if shard.node_id != session.node_id:
            return
        if state == "exited":
            # We delete shards we stop, so an exit we did not order is a failure.
            state = "failed"
        exit_code = status.exit_code if status.has_exit_code else None
        self.store.update_shard(
            shard.id,
            state=state,
            port=status.port or None,
            pid=status.pid or None,
            exit_code=exit_code,
            reason=status.reason,
        )
        self.store.set_replica_state(shard.replica_id, state if state != "exited" else "failed")
        # Only rank 0 serves; workers of a multi-node replica are ready but not routable.
        if state == "ready" and not session.draining and shard.rank == 0:
            replica = self.store.get_replica(shard.replica_id)
            self.router.set_ready(
                Endpoint(
                    model=replica.model,
                    replica_id=replica.id,
                    shard_id=shard.id,
                    node_id=session.node_id,
                    addr=session.dataplane_addr,
                )
            )
            self.scheduler.shard_ready(shard.id)
            self.store.add_event(
                "shard_ready", shard.id, f"on {session.node_id} port {status.port}"
            )
        else:
            self.router.remove_shard(shard.id)
            if state == "failed":
                self.scheduler.shard_failed(shard.id)
                self.store.add_event("shard_failed", shard.id, status.reason or "failed")
        self._count_ready()

    def _apply_result(self, session: NodeSession, result: pb.OperationResult) -> None:
        install = self.installs.get(result.op_id)
        if install is not None:
            install.update(
                state="installed" if result.ok else "failed",
                error=result.error,
                finished_at=time.time(),
            )
            what = f"{install['engine']} {install['version']}"
            if result.ok:
                self.store.add_event("engine_installed", session.node_id, what)
            else:
                self.store.add_event(
                    "engine_install_failed", session.node_id, f"{what}: {result.error}"
                )
            return
        if result.ok:
            return
        log.warning(
            "an order failed on a node",
            extra=kv(node=session.node_id, op=result.op_id, error=result.error),
        )
        for shard in self.store.list_shards(node_id=session.node_id):
            if shard.op_id == result.op_id and shard.state in ("starting", "pending"):
                self.store.update_shard(shard.id, state="failed", reason=result.error)
                self.store.set_replica_state(shard.replica_id, "failed")
                self.scheduler.shard_failed(shard.id)
                self.store.add_event("shard_failed", shard.id, result.error)

    # -- changes ordered through the admin API ----------------------------------------------------

    def install_engine(
        self, node_ids: list[str], *, engine: str, version: str, url: str, sha256: str, arch: str
    ) -> list[dict[str, object]]:
        """Order an engine install on connected, approved nodes; results arrive as op results."""
        out: list[dict[str, object]] = []
        for node_id in node_ids:
            node = self.store.get_node(node_id)
            session = self.sessions.get(node_id)
            if node.state != "approved" or session is None:
                why = "not connected" if session is None else node.state
                out.append({"node": node_id, "state": "skipped", "error": why, "op_id": None})
                continue
            meta = pb.OrderMeta(epoch=self.epoch, op_id=uuid.uuid4().hex)
            session.send(
                pb.ServerMessage(
                    install_engine=pb.InstallEngine(
                        meta=meta, engine=engine, version=version, url=url, sha256=sha256, arch=arch
                    )
                )
            )
            record: dict[str, object] = {
                "op_id": meta.op_id,
                "node": node_id,
                "engine": engine,
                "version": version,
                "state": "installing",
                "error": "",
                "started_at": time.time(),
                "finished_at": None,
            }
            self.installs[meta.op_id] = record
            self.store.add_event("engine_install", node_id, f"{engine} {version} from {url}")
            out.append(record)
        return out

    def remove_replica(self, replica_id: str, *, why: str) -> None:
        for shard in self.store.list_shards(replica_id=replica_id):
            self.router.remove_shard(shard.id)
            session = self.sessions.get(shard.node_id)
            if session is not None:
                session.stop_shard(shard.id)
            self.scheduler.forget(shard.id)
        self.store.delete_replica(replica_id)
        self.store.add_event("replica_removed", replica_id, why)
        self._count_ready()

    def client_ssl_context(self) -> ssl.SSLContext:
        """TLS the gateway presents to agents' data planes."""
        assert self.client_identity is not None
        ident = self.client_identity
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ident.ca))
        ctx.load_cert_chain(ident.cert, ident.key)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx
