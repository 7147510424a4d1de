"""The control plane process: wiring and start/stop only.

``ControlPlane.start()`` is the straight-line start-up of STYLE 10: validate the state
directory, then hand over to the role machine (:mod:`llmgw.server.ha`): lead when the
leadership is free, else stand by. Leading: open the store and bump the leader epoch, mark
every node disconnected (streams do not survive a restart), make sure the CA and this
server's certificates exist, build the leader's parts (:mod:`llmgw.server.leader`, each
given the few collaborators it uses), bind the gRPC stream, enrolment and the HTTP
listener, then run the reconcile loops. No part sees this object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Set
from pathlib import Path

from aiohttp import web

from llmgw import __version__
from llmgw.bodies import BodyBudget, return_large_buffers
from llmgw.contracts.control_planes import ControlPlaneList
from llmgw.contracts.paths import PACKAGED_BUNDLE_DIR
from llmgw.errors import ConfigError, StoreError
from llmgw.listener import GuardedSite, listening_socket
from llmgw.log import kv
from llmgw.netaddr import RESERVED_NAMES, format_hostport, local_addresses, parse_hostport
from llmgw.pki import Authority, Identity, control_plane_names, ensure_server_identity, load_cert
from llmgw.server.admin import AdminContext, add_admin_routes
from llmgw.server.common.config import ServerConfig
from llmgw.server.common.metrics import Metrics
from llmgw.server.common.tls import ServingCertificate, serving_certificate
from llmgw.server.console import add_console_routes
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.gateway import Gateway, GatewaySettings
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.limits import KeyLimits
from llmgw.server.gateway.policies import RoutingPolicies
from llmgw.server.gateway.routing import Router
from llmgw.server.gateway.serving import ServingCache
from llmgw.server.gateway.tokenizing import Tokenizers
from llmgw.server.ha import (
    LEADER_HTTP,
    LEADER_STREAM,
    Drain,
    DrainOutcome,
    FileLock,
    Handover,
    Instances,
    Leadership,
    LeaseKeeper,
    Role,
    Roles,
    Standby,
    leader_ssl,
    stop_accepting,
)
from llmgw.server.ha.follower import LeaderProxy, RouteFollower
from llmgw.server.ha.instances import warn_of_nodes_named_like_the_control_plane
from llmgw.server.ha.kvrelay import RELAY_PATH, KvFollower, KvRelay
from llmgw.server.joining.bundles import BundleStore, serve_bundles
from llmgw.server.leader import Leader, LeaderHooks
from llmgw.server.process import (
    DataPlaneTLS,
    UsageFlusher,
    middlewares,
    probe_readers,
    read_or_create_token,
    write_ctl_yaml,
)
from llmgw.server.store import Store

__all__ = ["ControlPlane"]

log = logging.getLogger("llmgw.server")


class ControlPlane:
    """One control plane process: its parts, wired, in the role it holds."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.epoch = 0
        self.cluster_id = ""
        self.admin_token = ""
        # The live streams (node id -> session) and the nodes lost: kept by the leader's
        # sessions, read by the scheduler, the membership, the updates and the admin API.
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
        # Each API key's limits and the usage not stored yet, whatever the role (a standby's
        # gateway serves and counts too). On PostgreSQL each instance enforces its share of
        # a key's rate limits (the instances seen alive, ``instances``).
        self.usage = UsageFlusher()
        self.instances: Instances | None = None
        self.key_limits = KeyLimits(
            instances=lambda: self.instances.serving if self.instances else 1,
            budget_spent=self.usage.budget_spent,
        )
        # What either role serves (lead, stand_by), and the leader's own parts while it
        # leads (None otherwise).
        self.store: Store
        self.serving: ServingCache
        self.gateway: Gateway
        self.leader: Leader | None = None
        # The agent bundles :8080 serves (either role), their hashes kept across roles.
        self.bundles = BundleStore(cfg.bundle_dir, PACKAGED_BUNDLE_DIR)
        self.http_port = self.grpc_port = self.enroll_port = 0
        self.ca: Authority | None = None
        self.server_identity: Identity | None = None
        self.client_identity: Identity | None = None
        self.data_plane_tls = DataPlaneTLS()
        # Every name in this control plane's certificates: no node may take one as its id.
        self.control_plane_names: frozenset[str] = frozenset(RESERVED_NAMES)
        self.started_at = time.time()
        self._runner: web.AppRunner | None = None
        # The certificate :8080 serves when server.yaml has tls (None: plain HTTP).
        self.http_tls: ServingCertificate | None = None
        # :8080's listening socket (on PostgreSQL kept for the process's life, each role's
        # application served on it in turn by ``handover``).
        self.http_sock: socket.socket | None = None
        self.handover: Handover | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.leadership: Leadership = FileLock(cfg.state_dir)
        self.roles = Roles(self.leadership, self, instance=cfg.instance)
        self._standby: Standby | None = None
        # The leader's KV events relay to the standbys (PostgreSQL), closed when it stops leading.
        self._relay: KvRelay | None = None
        # A stop's drain (SIGTERM): /healthz 503, then no new connection, then the requests
        # in flight awaited (llmgw.server.ha.drain).
        self.drain = Drain(
            grace=cfg.drain_grace,
            timeout=cfg.drain_timeout,
            metrics=self.metrics,
            unawaited=frozenset({RELAY_PATH}),
        )

    @property
    def pki_dir(self) -> Path:
        return self.cfg.state_dir / "pki"

    @property
    def http_addr(self) -> str:
        host = parse_hostport(self.cfg.http_listen, allow_zero=True)[0]
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        return format_hostport(host, self.http_port)

    # -- start-up and stop ---------------------------------------------------------------------

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
            self._join_instances()
        await self.roles.start()

    def _join_instances(self) -> None:
        """On PostgreSQL: the store first (it holds the lease), this instance registered
        (one process per instance id, the cluster's CA checked), and :8080's socket kept for
        the process's life: a change of role hands it from one role's application to the
        next, so that no connection is refused between."""
        cfg = self.cfg
        self.store = Store.open(cfg.database_location)
        try:
            self.instances = Instances(self.store, cfg, reshare=self.key_limits.reshare)
            self.instances.register()
            try:
                host, port = parse_hostport(cfg.http_listen, allow_zero=True)
                self.http_sock = listening_socket(host, port)
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen on {cfg.http_listen}: {exc.strerror}; free the port or "
                    "change http_listen",
                    key="http_listen",
                ) from exc
        except BaseException:
            self.store.close()
            raise
        self.leadership = LeaseKeeper(
            self.store, cfg.instance, duration=cfg.lease, renew=cfg.lease_renew
        )
        self.roles = Roles(self.leadership, self, instance=cfg.instance)
        self.handover = Handover(self.http_sock, listen=cfg.http_listen, limits=cfg.listeners)
        keep = self.instances.keep(
            self.stream_addresses, lambda: self.leader.sessions if self.leader else None
        )
        self._tasks.append(asyncio.create_task(keep, name="instance"))

    async def drain_then_stop(self) -> DrainOutcome:
        """A stop that drops no request (SIGTERM): the drain, then :meth:`stop` (the
        leader's lease handed over at once). A second signal hurries it
        (``self.drain.hurry()``)."""
        self.drain.begin()  # /healthz 503 before anything that may wait on the store
        await self.roles.stay()  # a draining standby takes no leadership
        self._event(
            "instance_draining",
            f"/healthz answers 503 for {self.cfg.drain_grace:g} s, then the requests in flight "
            f"have {self.cfg.drain_timeout:g} s to end",
        )
        try:
            outcome = await self.drain.run(self._stop_accepting)
        except BaseException:
            await self.stop()
            raise
        ended = f"drained in {outcome.seconds:g} s: {outcome.finished} requests ended"
        if outcome.cut:
            ended += f", {outcome.cut} cut ({outcome.streams_cut} streams)"
        await self.stop(ended)
        return outcome

    async def _stop_accepting(self) -> None:
        """:8080 takes no new connection (either role's listener)."""
        if self.handover is not None:
            await self.handover.stop_accepting()
            self.http_sock = None  # closed with it
        elif self._runner is not None:
            await stop_accepting(self._runner)

    def _event(self, kind: str, message: str) -> None:
        """An event of this instance, when it has the store open and the store answers."""
        store = getattr(self, "store", None)
        if store is None or (not self.leadership.shared and self.roles.role is not Role.LEADER):
            return
        subject = self.cfg.instance if self.leadership.shared else "control-plane"
        try:
            store.add_event(kind, subject, message)
        except StoreError as exc:
            log.warning("cannot record an event", extra=kv(kind=kind, error=str(exc)))

    async def stop(self, why: str = "") -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        leading = self.roles.role is Role.LEADER
        await self.roles.stop()
        if self.handover is not None:
            await self.handover.close()
        if leading or self.leadership.shared:
            await self.usage.stop()
            self.leadership.end()
            if why:
                self._event("instance_stopped", why)
            if leading and self.leadership.shared:
                self.leadership.release()  # a standby takes over at once (its NOTIFY)
            self.store.close()
        if self.http_sock is not None:
            self.http_sock.close()
            self.http_sock = None
        if not self.leadership.shared:
            self.leadership.release()  # the lock, after the store's last write

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

    # -- the roles' parts (llmgw.server.ha.RoleParts) ------------------------------------------

    async def lead(self) -> None:
        cfg = self.cfg
        # 1. state store, leader epoch (on PostgreSQL: the lease's, which fences our writes)
        if not self.leadership.shared:
            self.store = Store.open(cfg.database_location)
        self.epoch = self.leadership.begin(self.store)
        self.cluster_id = self.store.cluster_id()
        self.store.set_all_disconnected()
        self.lost.update(n.id for n in self.store.list_nodes() if n.lost)
        # 2. CA and this server's identities, the admin token
        hosts = [*local_addresses(), *cfg.advertise]
        self.ca, self.server_identity, self.client_identity = ensure_server_identity(
            self.pki_dir, hosts=hosts
        )
        self.data_plane_tls.identity = self.client_identity
        self.control_plane_names = RESERVED_NAMES | control_plane_names(
            load_cert(self.server_identity.cert)
        )
        warn_of_nodes_named_like_the_control_plane(
            self.store, self.control_plane_names, cfg.instance
        )
        self.admin_token = read_or_create_token(cfg.admin_token_file)
        # 3. the gateway, then the parts of the leader, each given what it uses
        app = self._gateway(revoked=lambda: leader.membership.revoked, connected=self.live.__len__)
        if self.leadership.shared:
            # The agents' KV events, relayed to each standby that asks (every instance routes
            # a kv-events model by what the replicas hold).
            self._relay = KvRelay(self.router, lambda: self.admin_token, self.metrics)
            self._relay.add_routes(app)
        self.serving.refresh_keys()
        self.serving.refresh_models()
        leader = self.leader = Leader(
            cfg,
            self.store,
            self.router,
            self.metrics,
            ca=self.ca,
            hosts=hosts,
            epoch=self.epoch,
            live=self.live,
            lost=self.lost,
            hooks=LeaderHooks(
                count_ready=self._count_ready,
                forget_node=self.gateway.forget_node,
                control_plane_names=lambda: self.control_plane_names,
                control_planes=self._control_planes,
                served=self.bundles.bundles,
                download_base=self._download_base,
                on_reissued=self._on_ca_reissued,
                capacity=self.gateway.capacity,
            ),
        )
        if self.leadership.shared:
            # Until the agents reattach, route by what the database says is ready (their
            # data planes serve without a control plane).
            RouteFollower(
                self.store, self.router, self.serving, resync_interval=cfg.resync_interval
            ).sync()
        # 4. the Connect stream and enrolment, 5. :8080 (gateway, admin API, console)
        await leader.start(self.server_identity, self.cluster_id)
        self.grpc_port, self.enroll_port = leader.grpc_port, leader.enroll_port
        await self._serve_http(app, leader)
        # 6. reconcile; nodes that do not come back within the reattach grace are lost
        leader.run(grace=max(cfg.loss_timeout, cfg.reattach_grace))
        self._tasks.append(asyncio.create_task(self.tokenizers.run(), name="tokenizers"))
        started = f"epoch {self.epoch}"
        if self.leadership.shared:
            self._record_addresses()
            started = f"instance {cfg.instance} leads, epoch {self.epoch}"
        self.store.add_event("server_started", "control-plane", started)
        self.store.set_meta(LEADER_STREAM, self.stream_addresses()[0])
        self.store.set_meta(LEADER_HTTP, f"{cfg.http_scheme}://{self.http_addr}")
        grpc_host = parse_hostport(cfg.grpc_listen, allow_zero=True)[0]
        log.info(
            "control plane started",
            extra=kv(
                version=__version__,
                epoch=self.epoch,
                cluster=self.cluster_id,
                http=self.http_addr,
                grpc=format_hostport(grpc_host, self.grpc_port),
            ),
        )

    async def stop_leading(self) -> None:
        """Stop what only the leader runs (the store stays open)."""
        if self._relay is not None:
            # First: the standbys' relay streams end now. The kept socket's application is
            # never shut down (its on_shutdown never runs), so they would hold a stop for the
            # runner's shutdown_timeout before the lease's release, and outlive a step-down.
            relay, self._relay = self._relay, None
            relay.close()
        await self._stop_tasks()
        if self.leader is not None:  # not when the start failed before step 3
            leader, self.leader = self.leader, None
            await leader.stop()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        self.live = {}
        self.lost = set()

    async def stand_by(self) -> None:
        """Refuse agents' streams naming the leader; on SQLite answer :8080 with 503, on
        PostgreSQL serve a gateway (routes followed from the database), the bundles, and the
        admin API and the console forwarded to the leader."""
        cfg = self.cfg
        hosts = [*local_addresses(), *cfg.advertise]
        ca, identity, client = ensure_server_identity(self.pki_dir, hosts=hosts)
        shared = self.leadership.shared
        if shared:
            self.ca, self.server_identity, self.client_identity = ca, identity, client
            self.data_plane_tls.identity = client
        self._standby = Standby(
            identity,
            state_dir=cfg.state_dir,
            grpc_listen=cfg.grpc_listen,
            http_listen=cfg.http_listen,
            tls=cfg.tls,
            listeners=cfg.listeners,
            leader=self.leadership.leader_addresses,
        )
        await self._standby.start(serve_http=not shared)
        self.grpc_port, self.http_port = self._standby.grpc_port, self._standby.http_port
        self.enroll_port = 0
        if not shared:
            return
        app = self._gateway(revoked=lambda: follower.revoked, connected=lambda: 0)
        follower = RouteFollower(
            self.store,
            self.router,
            self.serving,
            resync_interval=cfg.resync_interval,
            on_routes_changed=self._count_ready,
        )
        follower.sync()
        # The admin token every instance holds (the CA export carries it): the MAC of the
        # client addresses the console's logins count.
        token = read_or_create_token(cfg.admin_token_file)
        proxy = LeaderProxy(
            lambda: self.leadership.leader_addresses()[1],
            ssl=lambda: leader_ssl(cfg.tls, self.pki_dir),
            secret=lambda: token,
            database_away=lambda: getattr(self.store.database, "unreachable_since", None),
        )
        proxy.add_routes(app)
        app.on_cleanup.append(lambda _app: proxy.close())
        await self._serve_http(app, None)
        kv_follower = KvFollower(
            self.router,
            lambda: self.leadership.leader_addresses()[1],
            token=lambda: token,
            ssl=lambda: leader_ssl(cfg.tls, self.pki_dir),
            metrics=self.metrics,
        )
        for name, run in (
            ("follow", follower.run()),
            ("follow-kv-events", kv_follower.run()),
            ("follow-notify", follower.listen()),
            ("tokenizers", self.tokenizers.run()),
            # What this gateway sees, for the leader's planner (serving by demand).
            ("demand", self.gateway.capacity.publish(self.store, cfg.instance)),
        ):
            self._tasks.append(asyncio.create_task(run, name=name))
        self._record_addresses()

    async def stop_standing_by(self) -> None:
        if self._standby is not None:
            await self._standby.stop()
            self._standby = None
        await self._stop_tasks()

    async def _stop_tasks(self) -> None:
        """Stop the role's own loops (the instance's row is kept whatever the role)."""
        tasks = [t for t in self._tasks if t.get_name() != "instance"]
        self._tasks = [t for t in self._tasks if t.get_name() == "instance"]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- :8080 ---------------------------------------------------------------------------------

    def _gateway(
        self, *, revoked: Callable[[], Set[str]], connected: Callable[[], int]
    ) -> web.Application:
        """Either role's :8080 application, with its serving cache and gateway (the one
        place they are built), closed with it; its queued requests hear of replicas becoming
        ready until then."""
        cfg = self.cfg
        return_large_buffers()  # large bodies' memory goes back to the system once freed
        # Bodies are read through llmgw.bodies; this only bounds any other reader.
        app = web.Application(client_max_size=1024 * 1024, middlewares=middlewares(cfg, self.drain))
        app.on_response_prepare.append(self.drain.on_prepare)
        self.serving = ServingCache(
            self.store,
            max_request_body=cfg.max_request_body,
            on_keys=self.key_limits.forget,
            on_models=self.tokenizers.set_models,
        )
        gateway = self.gateway = Gateway(
            self.router,
            self.metrics,
            self.serving,
            self.bodies,
            GatewaySettings.of(cfg),
            revoked=revoked,
            client_ssl=self.data_plane_tls.context,
            nodes_connected=connected,
            epoch=self.leadership.epoch,
            started_at=self.started_at,
            health=(lambda: self.roles.health(self.store)) if self.leadership.shared else None,
            key_limits=self.key_limits,
            usage=self.usage.start(self.store, self.key_limits),
            history=self.history,
            tokenizers=self.tokenizers,
            readers=probe_readers(cfg),
            draining=self.drain.status,
        )
        gateway.add_routes(app)

        async def close(_app: web.Application) -> None:
            # Until then, the requests still queued in a retiring application hear of
            # replicas becoming ready (its admission's subscription to the router).
            await gateway.close()

        app.on_cleanup.append(close)
        return app

    async def _serve_http(self, app: web.Application, leader: Leader | None) -> None:
        """:8080: the bundles, the leader's admin API and console, on the kept socket
        (PostgreSQL) or a listener of its own; then ``STATE/ctl.yaml`` naming it, whichever
        the role (a standby's admin API forwards to the leader)."""
        await self._listen_http(app, leader)
        write_ctl_yaml(self.cfg, self.http_addr, self.http_tls)

    async def _listen_http(self, app: web.Application, leader: Leader | None) -> None:
        cfg = self.cfg
        assert self.server_identity is not None and self.ca is not None
        self.http_tls = serving_certificate(cfg.tls, self.server_identity)
        serve_bundles(app, self.bundles)
        if leader is not None:
            admin = AdminContext(
                store=self.store,
                scheduler=leader.scheduler,
                planner=leader.planner,
                router=self.router,
                membership=leader.membership,
                updates=leader.updates,
                password=leader.password,
                operators=leader.operators,
                logins=leader.logins,
                installs=leader.installs,
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
                pending_usage=self.usage.pending,
                history=self.history,
            )
            add_admin_routes(app, admin, leader.authority)
            add_console_routes(app, admin, cleartext=cfg.cleartext_exposed)
        ssl_context = self.http_tls.context if self.http_tls else None
        if self.handover is not None:
            await self.handover.serve(app, ssl_context)
            self.http_port = self.handover.port
            return
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await self._runner.setup()
        site = GuardedSite(
            self._runner,
            *parse_hostport(cfg.http_listen, allow_zero=True),
            label="http",
            limits=cfg.listeners,
            backlog=2048,
            hint="listeners.header_timeout in server.yaml",
            ssl_context=ssl_context,
            sock=self.http_sock,
        )
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ConfigError(
                f"cannot listen on {cfg.http_listen}: {exc.strerror}; free the port or change "
                "http_listen",
                key="http_listen",
            ) from exc
        self.http_port = site.bound_port

    # -- what the parts are given that only this object knows ----------------------------------

    def _control_planes(self) -> ControlPlaneList:
        """What agents are told of the control planes (llmgw.server.ha.instances)."""
        own = self.stream_addresses()
        return (
            self.instances.control_planes(own) if self.instances else ControlPlaneList(tuple(own))
        )

    def _record_addresses(self) -> None:
        """On PostgreSQL: where agents, clients and the other instances reach this instance
        (llmgw.server.ha.instances)."""
        if self.instances is None:
            return
        stream = self.stream_addresses()[0]
        host, _ = parse_hostport(stream, allow_zero=True)
        self.instances.record_addresses(
            stream=stream,
            http=f"{self.cfg.http_scheme}://{format_hostport(host, self.http_port)}",
            enroll=format_hostport(host, self.enroll_port) if self.enroll_port else "",
            server=self.server_identity,
            client=self.client_identity,
            leading=self.roles.role is Role.LEADER,
        )

    def _count_ready(self) -> None:
        """The ready-replicas gauge, after the routable replicas changed."""
        for model in self.serving.models:
            self.metrics.ready_replicas.set((model,), len(self.router.endpoints(model)))
        # By state, sleeping ones included (one GROUP BY: it runs at each route change).
        with contextlib.suppress(StoreError):
            self.metrics.set_replica_states(self.store.count_replicas_by_state())

    def _download_base(self) -> str:
        """Where nodes download bundles: the HTTP listener, at the host they dial for the
        stream."""
        host, _ = parse_hostport(self.stream_addresses()[0], allow_zero=True)
        return f"{self.cfg.http_scheme}://{format_hostport(host, self.http_port)}"

    def _on_ca_reissued(self) -> None:
        """A CA rotation (or the drop of the old CA) reissued this control plane's
        certificates: the listeners whose files changed load them on their next handshake
        by themselves (the stream, enrolment, :8080); the gateway's context to the data
        planes and the CA enrolment hands out are refreshed here."""
        renewed = self.data_plane_tls.renewed()
        if renewed is not None:
            # The pool's open connections (verified under the old trust) are closed as soon
            # as they are free.
            self.gateway.retrust(renewed)
        if self.leader is not None:
            self.leader.reissued()
        if self.http_tls is not None:
            self.http_tls.reload_if_changed()
        self._record_addresses()  # the new certificates' serials
