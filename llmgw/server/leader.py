"""The leader's own parts (what only the leading control plane runs): the admin password and
operator accounts, the scheduler, the membership, the agents' sessions and their reports,
the engine installs, the updates, the CA rotation, the Connect stream and enrolment.

:class:`Leader` builds them in dependency order, each with the collaborators and the
settings it uses (none of them sees the control plane), starts their listeners and loops,
and stops them when the role ends. What either role serves (the store, the gateway, the
router) stays with :class:`llmgw.server.app.ControlPlane`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

import grpc

from llmgw.contracts.control_planes import ControlPlaneList
from llmgw.errors import ConfigError, StoreError
from llmgw.log import kv
from llmgw.netaddr import parse_hostport
from llmgw.pki import Authority, Identity, cert_pem
from llmgw.server.accounts.lockout import Lockout
from llmgw.server.accounts.logins import Logins
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import PASSWORD_FILE, AdminPassword
from llmgw.server.common.config import ServerConfig
from llmgw.server.common.metrics import Metrics
from llmgw.server.common.tls import ServingCertificate
from llmgw.server.fleet.authority import ClusterAuthority
from llmgw.server.fleet.dozing import Dozing
from llmgw.server.fleet.installs import EngineInstalls
from llmgw.server.fleet.nodes import Membership
from llmgw.server.fleet.planner import Planner
from llmgw.server.fleet.preemption import Preemption
from llmgw.server.fleet.reports import AgentReports, agent_messages
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.sessions import Sessions
from llmgw.server.fleet.stream import (
    ControlPlaneService,
    NodeSession,
    UpdateHandler,
    start_stream_server,
)
from llmgw.server.fleet.updates import Updates
from llmgw.server.fleet.warming import Warming
from llmgw.server.gateway.capacity import Capacity, fleet_demand
from llmgw.server.gateway.routing import Router
from llmgw.server.joining.bundles import Bundle
from llmgw.server.joining.enroll import Enroller, EnrolmentServer
from llmgw.server.store import Store

__all__ = ["Leader", "LeaderHooks"]

log = logging.getLogger("llmgw.server")

# Seconds between two clean-ups of lapsed login sessions and spent failure counters.
LOGIN_PRUNE_EVERY = 600.0


@dataclasses.dataclass(frozen=True)
class LeaderHooks:
    """What the leader's parts are told or ask of the process around them."""

    # The ready-replicas gauge, after the routable replicas changed.
    count_ready: Callable[[], None]
    # The gateway's pool forgets a node's data plane (a revocation).
    forget_node: Callable[[str], None]
    # Every name in this control plane's certificates (no node may take one).
    control_plane_names: Callable[[], frozenset[str]]
    # What agents are told of the control planes.
    control_planes: Callable[[], ControlPlaneList]
    # The bundles :8080 serves, and where nodes download them.
    served: Callable[[], Awaitable[list[Bundle]]]
    download_base: Callable[[], str]
    # A CA rotation reissued this control plane's certificates.
    on_reissued: Callable[[], None]
    # The gateway's requests waiting for a replica to exist, and its demand: what the
    # planner scales by; the scheduler tells it when a model cannot be placed.
    capacity: Capacity


