"""The life cycle of agent sessions: a stream opens (the node admitted, its Hello reconciled
with the store), it closes; a node away for the loss timeout is lost and its replicas are
rebuilt elsewhere; streams whose heartbeats stopped are cut. The messages in between go to
their handlers through one table (:func:`llmgw.server.fleet.reports.agent_messages`).

The table of live sessions and the set of lost nodes are owned here; the scheduler, the
membership and the update orders are given them to read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from cryptography import x509

from llmgw.contracts.control_planes import ControlPlaneList
from llmgw.contracts.inventory import inventory_dict
from llmgw.errors import LlmgwError, NotFound
from llmgw.log import kv
from llmgw.pki import serial_hex
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.gpuhealth import note_gpu_health
from llmgw.server.fleet.intake import pending_inventory
from llmgw.server.fleet.nodes import Membership
from llmgw.server.fleet.reports import AgentReports, record_health
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import NodeSession, checked_control_planes
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Store
from llmgw.server.store.states import NodeState, ShardState

__all__ = ["Sessions"]

log = logging.getLogger("llmgw.server.sessions")

LAST_SEEN_EVERY = 30.0
"""Seconds between two flushes of the nodes' last-seen times to the store. The leader's
admin API shows the live time; the stored one is for a restarted control plane and the
standbys. Each flush rewrites every live node's row: on PostgreSQL a row version each, which
autovacuum must reclaim, so not more often than this."""
LAST_SEEN_SLICE = 50  # nodes per transaction of a flush: a few ms each, even on PostgreSQL

# Seconds: the longest a silent stream outlives the loss timeout before it is cut (one pass
# over the live sessions at most this often), and how far past a deadline a check lands.
HEARTBEAT_CHECK_MAX = 1.0
HEARTBEAT_CHECK_SLACK = 0.01


class Sessions:
    """The live streams, one :class:`NodeSession` per connected agent (the
    :class:`~llmgw.server.fleet.stream.SessionHandler` of the Connect stream)."""

    def __init__(
        self,
        store: Store,
        router: Router,
        metrics: Metrics,
        *,
        live: dict[str, NodeSession],
        lost: set[str],
        membership: Membership,
        scheduler: Scheduler,
        reports: AgentReports,
        epoch: int,
        loss_timeout: float,
        on_routes_changed: Callable[[], None],
    ) -> None:
        self.store = store
        self.router = router
        self.metrics = metrics
        # node id -> its live session, and the nodes lost (both read by others).
        self.live = live
        self.lost = lost
        self.membership = membership
        self.scheduler = scheduler
        self.reports = reports
        self.epoch = epoch
        self.loss_timeout = loss_timeout
        self.on_routes_changed = on_routes_changed
        self._loss_timers: dict[str, asyncio.TimerHandle] = {}
        # Set by close_all: the control plane is shutting down (or stepping down).
        self.stopping = False
        # node id -> the seen_at last stored for it (Sessions.flush_last_seen).
        self._stored_seen: dict[str, float] = {}

    # -- a stream opens --------------------------------------------------------------------------

    def refusal(self, node_id: str, cert: x509.Certificate | None) -> str | None:
        """Why a stream with this certificate must be refused, or None."""
        return self.membership.refusal(node_id, cert)

    def node_state(self, node_id: str) -> str:
        try:
            return self.store.get_node(node_id).state
        except NotFound:
            return NodeState.PENDING

    def open(self, hello: pb.Hello, peer: str, cert: x509.Certificate) -> NodeSession:
        node_id = hello.node_id
        self.membership.admit(node_id, cert)
        # Until an operator approves it, a node's inventory is kept in memory and only a
        # bounded summary of it stored: enough to judge the node by.
        approved = self.node_state(node_id) == NodeState.APPROVED
        inventory = inventory_dict(
            hello.inventory if approved else pending_inventory(hello.inventory)
        )
        before = self.store.get_node(node_id).inventory if approved else {}
        if approved:
            note_gpu_health(self.store, node_id, before, inventory)
            self.scheduler.gpus.note(node_id, inventory)
        stored = self.store.upsert_node(
            node_id,
            dataplane_addr=hello.dataplane_addr,
            agent_version=hello.agent_version,
            inventory=inventory,
            connected=True,
        )
        if approved:  # a node fixed (or broken) while it was away says so in the events
            record_health(self.store, node_id, before, inventory)
        timer = self._loss_timers.pop(node_id, None)
        if timer is not None:
            timer.cancel()
        if node_id in self.lost:
            self.lost.discard(node_id)
            self.store.set_node_lost(node_id, False)
            self.store.add_event("node_back", node_id, "reconnected after being lost")
        old = self.live.get(node_id)
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
        # Heard from now, and stored as such by the upsert: the next flush skips it.
        session.seen_at = stored.last_seen or self.store.database.clock()
        self._stored_seen[node_id] = session.seen_at
        self.live[node_id] = session
        self.store.add_event(
            "node_connected", node_id, f"from {peer}, data plane {hello.dataplane_addr}"
        )
        log.info(
            "node connected",
            extra=kv(
                node=node_id, peer=peer, dataplane=hello.dataplane_addr, version=hello.agent_version
            ),
        )
        self.count_nodes()
        return session

    def after_hello(self, session: NodeSession, hello: pb.Hello) -> None:
        """Reconcile what the node says it runs with what the store says it should."""
        known = {s.id: s for s in self.store.list_shards(node_id=session.node_id)}
        reported = {s.shard_id: s for s in hello.shards}
        retirements = self.scheduler.retirements
        for shard_id, status in reported.items():
            if shard_id in known and known[shard_id].state == ShardState.STOPPING:
                if status.state in (pb.SHARD_EXITED, pb.SHARD_FAILED):
                    retirements.shard_ended(known[shard_id])
                else:  # retired while the agent was away: the order again
                    retirements.order_stop(known[shard_id])
            elif shard_id in known:
                self.reports.apply_status(session, status)
            elif status.state in (pb.SHARD_STARTING, pb.SHARD_READY, pb.SHARD_FAILED):
                log.info(
                    "stopping a shard no replica owns",
                    extra=kv(node=session.node_id, shard=shard_id),
                )
                session.stop_shard(shard_id)
        for shard_id, shard in known.items():
            if shard_id not in reported and shard.state == ShardState.STOPPING:
                retirements.shard_ended(shard)  # retired, and gone meanwhile
            elif shard_id not in reported and shard.state in (
                ShardState.STARTING,
                ShardState.READY,
                ShardState.PENDING,
            ):
                # The node no longer runs it (an agent restart): start it again.
                self.store.update_shard(
                    shard_id,
                    state=ShardState.PENDING,
                    reason="not running on the node after reconnect",
                )
        self.scheduler.kick()

    def broadcast_control_planes(self, planes: ControlPlaneList) -> int:
        """Tell every live agent the changed list of control-plane instances (an instance
        added or retired) and the retired ones' certificate serials; the number of agents
        told. A list agents would refuse (or an empty one) goes to none, with one warning."""
        checked = checked_control_planes(planes)
        if checked is None:
            return 0
        told = sum(
            1 for session in list(self.live.values()) if session.send_control_planes(checked)
        )
        log.info(
            "told the agents the control planes",
            extra=kv(
                servers=",".join(checked.servers),
                retired_serials=len(checked.retired_serials),
                agents=told,
            ),
        )
        return told

    # -- a stream closes -------------------------------------------------------------------------

    def close(self, session: NodeSession) -> None:
        if self.live.get(session.node_id) is not session:
            return
        del self.live[session.node_id]
        self._stored_seen.pop(session.node_id, None)
        if self.stopping:
            # close_all stored the fleet's disconnect in one batch; no node is lost for a
            # control plane's shutdown, however long it takes.
            self.router.remove_node(session.node_id)
            return
        database_away = getattr(self.store.database, "unreachable_since", None) is not None
        if not database_away:
            self.router.remove_node(session.node_id)
        # While the database is away the node's routes stay: its data plane serves without
        # a stream (a request it does not take goes to another replica), and the stream
        # cannot come back before the database does.
        try:
            self.store.touch_nodes({session.node_id: session.seen_at})
            self.store.set_node_connected(session.node_id, False)
            self.store.add_event("node_disconnected", session.node_id, "stream closed")
        except LlmgwError as exc:
            log.warning(
                "cannot record a disconnect", extra=kv(node=session.node_id, error=str(exc))
            )
        log.info("node disconnected", extra=kv(node=session.node_id))
        # Silent for the loss timeout already: lost now. A closed stream gets the timeout.
        self.start_loss_timer(session.node_id, 0.0 if session.silent else None)
        try:
            self.count_nodes()
        except LlmgwError:
            pass  # the gauge catches up at the next change
        self.on_routes_changed()

    def close_all(self) -> None:
        """At shutdown: no node is lost for it, every stream is ended. The disconnect of the
        whole fleet is stored at once (one write for thousands of streams, not several each:
        a shutdown that took longer than the loss timeout used to lose nodes)."""
        self.stopping = True
        for timer in self._loss_timers.values():
            timer.cancel()
        self._loss_timers.clear()
        closing = list(self.live.values())
        try:
            self.flush_last_seen()
            self.store.set_all_disconnected()
            if closing:
                self.store.add_event(
                    "streams_closed",
                    "control-plane",
                    f"the control plane is stopping; {len(closing)} agent streams closed "
                    "(the agents reattach to the next leader)",
                )
        except LlmgwError as exc:  # the database is away, or another instance leads now
            log.warning("cannot record the streams' close", extra=kv(error=str(exc)))
        for session in closing:
            session.close()

    # -- loss: a node away for the loss timeout loses its replicas to other nodes ----------------

    def start_loss_timer(self, node_id: str, delay: float | None = None) -> None:
        old = self._loss_timers.pop(node_id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        wait = self.loss_timeout if delay is None else delay
        self._loss_timers[node_id] = loop.call_later(wait, self._node_lost, node_id)

    def _node_lost(self, node_id: str) -> None:
        self._loss_timers.pop(node_id, None)
        if node_id in self.live or node_id in self.lost or self.stopping:
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
            extra=kv(node=node_id, replicas=len(replicas), after=f"{self.loss_timeout:g}s"),
        )
        self.store.add_event(
            "node_lost",
            node_id,
            f"no stream for {self.loss_timeout:g}s; {len(replicas)} replicas rebuilt elsewhere",
        )
        for replica_id in replicas:
            # No stop order can reach it; when it comes back, its Hello lists shards that
            # belong to no replica and it is told to stop them.
            self.scheduler.remove_replica(replica_id, why=f"node {node_id} lost")
        self.scheduler.kick()

    def count_nodes(self) -> None:
        # Counted, not listed: it runs at every connect and disconnect of a whole fleet.
        total = self.store.count_nodes()
        connected = len(self.live)
        self.metrics.nodes.set(("connected",), connected)
        self.metrics.nodes.set(("disconnected",), max(total - connected, 0))

    def flush_last_seen(self, limit: int | None = None) -> int:
        """Store when each live node was last heard from, for those heard since the last
        flush (at most ``limit`` of them), in one transaction; how many were stored. What the
        admin API shows is read from the sessions; the store's copy is for standbys and a
        restarted control plane."""
        seen: dict[str, float] = {}
        for node_id, session in list(self.live.items()):
            if session.seen_at > self._stored_seen.get(node_id, 0.0):
                seen[node_id] = session.seen_at
                if limit is not None and len(seen) >= limit:
                    break
        if not seen:
            return 0
        self.store.touch_nodes(seen)
        self._stored_seen.update(seen)  # a node's entry goes when its session closes
        return len(seen)

    async def store_last_seen(self) -> None:
        """Flush last-seen times every :data:`LAST_SEEN_EVERY` seconds."""
        while True:
            await asyncio.sleep(LAST_SEEN_EVERY)
            try:
                # In slices, the loop free between them: a fleet's batch in one transaction
                # held the gateway's requests for as long as it took.
                for _ in range(len(self.live) // LAST_SEEN_SLICE + 1):
                    if self.flush_last_seen(limit=LAST_SEEN_SLICE) < LAST_SEEN_SLICE:
                        break
                    await asyncio.sleep(0)
            except LlmgwError as exc:  # the database is away: the next flush catches up
                log.warning("cannot store when nodes were last seen", extra=kv(error=str(exc)))

    async def watch_heartbeats(self) -> None:
        """Cut streams whose heartbeats stopped (gRPC keepalive catches most, not a hung agent)."""
        while True:
            due_in = self.check_heartbeats(time.monotonic())
            await asyncio.sleep(due_in)

    def check_heartbeats(self, now: float) -> float:
        """Cut the streams silent for more than the loss timeout at ``now`` (their nodes are
        lost at once) and those to reconnect now that the database answers; the seconds
        until the next check is due.

        That is when the next stream would pass its timeout if it stayed silent, and at most
        :data:`HEARTBEAT_CHECK_MAX` away: a hung node is cut within a second of its timeout,
        not up to a heartbeat interval later, by one pass over the sessions a second."""
        database_away = getattr(self.store.database, "unreachable_since", None) is not None
        due = now + HEARTBEAT_CHECK_MAX
        for session in list(self.live.values()):
            if session.silent:
                continue  # cut already; its stream is ending
            deadline = session.last_heartbeat + self.loss_timeout
            if now > deadline:
                log.warning("node stopped sending heartbeats", extra=kv(node=session.node_id))
                session.silent = True
                session.close()
                continue
            due = min(due, deadline)
            if session.unstored and not database_away:
                # What it reported while the database was away is lost: its next Hello
                # (the shards it runs, in full) tells it again. Its engines run on.
                log.warning(
                    "the database answers again; reconnecting a node to hear again what "
                    "it reported meanwhile",
                    extra=kv(node=session.node_id, reports=session.unstored),
                )
                session.unstored = 0
                session.close()
        # Past the deadline, not on it (the check is "more than"); never a busy loop.
        return max(due - now, 0.0) + HEARTBEAT_CHECK_SLACK
