"""The control plane process: wiring and start/stop only.

``ControlPlane.start()`` is the straight-line start-up of STYLE 10: take the leadership (or
serve as a standby, llmgw.server.leadership), open the store and bump the leader epoch,
mark every node disconnected (streams do not survive a restart), make sure the CA and this
server's certificates exist, build the parts (each given the few collaborators it uses:
sessions, scheduler, membership, gateway, updates...), bind the gRPC stream, enrolment and
the HTTP listener, then run the reconcile loop. No part sees this object.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
import ssl
import time
from pathlib import Path

import grpc
from aiohttp import web
from aiohttp.typedefs import Middleware
from cryptography import x509

from llmgw import __version__
from llmgw.bodies import BodyBudget, return_large_buffers
from llmgw.client import write_ctl_config
from llmgw.contracts.control_planes import MAX_RETIRED_SERIALS, ControlPlaneList
from llmgw.contracts.keypolicy import UsageRow
from llmgw.contracts.paths import PACKAGED_BUNDLE_DIR
from llmgw.controlpeer import require_control_plane
from llmgw.errors import CertificateError, ConfigError, LlmgwError, StoreError
from llmgw.fsutil import write_private
from llmgw.listener import GuardedSite, listening_socket
from llmgw.log import kv
from llmgw.netaddr import (
    RESERVED_NAMES,
    format_hostport,
    is_ip_address,
    local_addresses,
    parse_hostport,
)
from llmgw.pki import (
    CA_CERT,
    Authority,
    Identity,
    cert_pem,
    control_plane_names,
    ensure_ca,
    ensure_server_identity,
    load_ca,
    load_cert,
    serial_hex,
)
from llmgw.proto import control_pb2 as pb
from llmgw.server.admin import AdminContext, add_admin_routes
from llmgw.server.authority import ClusterAuthority
from llmgw.server.bundles import Bundle, BundleStore, add_bundle_routes
from llmgw.server.config import ServerConfig
from llmgw.server.console import add_console_routes
from llmgw.server.enroll import Enroller, EnrolmentServer
from llmgw.server.follower import LeaderProxy, RouteFollower
from llmgw.server.gateway import Gateway, GatewaySettings
from llmgw.server.history import RequestHistory
from llmgw.server.httpapi import error_middleware
from llmgw.server.installs import EngineInstalls
from llmgw.server.intake import MAX_MESSAGE_BYTES
from llmgw.server.leadership import (
    LEADER_HTTP,
    LEADER_STREAM,
    LeaseKeeper,
    Standby,
    await_leadership,
    try_leadership,
)
from llmgw.server.limits import KeyLimits
from llmgw.server.lockout import Lockout
from llmgw.server.logins import Logins
from llmgw.server.metrics import Metrics
from llmgw.server.nodes import Membership
from llmgw.server.operators import OperatorAccounts
from llmgw.server.passwords import PASSWORD_FILE, AdminPassword
from llmgw.server.policies import RoutingPolicies
from llmgw.server.proxies import TrustedProxies, forwarded_middleware
from llmgw.server.reports import AgentReports
from llmgw.server.routing import Router
from llmgw.server.scheduler import Scheduler
from llmgw.server.serving import ServingCache
from llmgw.server.sessions import Sessions
from llmgw.server.states import NodeState
from llmgw.server.store import Store
from llmgw.server.store.instances import process_gone, process_name
from llmgw.server.stream import (
    ControlPlaneService,
    NodeSession,
    UpdateHandler,
    start_stream_server,
)
from llmgw.server.tls import ServingCertificate, serving_certificate
from llmgw.server.tokenizing import Tokenizers
from llmgw.server.updates import Updates
from llmgw.server.usage import UsageBook

__all__ = ["ControlPlane"]

log = logging.getLogger("llmgw.server")

CLUSTER_CA_META = "cluster_ca_hash"
# An instance silent this long (seconds) is no longer named to agents: its machine is gone.
INSTANCE_KEPT = 3600.0
# Seconds between two clean-ups of lapsed login sessions and spent failure counters.
LOGIN_PRUNE_EVERY = 600.0


def _read_or_create_token(path: Path, what: str = "admin") -> str:
    try:
        token = path.read_text().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(
            f"cannot read the {what} token: {exc.strerror}; it must be readable by the control "
            "plane's user",
            file=str(path),
        ) from exc
    token = f"llmgw-{what}-" + secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, (token + "\n").encode())
    return token


def _serial(cert: Path) -> str:
    """The serial of the certificate in *cert* (its leaf); "" when there is none yet, or
    none that can be read (ensure_server_identity issues one in its place)."""
    if not cert.exists():
        return ""
    try:
        return serial_hex(load_cert(cert))
    except CertificateError:
        return ""


def _dns_names(cert: Path) -> list[str]:
    """The DNS names (no wildcards) a certificate file is for; none if it cannot be read."""
    try:
        san = load_cert(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (LlmgwError, x509.ExtensionNotFound):
        return []
    return [n for n in san.value.get_values_for_type(x509.DNSName) if "*" not in n]


class ControlPlane:
    """One control plane process (the leader, on SQLite)."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.epoch = 0
        self.cluster_id = ""
        self.admin_token = ""
        # The live streams (node id -> session) and the nodes lost: kept by ``sessions``,
        # read by the scheduler, the membership, the updates and the admin API.
        self.live: dict[str, NodeSession] = {}
        self.lost: set[str] = set()
        self.metrics = Metrics()
        self.router = Router(RoutingPolicies(self.metrics))
        # Each model's last hour of requests and TTFT, this instance's gateway's (the
        # console's charts and GET /api/metrics/history).
        self.history = RequestHistory()
        # Each model's prompt tokenizer (cache-aware routing), loaded in the background when
        # the models change; fetched files kept by their SHA-256 (either role's gateway).
        self.tokenizers = Tokenizers(
            cfg.state_dir / "tokenizers", sources=cfg.tokenizer_sources, private=cfg.private_paths
        )
        # The body bytes the process holds at once (gateway and admin API together).
        self.bodies = BodyBudget(cfg.max_inflight_body_bytes)
        # Each API key's limits and the usage not stored yet: the process's, whatever its
        # role (a standby's gateway serves and counts too). On PostgreSQL each instance
        # enforces its share of a key's rate limits (the instances seen alive).
        self._serving_instances = 1
        self.key_limits = KeyLimits(
            instances=lambda: self._serving_instances, budget_spent=self._budget_spent
        )
        self.usage: UsageBook | None = None
        self._usage_task: asyncio.Task[None] | None = None
        # The leader's parts, each given what it uses (_assemble).
        self.store: Store
        self.serving: ServingCache
        self.scheduler: Scheduler
        self.gateway: Gateway
        self.membership: Membership
        self.installs: EngineInstalls
        self.reports: AgentReports
        self.sessions: Sessions
        self.password: AdminPassword
        self.operators: OperatorAccounts
        self.logins: Logins
        self.updates: Updates
        self.authority: ClusterAuthority
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
        self._enroller: Enroller | None = None
        self._enroll_tls: ServingCertificate | None = None
        # The TLS context the gateway dials agents' data planes with (made once, reloaded
        # in place when a CA rotation reissues the client certificate).
        self._client_ctx: ssl.SSLContext | None = None
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
        # On PostgreSQL: the lease, this process's name in the instances' registry, the
        # cluster CA's hash, and the tasks that keep the instance's row and step down.
        self._keeper: LeaseKeeper | None = None
        self._process = ""
        self.cluster_ca_hash = ""
        self._instance_task: asyncio.Task[None] | None = None
        self._stepping: asyncio.Task[None] | None = None
        self._http_sock: socket.socket | None = None
        self._follower: RouteFollower | None = None
        self._proxy: LeaderProxy | None = None
        self._standby_tasks: list[asyncio.Task[None]] = []
        # On PostgreSQL, :8080's one server and the role's application it hands requests to
        # (_serve_app), with the requests each application is serving.
        self._outer_runner: web.AppRunner | None = None
        self._current_app: web.Application | None = None
        self._app_inflight: dict[int, int] = {}
        self._retiring: set[asyncio.Task[None]] = set()

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
        if cfg.cleartext_exposed:
            log.warning(
                "http_listen serves plain HTTP beyond loopback: console passwords and cookies, "
                "the admin token and API keys travel in clear",
                extra=kv(
                    listen=cfg.http_listen,
                    fix="add 'tls: cluster' (or tls: {cert: FILE, key: FILE}) to server.yaml, "
                    "or listen on 127.0.0.1 behind a TLS proxy",
                ),
            )
        # 0. leadership: on PostgreSQL a lease among the instances; on SQLite a second
        # control plane on this state directory is a standby
        if cfg.shared_database:
            await self._start_shared()
            return
        self._lock_fd = try_leadership(cfg.state_dir)
        if self._lock_fd is None:
            await self._start_standby()
            return
        await self._start_leader()

    async def _start_shared(self) -> None:
        """One of several instances on a PostgreSQL database: the store first (it holds the
        lease), this instance registered (one process per instance id), the cluster's CA
        checked, then the leader's parts if the lease is free, else a standby's."""
        cfg = self.cfg
        self.store = Store.open(cfg.database_location)
        try:
            self._process = process_name()
            self.store.register_instance(
                cfg.instance,
                self._process,
                stale_after=cfg.instance_stale_after,
                version=__version__,
                gone=process_gone,
                # A retired instance's certificates left on this machine are refused here.
                serials=[_serial(self.pki_dir / f"{n}.crt") for n in ("server", "client")],
                pki_dir=str(self.pki_dir),
            )
            self._check_cluster_ca()
        except BaseException:
            self.store.close()
            raise
        self._keeper = LeaseKeeper(
            self.store, cfg.instance, duration=cfg.lease, renew=cfg.lease_renew
        )
        host, port = parse_hostport(cfg.http_listen, allow_zero=True)
        try:
            # One listening socket for the process's life: a change of role hands it from
            # the standby's gateway to the leader's, so no connection is refused between.
            self._http_sock = listening_socket(host, port)
        except OSError as exc:
            self.store.close()
            raise ConfigError(
                f"cannot listen on {cfg.http_listen}: {exc.strerror}; free the port or change "
                "http_listen",
                key="http_listen",
            ) from exc
        self._instance_task = asyncio.create_task(self._touch_instance(), name="instance")
        if self._keeper.try_take():
            await self._start_leader()
        else:
            await self._start_standby()

    def _check_cluster_ca(self) -> None:
        """Every instance signs with the one cluster CA: the first records its hash in the
        database; the others must hold the same CA (imported with --import-ca)."""
        local = load_ca(self.pki_dir).ca_hash() if (self.pki_dir / CA_CERT).exists() else None
        recorded = self.store.get_meta(CLUSTER_CA_META)
        if recorded is None and local is None:
            local = ensure_ca(self.pki_dir).ca_hash()
        if recorded is None:
            assert local is not None
            recorded = self.store.claim_meta(CLUSTER_CA_META, local)
        if local is None:
            raise ConfigError(
                f"this instance has no CA, and the cluster's is {recorded}; export it from a "
                "running instance ('llmgw ctl cert export-ca --out ca.llmgw') and import it "
                "here ('llmgw server --config server.yaml --import-ca ca.llmgw') before "
                "starting",
                key="database",
            )
        if local != recorded:
            raise ConfigError(
                f"this instance's CA ({local}, in {self.pki_dir}) is not the cluster's "
                f"({recorded}); it belongs to another cluster: move {self.pki_dir} aside and "
                "import the cluster's CA ('llmgw server --import-ca FILE'), or point database "
                "at this instance's own cluster",
                key="database",
            )
        self.cluster_ca_hash = recorded

    def _control_planes(self) -> ControlPlaneList:
        """Every instance's stream address, this one's first (what agents dial and keep),
        and the certificate serials of the retired instances (what their data planes
        refuse). StoreError when the database cannot say: a list of this instance alone
        would have the agents forget the others and the retired serials, so none is sent
        (the agents keep what they know)."""
        own = self.stream_addresses()
        if self._keeper is None:
            return ControlPlaneList(tuple(own))
        now = self.store.database.server_time()
        others = [
            i.stream_addr
            for i in self.store.list_instances()
            if i.id != self.cfg.instance and i.stream_addr and now - i.seen_at < INSTANCE_KEPT
        ]
        retired = self.store.retired_serials(MAX_RETIRED_SERIALS)
        return ControlPlaneList(tuple(own + [a for a in others if a not in own]), retired)

    async def _touch_instance(self) -> None:
        """Tell the other instances this one is alive (its row's seen_at); while leading,
        tell the agents when the instances changed."""
        told: ControlPlaneList | None = None
        while True:
            await asyncio.sleep(self.cfg.lease_renew)
            if self.role == "leader" and hasattr(self, "sessions"):
                with contextlib.suppress(StoreError):  # told at a later round
                    current = self._control_planes()
                    if current != told:
                        if told is not None:
                            self.sessions.broadcast_control_planes(current)
                        told = current
            try:
                if not self.store.touch_instance(self.cfg.instance, self._process):
                    log.error(
                        "another process has taken this instance's id; give each instance its "
                        "own instance_id",
                        extra=kv(instance=self.cfg.instance),
                    )
                self._count_serving_instances()
            except StoreError:
                continue

    async def _prune_logins(self) -> None:
        """Delete lapsed login sessions and spent failure counters every few minutes
        (a lapsed session is refused without it: this only keeps the tables small)."""
        while True:
            await asyncio.sleep(LOGIN_PRUNE_EVERY)
            try:
                self.logins.prune()
            except StoreError as exc:
                log.warning("login prune failed; trying again later", extra=kv(error=str(exc)))

    def _count_serving_instances(self) -> None:
        """How many instances serve the gateway now (those seen within three leases, this
        one included): each enforces that share of every key's rate limits."""
        now = time.time()
        alive = sum(
            1
            for i in self.store.list_instances()
            if i.id == self.cfg.instance or now - i.seen_at <= 3 * self.cfg.lease
        )
        if max(alive, 1) != self._serving_instances:
            self._serving_instances = max(alive, 1)
            self.key_limits.reshare()
            log.info(
                "the key limits are shared among the instances serving",
                extra=kv(instances=self._serving_instances),
            )

    def _budget_spent(self, key_id: str, since_day: str) -> int:
        """What the store holds of a key's tokens since a day (read once per key and budget
        period; the usage flushes keep it current after)."""
        try:
            return self.store.tokens_since(since_day, [key_id]).get(key_id, 0)
        except StoreError as exc:
            log.warning("cannot read a key's budget use", extra=kv(key=key_id, error=str(exc)))
            return 0

    def _pending_usage(self) -> list[UsageRow]:
        """This instance's usage not stored yet (the admin API adds it to the store's)."""
        return self.usage.pending() if self.usage is not None else []

    def _start_usage(self) -> UsageBook:
        """The usage book on this process's store, flushed every second from now on."""
        if self.usage is None:
            self.usage = UsageBook(self.store, self.key_limits)
        if self._usage_task is None:
            self._usage_task = asyncio.create_task(self.usage.run(), name="usage")
        return self.usage

    async def _stop_usage(self) -> None:
        """Stop the flushes and store what is left (the store still open)."""
        task, self._usage_task = self._usage_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.usage is not None:
            try:
                self.usage.flush()
            except LlmgwError as exc:
                log.warning(
                    "cannot store the last usage counts at shutdown; they are lost",
                    extra=kv(error=str(exc), rows=len(self.usage.pending())),
                )

    def _register_addresses(self) -> None:
        """Where agents, clients and the other instances reach this instance, the serials of
        its own certificates (those its retirement would have agents refuse), and the names
        it answers to (which no node id may take; a node that took one already is named)."""
        if self._keeper is None:
            return
        host, _ = parse_hostport(self.stream_addresses()[0], allow_zero=True)
        with contextlib.suppress(StoreError):
            self.store.set_instance_addresses(
                self.cfg.instance,
                stream=self.stream_addresses()[0],
                http=f"{self.cfg.http_scheme}://{format_hostport(host, self.http_port)}",
                enroll=format_hostport(host, self.enroll_port) if self.enroll_port else "",
                ca_hash=self.cluster_ca_hash,
                client_serial=_serial(self.client_identity.cert) if self.client_identity else "",
                server_serial=_serial(self.server_identity.cert) if self.server_identity else "",
                names=self._own_names(),
            )
        if self.role != "leader":  # the leader's start named them already
            with contextlib.suppress(StoreError):
                self._warn_of_nodes_named_like_the_control_plane(own_only=True)

    def _own_names(self) -> list[str]:
        """The host names of this instance's server certificate (host name, FQDN,
        ``advertise``): those no node may take, recorded for the other instances."""
        if self.server_identity is None:
            return []
        names = control_plane_names(load_cert(self.server_identity.cert)) - RESERVED_NAMES
        return sorted(n for n in names if not is_ip_address(n) and n != "localhost")

    async def _keep_lease(self) -> None:
        assert self._keeper is not None
        reason = await self._keeper.keep()
        self._stepping = asyncio.create_task(self._step_down(reason), name="step-down")

    async def _step_down(self, reason: str) -> None:
        """Another instance leads now: stop the leader's parts (their writes are fenced
        already) and serve as a standby."""
        log.warning(
            "another instance leads now; stepping down",
            extra=kv(instance=self.cfg.instance, epoch=self.epoch, reason=reason),
        )
        self.store.database.fence = None
        await self._stop_leader_parts()
        self.live = {}
        self.lost = set()
        # The router stays: the standby's gateway serves by it while the follower takes over.
        await self._start_standby()

    async def _start_standby(self) -> None:
        self.role = "standby"
        hosts = [*local_addresses(), *self.cfg.advertise]
        _ca, identity, _client = ensure_server_identity(self.pki_dir, hosts=hosts)
        if self._keeper is not None:
            self.ca, self.server_identity, self.client_identity = _ca, identity, _client
        cfg = self.cfg
        self._standby = Standby(
            identity,
            state_dir=cfg.state_dir,
            grpc_listen=cfg.grpc_listen,
            http_listen=cfg.http_listen,
            tls=cfg.tls,
            listeners=cfg.listeners,
            leader=self._keeper.leader_addresses if self._keeper is not None else None,
        )
        await self._standby.start(serve_http=self._keeper is None)
        self.grpc_port, self.http_port = self._standby.grpc_port, self._standby.http_port
        self.enroll_port = 0
        if self._keeper is not None:
            await self._start_standby_http()
        self._register_addresses()
        self._promotion = asyncio.create_task(self._await_leadership(), name="promotion")

    async def _await_leadership(self) -> None:
        if self._keeper is not None:
            await self._keeper.take()
        else:
            self._lock_fd = await await_leadership(self.cfg.state_dir)
        log.warning("the leader is gone; taking over", extra=kv(state_dir=str(self.cfg.state_dir)))
        assert self._standby is not None
        await self._standby.stop()
        self._standby = None
        await self._stop_standby_http()
        await self._start_leader()

    async def _start_standby_http(self) -> None:
        """A standby's gateway (routes followed from the database), its bundles, and the
        admin API and the console forwarded to the leader, on the process's listening
        socket."""
        assert self._keeper is not None and self._http_sock is not None
        assert self.server_identity is not None
        cfg = self.cfg
        self.serving = ServingCache(self.store, max_request_body=cfg.max_request_body)
        self.serving.on_keys = self.key_limits.forget
        self.serving.on_models = self.tokenizers.set_models
        follower = self._follower = RouteFollower(
            self.store,
            self.router,
            self.serving,
            resync_interval=cfg.resync_interval,
            on_routes_changed=self._count_ready,
        )
        follower.sync()
        self.gateway = Gateway(
            self.router,
            self.metrics,
            self.serving,
            self.bodies,
            GatewaySettings.of(cfg),
            revoked=lambda: follower.revoked,
            client_ssl=self._client_ssl_context,
            nodes_connected=lambda: 0,
            epoch=self._keeper.epoch,
            started_at=self.started_at,
            health=self._health,
            key_limits=self.key_limits,
            usage=self._start_usage(),
            history=self.history,
            tokenizers=self.tokenizers,
            readers=self._probe_readers(),
        )
        self.http_tls = serving_certificate(cfg.tls, self.server_identity)
        # The admin token every instance holds (the CA export carries it): the MAC of the
        # client addresses the console's logins count.
        token = _read_or_create_token(cfg.admin_token_file)
        proxy = self._proxy = LeaderProxy(
            lambda: self._keeper.leader_addresses()[1] if self._keeper else "",
            ssl=self._leader_ssl,
            secret=lambda: token,
        )
        app = web.Application(client_max_size=1024 * 1024, middlewares=self._middlewares())
        self.gateway.add_routes(app)
        self.bundles = add_bundle_routes(app, cfg.bundle_dir, PACKAGED_BUNDLE_DIR)
        proxy.add_routes(app)
        gateway = self.gateway
        app.on_cleanup.append(lambda _app: gateway.close())
        app.on_cleanup.append(lambda _app: proxy.close())
        await self._serve_app(app)
        self._standby_tasks = [
            asyncio.create_task(follower.run(), name="follow"),
            asyncio.create_task(follower.listen(), name="follow-notify"),
            asyncio.create_task(self.tokenizers.run(), name="tokenizers"),
        ]
        self._register_addresses()

    async def _stop_standby_http(self) -> None:
        tasks, self._standby_tasks = self._standby_tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._follower = None

    async def _serve_app(self, app: web.Application) -> None:
        """On PostgreSQL: serve *app* (the leader's or a standby's) on :8080 from now on.

        One server holds the listening socket and its connections for the process's life and
        hands each request to the current role's application, so that a change of role
        closes no client's connection (a keep-alive connection closed as a request is sent on
        it fails that request). The application replaced is cleaned up once the requests it
        was serving have ended."""
        app.freeze()
        await app.startup()
        old, self._current_app = self._current_app, app
        if self._outer_runner is None:
            await self._start_outer_http()
        if old is not None:
            task = asyncio.create_task(self._retire_app(old), name="retire-app")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    async def _start_outer_http(self) -> None:
        assert self._http_sock is not None
        cfg = self.cfg
        outer = web.Application(client_max_size=1024 * 1024)
        outer.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._outer_runner = web.AppRunner(
            outer, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await self._outer_runner.setup()
        site = GuardedSite(
            self._outer_runner,
            *parse_hostport(cfg.http_listen, allow_zero=True),
            label="http",
            limits=cfg.listeners,
            backlog=2048,
            hint="listeners.header_timeout in server.yaml",
            ssl_context=self.http_tls.context if self.http_tls else None,
            sock=self._http_sock,
        )
        await site.start()
        self.http_port = site.bound_port

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        app = self._current_app
        if app is None:
            return web.json_response(
                {"error": {"message": "this instance is changing role; retry", "code": "busy"}},
                status=503,
                headers={"Retry-After": "1"},
            )
        key = id(app)
        self._app_inflight[key] = self._app_inflight.get(key, 0) + 1
        try:
            # aiohttp's own entry into an application (what a sub-application gets): its
            # router, middlewares and handlers, on this server's request.
            return await app._handle(request)
        finally:
            self._app_inflight[key] -= 1

    async def _retire_app(self, app: web.Application) -> None:
        key = id(app)
        for _ in range(600):  # its streams may run long; 60 s at most
            if not self._app_inflight.get(key):
                break
            await asyncio.sleep(0.1)
        self._app_inflight.pop(key, None)
        await app.cleanup()

    def _middlewares(self) -> list[Middleware]:
        """Of :8080's application, a leader's or a standby's: the client behind a trusted
        proxy in place of the proxy, then the JSON errors."""
        return [forwarded_middleware(TrustedProxies(self.cfg.trusted_proxies)), error_middleware]

    def _leader_ssl(self) -> ssl.SSLContext | bool:
        """TLS towards the leader's admin API: its certificate is the cluster CA's (tls:
        cluster) or the operator's, which the system's trust store verifies."""
        if self.cfg.tls is None:
            return False
        if self.cfg.tls.cluster:
            # A node's certificate from the same CA passes for the leader's host name:
            # only the control plane's identity lets the operator's token through.
            cafile = self.pki_dir / CA_CERT
            return require_control_plane(ssl.create_default_context(cafile=str(cafile)), cafile)
        return True

    def _probe_readers(self) -> tuple[str, ...]:
        """The tokens that read /metrics and /healthz's details (llmgw.server.probes)."""
        return (
            _read_or_create_token(self.cfg.metrics_token_path, "metrics"),
            _read_or_create_token(self.cfg.admin_token_file),
        )

    def _health(self) -> dict[str, object]:
        """What /healthz says of this instance among several: its role, the leader, and the
        database when it is away."""
        out: dict[str, object] = {"role": self.role, "instance": self.cfg.instance}
        if self._keeper is not None:
            out["epoch"] = self._keeper.epoch
            if self.role != "leader":
                out["leader"] = self._keeper.leader_addresses()[1]
        down = getattr(self.store.database, "unreachable_since", None)
        if down is not None:
            out["database"] = (
                f"unreachable since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(down))}; "
                "scheduling and admin writes pause, the gateway serves from what it knows"
            )
        return out

    async def _start_leader(self) -> None:
        cfg = self.cfg
        self.role = "leader"
        # 1. state store, leader epoch (on PostgreSQL: the lease's, which fences our writes)
        if self._keeper is None:
            self.store = Store.open(cfg.database_location)
            self.epoch = self.store.bump_epoch()
        else:
            self.epoch = self._keeper.epoch
            self.store.database.fence = self._keeper.fence
        self.cluster_id = self.store.cluster_id()
        self.store.set_all_disconnected()
        self.lost.update(n.id for n in self.store.list_nodes() if n.lost)
        # 2. CA and this server's identities, the admin token and password
        hosts = [*local_addresses(), *cfg.advertise]
        self.ca, self.server_identity, self.client_identity = ensure_server_identity(
            self.pki_dir, hosts=hosts
        )
        self.control_plane_names = RESERVED_NAMES | control_plane_names(
            load_cert(self.server_identity.cert)
        )
        self._warn_of_nodes_named_like_the_control_plane()
        self.admin_token = _read_or_create_token(cfg.admin_token_file)
        # Its checks count in the logins' lockout, under server.yaml's limits.
        self.password = AdminPassword(
            self.store,
            cfg.admin_token_file.parent / PASSWORD_FILE,
            lockout=Lockout(self.store, cfg.console),
        )
        self.password.start()
        # The first operator account is the admin password (new stores and upgraded ones).
        self.operators = OperatorAccounts(self.store, self.password)
        self.operators.ensure_first_admin()
        self.logins = Logins(self.store, self.operators, cfg.console)
        # 3. the parts of the leader, each given what it uses
        self._assemble(self.ca, hosts)
        if self._keeper is not None:
            # Until the agents reattach, route by what the database says is ready (their
            # data planes serve without a control plane).
            RouteFollower(
                self.store, self.router, self.serving, resync_interval=cfg.resync_interval
            ).sync()
        # 4. the Connect stream
        await self._start_grpc()
        # 5. enrolment
        await self._start_enrolment()
        # 6. gateway, admin API, metrics
        await self._start_http()
        self._write_ctl_config()
        # 7. reconcile
        self._tasks.append(asyncio.create_task(self.scheduler.run(), name="scheduler"))
        self._tasks.append(asyncio.create_task(self.installs.run(), name="engine-installs"))
        self._tasks.append(asyncio.create_task(self.sessions.watch_heartbeats(), name="heartbeats"))
        self._tasks.append(asyncio.create_task(self.sessions.store_last_seen(), name="last-seen"))
        self._tasks.append(asyncio.create_task(self.authority.run(), name="ca-rotation"))
        self._tasks.append(asyncio.create_task(self._prune_logins(), name="prune-logins"))
        self._tasks.append(asyncio.create_task(self.tokenizers.run(), name="tokenizers"))
        if self._keeper is not None:
            self._register_addresses()
            self._tasks.append(asyncio.create_task(self._keep_lease(), name="lease"))
            self.store.add_event(
                "server_started",
                "control-plane",
                f"instance {cfg.instance} leads, epoch {self.epoch}",
            )
        else:
            self.store.add_event("server_started", "control-plane", f"epoch {self.epoch}")
        # Nodes that do not come back within the reattach grace (at least the loss timeout)
        # after this start are lost.
        grace = max(self.cfg.loss_timeout, self.cfg.reattach_grace)
        for node_id in sorted({s.node_id for s in self.store.list_shards()}):
            if node_id not in self.live:
                self.sessions.start_loss_timer(node_id, grace)
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

    def _assemble(self, ca: Authority, hosts: list[str]) -> None:
        """Build the leader's parts in dependency order, each with the collaborators and the
        settings it uses (none of them sees this object)."""
        cfg, store, router = self.cfg, self.store, self.router
        self.serving = ServingCache(store, max_request_body=cfg.max_request_body)
        self.serving.on_keys = self.key_limits.forget
        self.serving.on_models = self.tokenizers.set_models
        self.serving.refresh_keys()
        self.serving.refresh_models()
        self.installs = EngineInstalls(store, sessions=self.live, epoch=self.epoch)
        self.scheduler = Scheduler(
            store,
            router,
            sessions=self.live,
            lost=self.lost,
            on_routes_changed=self._count_ready,
            engine_holds=self.installs.holds,
        )
        self.gateway = Gateway(
            router,
            self.metrics,
            self.serving,
            self.bodies,
            GatewaySettings.of(cfg),
            revoked=lambda: self.membership.revoked,
            client_ssl=self._client_ssl_context,
            nodes_connected=lambda: len(self.live),
            epoch=self.epoch,
            started_at=self.started_at,
            health=self._health if self._keeper is not None else None,
            key_limits=self.key_limits,
            usage=self._start_usage(),
            history=self.history,
            tokenizers=self.tokenizers,
            readers=self._probe_readers(),
        )
        self.membership = Membership(
            store,
            self.scheduler,
            router,
            sessions=self.live,
            ca=ca,
            cert_lifetime=cfg.cert_lifetime,
            forget_node=self.gateway.forget_node,
            control_plane_names=lambda: self.control_plane_names,
        )
        self.membership.load()
        self.reports = AgentReports(
            store,
            router,
            self.scheduler,
            installs=self.installs,
            renew=self.membership.renew,
            on_routes_changed=self._count_ready,
        )
        self.sessions = Sessions(
            store,
            router,
            self.metrics,
            live=self.live,
            lost=self.lost,
            membership=self.membership,
            scheduler=self.scheduler,
            reports=self.reports,
            epoch=self.epoch,
            loss_timeout=cfg.loss_timeout,
            on_routes_changed=self._count_ready,
        )
        # The engines' KV cache events, forwarded by the agents: the gateway's prefix index.
        self.sessions.on_kv_events = router.prefixes.apply
        self.updates = Updates(
            store,
            accounts=self.operators,
            ca=ca,
            epoch=self.epoch,
            sessions=self.live,
            served=self._served_bundles,
            download_base=self._download_base,
            bundle_dir=cfg.bundle_dir,
        )
        self.authority = ClusterAuthority(
            self.pki_dir,
            ca,
            store,
            sessions=self.live,
            hosts=hosts,
            on_reissued=self._on_ca_reissued,
        )

    def _warn_of_nodes_named_like_the_control_plane(self, *, own_only: bool = False) -> None:
        """Nodes that joined under a name this instance or another registered one answers
        to (before such ids were refused, or before that instance was registered) keep their
        certificates, which do not pass for a control plane's; the operator should still
        rename them. ``own_only``: this instance's names alone (a standby registering)."""
        names = dict.fromkeys(self._own_names() if own_only else self.control_plane_names, "")
        if not own_only:
            with contextlib.suppress(StoreError):
                names.update(self.store.instance_names())
        for node in self.store.list_nodes():
            if node.id in names and node.state != NodeState.REVOKED:
                log.warning(
                    "a node has the control plane's name as its id; it can no longer pose as "
                    "the control plane, but give it another id",
                    extra=kv(
                        node=node.id,
                        instance=names[node.id] or self.cfg.instance,
                        hint=f"llmgw ctl revoke {node.id}, then join the machine under another "
                        "node id",
                    ),
                )

    async def _start_grpc(self) -> None:
        assert self.server_identity is not None
        service = ControlPlaneService(
            self.store,
            self.sessions,
            _OnConnect(self.updates, self.authority),
            cluster_id=self.cluster_id,
            epoch=self.epoch,
            heartbeat_interval=self.cfg.heartbeat_interval,
            cert_lifetime=self.cfg.cert_lifetime,
            control_planes=self._control_planes,
        )
        self._grpc, self.grpc_port = await start_stream_server(
            self.server_identity,
            self.cfg.grpc_listen,
            service,
            handshake_timeout=self.cfg.listeners.handshake_timeout,
            options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.keepalive_permit_without_calls", 1),
                # Larger messages end the stream with RESOURCE_EXHAUSTED (llmgw.server.intake).
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )

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

    async def _start_enrolment(self) -> None:
        assert self.ca is not None and self.server_identity is not None
        enroller = self._enroller = Enroller(
            self.store,
            self.ca,
            lifetime=self.cfg.cert_lifetime,
            servers=lambda: list(self._control_planes().servers),
            on_enrolled=self.membership.enrolled,
            control_plane_names=lambda: self.control_plane_names,
        )
        self._enrolment = EnrolmentServer(enroller)
        host, port = parse_hostport(self.cfg.enroll_listen, allow_zero=True)
        # Reloaded when the files change: a CA rotation reissues the server certificate.
        self._enroll_tls = ServingCertificate(
            self.server_identity.cert, self.server_identity.key, what="enroll"
        )
        try:
            self.enroll_port = await self._enrolment.start(
                host,
                port,
                self._enroll_tls.context,
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
        assert self.server_identity is not None and self.ca is not None
        cfg = self.cfg
        self.http_tls = serving_certificate(cfg.tls, self.server_identity)
        return_large_buffers()  # large bodies' memory goes back to the system once freed
        # Bodies are read through llmgw.bodies; this only bounds any other reader.
        app = web.Application(client_max_size=1024 * 1024, middlewares=self._middlewares())
        self.gateway.add_routes(app)
        self.bundles = add_bundle_routes(app, cfg.bundle_dir, PACKAGED_BUNDLE_DIR)
        admin = AdminContext(
            store=self.store,
            scheduler=self.scheduler,
            router=self.router,
            membership=self.membership,
            updates=self.updates,
            password=self.password,
            operators=self.operators,
            logins=self.logins,
            installs=self.installs,
            serving=self.serving,
            bodies=self.bodies,
            sessions=self.live,
            lost=self.lost,
            listening=self,
            ca=self.ca,
            bundles=self.bundles,
            cluster_id=self.cluster_id,
            epoch=self.epoch,
            admin_token=self.admin_token,
            admin_token_file=cfg.admin_token_file,
            control_plane_names=self.control_plane_names,
            tls=cfg.tls,
            http_scheme=cfg.http_scheme,
            advertise=cfg.advertise,
            instance_stale_after=cfg.instance_stale_after,
            enroll_loopback_only=cfg.enroll_loopback_only,
            metrics=self.metrics,
            tokenizer_problem=self.tokenizers.problem,
            pending_usage=self._pending_usage,
            history=self.history,
        )
        add_admin_routes(app, admin, self.authority)
        add_console_routes(app, admin, cleartext=cfg.cleartext_exposed)
        gateway = self.gateway
        app.on_cleanup.append(lambda _app: gateway.close())
        if self._keeper is not None:
            await self._serve_app(app)
            return
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
            sock=self._http_sock,
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
        for extra in (self._stepping, self._instance_task):
            if extra is not None:
                extra.cancel()
                await asyncio.gather(extra, return_exceptions=True)
        if self._promotion is not None:
            self._promotion.cancel()
            await asyncio.gather(self._promotion, return_exceptions=True)
        if self._standby is not None:
            await self._standby.stop()
            self._standby = None
        if self.role != "leader":
            await self._stop_standby_http()
            await self._stop_outer_http()
            if self._keeper is not None:
                await self._stop_usage()
                self.store.close()
            self._close_http_socket()
            self._release()
            return
        await self._stop_leader_parts()
        await self._stop_outer_http()
        await self._stop_usage()
        if self._keeper is not None:
            self.store.database.fence = None
            self._keeper.release()  # a standby takes over at its next poll
        self.store.close()
        self._close_http_socket()
        self._release()

    async def _stop_outer_http(self) -> None:
        if self._outer_runner is not None:
            runner, self._outer_runner = self._outer_runner, None
            await runner.cleanup()
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._current_app is not None:
            app, self._current_app = self._current_app, None
            await app.cleanup()

    def _close_http_socket(self) -> None:
        if self._http_sock is not None:
            self._http_sock.close()
            self._http_sock = None

    async def _stop_leader_parts(self) -> None:
        """Stop what only the leader runs (the store stays open)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if hasattr(self, "sessions"):  # not when the start failed before step 3
            self.sessions.close_all()
        if self._grpc is not None:
            grpc_server, self._grpc = self._grpc, None
            await grpc_server.stop(grace=2.0)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._enrolment is not None:
            await self._enrolment.stop()
            self._enrolment = None

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- what the parts are given that only this object knows ----------------------------------

    def _count_ready(self) -> None:
        """The ready-replicas gauge, after the routable replicas changed."""
        for model in self.serving.models:
            self.metrics.ready_replicas.set((model,), len(self.router.endpoints(model)))

    async def _served_bundles(self) -> list[Bundle]:
        return await self.bundles.bundles() if self.bundles is not None else []

    def _download_base(self) -> str:
        """Where nodes download bundles: the HTTP listener, at the host they dial for the
        stream."""
        host, _ = parse_hostport(self.stream_addresses()[0], allow_zero=True)
        return f"{self.cfg.http_scheme}://{format_hostport(host, self.http_port)}"

    def _client_ssl_context(self) -> ssl.SSLContext:
        """TLS the gateway presents to agents' data planes."""
        assert self.client_identity is not None
        if self._client_ctx is None:
            ident = self.client_identity
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ident.ca))
            ctx.load_cert_chain(ident.cert, ident.key)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            self._client_ctx = ctx
        return self._client_ctx

    def _on_ca_reissued(self) -> None:
        """A CA rotation (or the drop of the old CA) reissued this control plane's
        certificates: the listeners whose files changed load them on their next handshake
        by themselves (the stream, enrolment, :8080); the gateway's context to the data
        planes and the CA enrolment hands out are refreshed here."""
        if self._client_ctx is not None and self.client_identity is not None:
            # A context's trust can only grow, so a fresh one: after a drop the old CA is
            # trusted no more for data-plane connections, and the pool's open connections
            # (verified under the old trust) are closed as soon as they are free.
            self._client_ctx = None
            self.gateway.retrust(self._client_ssl_context())
        if self._enroller is not None and self.ca is not None:
            self._enroller.ca_pem = cert_pem(self.ca.cert).decode("ascii")
        if self._enroll_tls is not None:
            self._enroll_tls.reload_if_changed()
        if self.http_tls is not None:
            self.http_tls.reload_if_changed()
        self._register_addresses()  # the new certificates' serials


class _OnConnect:
    """What the stream tells on a node's (re)connection: first its trust bundle (the CA
    rotation's), then the update order waiting for it."""

    def __init__(self, updates: UpdateHandler, authority: ClusterAuthority) -> None:
        self.updates = updates
        self.authority = authority

    def on_connect(self, session: NodeSession) -> None:
        self.authority.on_connect(session)
        self.updates.on_connect(session)

    def on_status(self, session: NodeSession, status: pb.UpdateStatus) -> None:
        self.updates.on_status(session, status)