class Leader:
    """The leader's parts, built in dependency order."""

    # The listeners, once started (:meth:`start`).
    grpc_port = 0
    enroll_port = 0
    _grpc: grpc.aio.Server | None = None
    _enrolment: EnrolmentServer | None = None
    _enroller: Enroller | None = None
    _enroll_tls: ServingCertificate | None = None

    def __init__(
        self,
        cfg: ServerConfig,
        store: Store,
        router: Router,
        metrics: Metrics,
        *,
        ca: Authority,
        hosts: list[str],
        epoch: int,
        live: dict[str, NodeSession],
        lost: set[str],
        hooks: LeaderHooks,
    ) -> None:
        self.cfg, self.store, self.ca, self.epoch, self.hooks = cfg, store, ca, epoch, hooks
        self.password, self.operators, self.logins = _accounts(store, cfg)
        self.installs = EngineInstalls(store, sessions=live, epoch=epoch)
        self.scheduler = Scheduler(
            store,
            router,
            sessions=live,
            lost=lost,
            on_routes_changed=hooks.count_ready,
            engine_holds=self.installs.holds,
            on_unplaceable=lambda model: self.planner.no_room(model),
            gpu_counts=metrics.set_gpus,
            metrics=metrics,
        )
        self.planner = self._planner(cfg.instance, router, metrics, hooks.capacity)
        self._unsubscribe_planner = hooks.capacity.on_waiting(self._capacity_wanted)
        self.membership = Membership(
            store,
            self.scheduler,
            router,
            sessions=live,
            ca=ca,
            cert_lifetime=cfg.cert_lifetime,
            forget_node=hooks.forget_node,
            control_plane_names=hooks.control_plane_names,
        )
        self.membership.load()
        # Which sources each node keeps in its page cache (models with prefetch: true).
        self.warming = Warming(
            store, views=self.scheduler.node_views, profile=self.scheduler.placement_profile
        )
        reports = AgentReports(
            store,
            router,
            self.scheduler,
            installs=self.installs,
            renew=self.membership.renew,
            on_routes_changed=hooks.count_ready,
            metrics=metrics,
            warm=self.warming.for_node,
        )
        self.sessions = Sessions(
            store,
            router,
            metrics,
            live=live,
            lost=lost,
            membership=self.membership,
            scheduler=self.scheduler,
            reports=reports,
            epoch=epoch,
            loss_timeout=cfg.loss_timeout,
            on_routes_changed=hooks.count_ready,
        )
        self.updates = Updates(
            store,
            accounts=self.operators,
            ca=ca,
            epoch=epoch,
            sessions=live,
            served=hooks.served,
            download_base=hooks.download_base,
            bundle_dir=cfg.bundle_dir,
        )
        # The agents' messages after their Hello, by kind (KV cache events: the prefix index).
        self.messages = agent_messages(reports, kv_events=router.kv_events, updates=self.updates)
        self.authority = ClusterAuthority(
            cfg.state_dir / "pki",
            ca,
            store,
            sessions=live,
            hosts=hosts,
            on_reissued=hooks.on_reissued,
        )
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, identity: Identity, cluster_id: str) -> None:
        """The Connect stream and enrolment, listening."""
        cfg = self.cfg
        service = ControlPlaneService(
            self.store,
            self.sessions,
            _OnConnect(self.updates, self.authority),
            messages=self.messages,
            cluster_id=cluster_id,
            epoch=self.epoch,
            heartbeat_interval=cfg.heartbeat_interval,
            cert_lifetime=cfg.cert_lifetime,
            control_planes=self.hooks.control_planes,
        )
        self._grpc, self.grpc_port = await start_stream_server(
            identity,
            cfg.grpc_listen,
            service,
            handshake_timeout=cfg.listeners.handshake_timeout,
        )
        enroller = self._enroller = Enroller(
            self.store,
            self.ca,
            lifetime=cfg.cert_lifetime,
            servers=lambda: list(self.hooks.control_planes().servers),
            on_enrolled=self.membership.enrolled,
            control_plane_names=self.hooks.control_plane_names,
        )
        self._enrolment = EnrolmentServer(enroller)
        # Reloaded when the files change: a CA rotation reissues the server certificate.
        self._enroll_tls = ServingCertificate(identity.cert, identity.key, what="enroll")
        limits = dataclasses.replace(cfg.listeners, per_source=cfg.enroll_connections_per_source)
        try:
            self.enroll_port = await self._enrolment.start(
                *parse_hostport(cfg.enroll_listen, allow_zero=True),
                self._enroll_tls.context,
                limits=limits,
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {cfg.enroll_listen}: {exc.strerror}; free the port or "
                "change enroll_listen",
                key="enroll_listen",
            ) from exc

    def run(self, *, grace: float) -> None:
        """The reconcile loops, from now on; the nodes with shards that do not come back
        within *grace* seconds are lost."""
        for node_id in sorted({s.node_id for s in self.store.list_shards()}):
            if node_id not in self.sessions.live:
                self.sessions.start_loss_timer(node_id, grace)
        for name, loop in (
            ("scheduler", self.scheduler.run()),
            ("planner", self.planner.run()),
            ("warming", self.warming.run()),
            ("engine-installs", self.installs.run()),
            ("heartbeats", self.sessions.watch_heartbeats()),
            ("last-seen", self.sessions.store_last_seen()),
            ("ca-rotation", self.authority.run()),
            ("prune-logins", prune_logins(self.logins)),
        ):
            self._tasks.append(asyncio.create_task(loop, name=name))

    def reissued(self) -> None:
        """The CA enrolment hands out, and enrolment's certificate, after a CA rotation."""
        if self._enroller is not None:
            self._enroller.ca_pem = cert_pem(self.ca.cert).decode("ascii")
        if self._enroll_tls is not None:
            self._enroll_tls.reload_if_changed()

    def _planner(
        self, instance: str, router: Router, metrics: Metrics, capacity: Capacity
    ) -> Planner:
        """Serving by demand: the planner, with every instance's demand and the room a
        lower priority gives."""
        store = self.store
        return Planner(
            store,
            demand=lambda: fleet_demand(capacity.demand(), store, instance),
            kick_scheduler=self.scheduler.kick,
            metrics=metrics,
            why_unplaceable=self._why_unplaceable,
            preemption=Preemption(self.scheduler),
            dozing=Dozing(self.scheduler),
            capacity=capacity,
            ready=lambda model: len(router.endpoints(model)),
        )

    def _capacity_wanted(self, model: str) -> None:
        """A request waits for a replica of ``model`` to exist: the planner gives a model at
        zero one, the scheduler tries what is missing (and says at once if it has no room)."""
        self.planner.kick(model)
        self.scheduler.kick()

    def _why_unplaceable(self, model: str) -> str | None:
        unplaceable = self.scheduler.unplaceable.get(model)
        return unplaceable.reason if unplaceable is not None else None

    async def stop(self) -> None:
        """Stop the loops, the streams and the listeners (the store stays open)."""
        self._unsubscribe_planner()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.sessions.close_all()
        if self._grpc is not None:
            grpc_server, self._grpc = self._grpc, None
            await grpc_server.stop(grace=2.0)
        if self._enrolment is not None:
            await self._enrolment.stop()
            self._enrolment = None


def _accounts(store: Store, cfg: ServerConfig) -> tuple[AdminPassword, OperatorAccounts, Logins]:
    """The admin password, the operator accounts and their logins."""
    # Its checks count in the logins' lockout, under server.yaml's limits.
    password = AdminPassword(
        store, cfg.admin_token_file.parent / PASSWORD_FILE, lockout=Lockout(store, cfg.console)
    )
    password.start()
    # The first operator account is the admin password (new stores and upgraded ones).
    operators = OperatorAccounts(store, password)
    operators.ensure_first_admin()
    return password, operators, Logins(store, operators, cfg.console)


async def prune_logins(logins: Logins) -> None:
    """Delete lapsed login sessions and spent failure counters every few minutes (a lapsed
    session is refused without it: this only keeps the tables small)."""
    while True:
        await asyncio.sleep(LOGIN_PRUNE_EVERY)
        try:
            logins.prune()
        except StoreError as exc:
            log.warning("login prune failed; trying again later", extra=kv(error=str(exc)))


class _OnConnect:
    """What the stream tells on a node's (re)connection: first its trust bundle (the CA
    rotation's), then the update order waiting for it."""

    def __init__(self, updates: UpdateHandler, authority: ClusterAuthority) -> None:
        self.updates = updates
        self.authority = authority

    def on_connect(self, session: NodeSession) -> None:
        self.authority.on_connect(session)
        self.updates.on_connect(session)
