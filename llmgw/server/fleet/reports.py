"""What agents report on their streams, applied to the store and the router: shard status,
op results, inventory, draining and certificate requests.

A shard that turns ready on rank 0 becomes routable; one that fails or exits unordered is
failed (the scheduler restarts it); one falling asleep, asleep or waking is out of routing
until ready again (llmgw.server.fleet.sleeps). Inventory from a pending node is held, not stored,
until an operator approves it (llmgw.server.fleet.nodes).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from llmgw.contracts.inventory import inventory_dict
from llmgw.errors import NotFound
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.gpuhealth import VANISHED, gpu_key, note_gpu_health
from llmgw.server.fleet.installs import EngineInstalls
from llmgw.server.fleet.intake import heartbeat_utilization
from llmgw.server.fleet.meeting import transfer_addr
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import MessageHandler, NodeSession
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.store import Replica, Shard, Store
from llmgw.server.store.states import ReplicaState, ShardState, health_change

__all__ = [
    "AgentReports",
    "UpdateStatus",
    "agent_messages",
    "inventory_changes",
    "record_health",
    "store_inventory",
    "warm_bytes",
    "warm_changes",
]

log = logging.getLogger("llmgw.server.reports")

_PB_STATE = {
    pb.SHARD_STARTING: ShardState.STARTING,
    pb.SHARD_READY: ShardState.READY,
    pb.SHARD_FAILED: ShardState.FAILED,
    pb.SHARD_EXITED: ShardState.EXITED,
    pb.SHARD_FALLING_ASLEEP: ShardState.FALLING_ASLEEP,
    pb.SHARD_ASLEEP: ShardState.ASLEEP,
    pb.SHARD_WAKING: ShardState.WAKING,
}


def _inventory_summary(inv: pb.Inventory) -> str:
    gpus = f"{len(inv.gpus)} GPUs" if inv.gpus else f"no GPUs ({inv.gpu_status})"
    text = f"{gpus}; engines {', '.join(inv.engines) or 'none'}"
    if inv.warnings:
        text += "; " + "; ".join(inv.warnings)
    return text


def _gib(n: Any) -> str:
    return f"{int(n or 0) / 2**30:.1f} GiB"


def _listed(label: str, before: Any, after: Any) -> list[str]:
    """``label: +x -y`` for what a list gained and lost, or nothing."""
    old, new = list(before or []), list(after or [])
    gained = [x for x in new if x not in old]
    lost = [x for x in old if x not in new]
    if not gained and not lost:
        return []
    return [f"{label}: " + " ".join([*(f"+{x}" for x in gained), *(f"-{x}" for x in lost)])]


def _gpu_changes(before: Any, after: Any) -> list[str]:
    # A vanished GPU is kept in the stored inventory (unhealthy): here it is lost.
    old = {gpu_key(g): g for g in before or [] if g.get("health") != VANISHED}
    new = {gpu_key(g): g for g in after or [] if g.get("health") != VANISHED}
    changes = []
    for key, gpu in new.items():
        was = old.get(key)
        if was is None:
            changes.append(f"GPU {gpu.get('index')} found ({gpu.get('name')})")
        elif (was.get("name"), was.get("memory_total_mib")) != (
            gpu.get("name"),
            gpu.get("memory_total_mib"),
        ):
            changes.append(
                f"GPU {gpu.get('index')}: {was.get('name')} {was.get('memory_total_mib')} MiB "
                f"-> {gpu.get('name')} {gpu.get('memory_total_mib')} MiB"
            )
    changes.extend(f"GPU {gpu.get('index')} lost" for key, gpu in old.items() if key not in new)
    return changes


def _engine_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    def versions(inv: Mapping[str, Any]) -> dict[str, str]:
        found = {str(name): "" for name in inv.get("engines") or []}
        for detail in inv.get("engine_details") or []:
            if detail.get("name") in found:
                found[detail["name"]] = str(detail.get("version") or "")
        return found

    old, new = versions(before), versions(after)
    parts = [f"+{name} {new[name]}".rstrip() for name in new if name not in old]
    parts += [f"-{name}" for name in old if name not in new]
    parts += [
        f"{name} {old[name] or '?'} -> {new[name] or '?'}"
        for name in new
        if name in old and old[name] != new[name]
    ]
    return ["engines: " + ", ".join(parts)] if parts else []


def _port_states(inv: Mapping[str, Any]) -> dict[str, str]:
    return {
        f"{a.get('name')} port {p.get('port')}": str(p.get("state"))
        for a in inv.get("ib_adapters") or []
        for p in a.get("ports") or []
    }


def inventory_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """What an operator would want told about a node's new inventory: GPUs found, lost or
    changed, engines added, removed or upgraded, the driver, the fabric ports' states, model
    sources, warnings. Volatile figures (free disk and memory, GPU memory in use) are none
    of it: they change with every report and would flood the events."""
    changes: list[str] = []
    for key, label in (("hostname", "host name"), ("arch", "architecture"), ("cpus", "CPUs")):
        if before.get(key) != after.get(key):
            changes.append(f"{label}: {before.get(key)} -> {after.get(key)}")
    for key, label in (("memory_total_bytes", "memory"), ("disk_total_bytes", "disk")):
        if before.get(key) != after.get(key):
            changes.append(f"{label}: {_gib(before.get(key))} -> {_gib(after.get(key))}")
    changes.extend(_gpu_changes(before.get("gpus"), after.get("gpus")))
    for key, label in (("gpu_status", "GPU status"), ("driver_version", "driver")):
        if (before.get(key) or "") != (after.get(key) or ""):
            changes.append(f"{label}: {before.get(key) or '-'} -> {after.get(key) or '-'}")
    changes.extend(_engine_changes(before, after))
    old_ports, new_ports = _port_states(before), _port_states(after)
    changes.extend(
        f"{port}: {old_ports.get(port, 'absent')} -> {new_ports.get(port, 'absent')}"
        for port in sorted(set(old_ports) | set(new_ports))
        if old_ports.get(port) != new_ports.get(port)
    )
    changes.extend(
        _listed(
            "fabrics",
            [
                f"{f.get('name')}{'' if f.get('healthy') else ' (unhealthy)'}"
                for f in before.get("fabrics") or []
            ],
            [
                f"{f.get('name')}{'' if f.get('healthy') else ' (unhealthy)'}"
                for f in after.get("fabrics") or []
            ],
        )
    )
    changes.extend(
        _listed(
            "model sources",
            [e.get("name") for e in (before.get("sources") or {}).get("entries") or []],
            [e.get("name") for e in (after.get("sources") or {}).get("entries") or []],
        )
    )
    changes.extend(_listed("warnings", before.get("warnings"), after.get("warnings")))
    if (before.get("multinode_ports") or "") != (after.get("multinode_ports") or ""):
        changes.append(
            f"multi-node ports: {before.get('multinode_ports') or 'default'} -> "
            f"{after.get('multinode_ports') or 'default'}"
        )
    return changes


def store_inventory(store: Store, session: NodeSession, inv: pb.Inventory) -> dict[str, Any]:
    """Record an approved node's inventory (the caller lets the scheduler look at it); the
    inventory as stored (with the GPUs that vanished: llmgw.server.fleet.gpuhealth)."""
    session.engines = frozenset(inv.engines)
    node = store.get_node(session.node_id)
    stored = inventory_dict(inv)
    note_gpu_health(store, session.node_id, node.inventory, stored)
    store.upsert_node(
        session.node_id,
        dataplane_addr=session.dataplane_addr,
        agent_version=node.agent_version,
        inventory=stored,
        connected=True,
    )
    if not node.inventory:
        store.add_event("inventory_changed", session.node_id, _inventory_summary(inv))
    else:
        changes = inventory_changes(node.inventory, stored)
        if changes:
            store.add_event("inventory_changed", session.node_id, "; ".join(changes))
    for kind, message in warm_changes(node.inventory, stored):
        store.add_event(kind, session.node_id, message)
    record_health(store, session.node_id, node.inventory, stored)
    return stored


def warm_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The events of a node's prefetch (llmgw.agent.warming): ``source_warm`` for a source
    newly warm in its page cache, ``source_skipped`` for one newly skipped, with why. Only a
    change of state is one: the stored inventory is the previous report's (a reconnect, or a
    new leader, tells nothing again), and a warm source read again is not news."""
    old = {str(w.get("source")): w.get("state") for w in before.get("warm") or []}
    events = []
    for entry in after.get("warm") or []:
        source, state = str(entry.get("source")), entry.get("state")
        if state == old.get(source):
            continue
        if state == "warm":
            text = f"{source} warm in the page cache: {_gib(entry.get('bytes'))}"
            if entry.get("pass_seconds"):
                text += f", read in {float(entry['pass_seconds']):.1f} s"
            events.append(("source_warm", text))
        elif state == "skipped":
            events.append(("source_skipped", f"{source} not kept warm: {entry.get('reason')}"))
    return events


def warm_bytes(inventory: Mapping[str, Any]) -> int:
    """The bytes of the sources a node reports warm in its page cache."""
    return sum(
        int(w.get("bytes") or 0) for w in inventory.get("warm") or [] if w.get("state") == "warm"
    )


def record_health(
    store: Store, node_id: str, before: Mapping[str, Any], after: Mapping[str, Any]
) -> None:
    """An event (and a log line) when an approved node's stored inventory changes its
    degraded reasons: ``node_degraded`` with them, ``node_healthy`` when they are gone."""
    change = health_change(before, after)
    if change is None:
        return
    kind, message = change
    store.add_event(kind, node_id, message)
    degraded = kind == "node_degraded"
    log.log(
        logging.WARNING if degraded else logging.INFO,
        "node degraded" if degraded else "node no longer degraded",
        extra=kv(node=node_id, reasons=message),
    )


class AgentReports:
    """Applies the messages of an agent's stream, after its Hello, to the fleet's state."""

    def __init__(
        self,
        store: Store,
        router: Router,
        scheduler: Scheduler,
        *,
        installs: EngineInstalls,
        renew: Callable[[NodeSession, str], None],
        on_routes_changed: Callable[[], None],
        metrics: Metrics | None = None,
        warm: Callable[[str], pb.WarmSources | None] = lambda node_id: None,
    ) -> None:
        self.store = store
        # The sources a node keeps warm, for its acks (llmgw.server.fleet.warming).
        self.warm = warm
        # Each replica start's time, in its two parts (llmgw's and the engine's).
        self.metrics = metrics
        self.router = router
        self.scheduler = scheduler
        self.installs = installs
        # Signs a renewed certificate for a CSR (llmgw.server.fleet.nodes).
        self.renew = renew
        self.on_routes_changed = on_routes_changed

    def handlers(self) -> dict[str, MessageHandler]:
        """The reports this applies, by message kind (its rows of :func:`agent_messages`)."""
        kinds: dict[str, MessageHandler] = {
            "heartbeat": self._heartbeat,
            "shard_status": lambda session, msg: self.apply_status(session, msg.shard_status),
            "op_result": lambda session, msg: self._apply_result(session, msg.op_result),
            "draining": self._draining,
            "cert_request": lambda session, msg: self.renew(session, msg.cert_request.csr_pem),
            "inventory": self._inventory,
        }
        return {kind: functools.partial(self._report, apply) for kind, apply in kinds.items()}

    def _report(self, apply: MessageHandler, session: NodeSession, msg: pb.AgentMessage) -> None:
        session.last_heartbeat = time.monotonic()
        # Liveness stays in memory: a store write per heartbeat was most of what a fleet
        # cost (400 a second at 2,000 agents); Sessions.flush_last_seen stores it in batches.
        session.seen_at = self.store.database.clock()
        apply(session, msg)

    def _heartbeat(self, session: NodeSession, msg: pb.AgentMessage) -> None:
        session.inflight = msg.heartbeat.inflight
        # The GPUs' utilisation too stays in memory: it changes every second.
        session.gpu_utilization = heartbeat_utilization(msg.heartbeat)
        ack = pb.HeartbeatAck(seq=msg.heartbeat.seq)
        # The set of sources to keep warm rides on every ack: a node told nothing (pending,
        # or before this leader's first look) keeps what it has.
        warm = self.warm(session.node_id) if session.approved else None
        if warm is not None:
            ack.warm.CopyFrom(warm)
        session.send(pb.ServerMessage(heartbeat_ack=ack))

    def _draining(self, session: NodeSession, _msg: pb.AgentMessage) -> None:
        session.draining = True
        self.router.remove_node(session.node_id)
        if session.approved:
            self.store.add_event(
                "node_draining", session.node_id, "agent stopping; no new requests sent to it"
            )
        log.info("agent is stopping; routing around it", extra=kv(node=session.node_id))
        self.on_routes_changed()

    def _inventory(self, session: NodeSession, msg: pb.AgentMessage) -> None:
        if session.approved:
            stored = store_inventory(self.store, session, msg.inventory)
            self.scheduler.gpus.note(session.node_id, stored)
            if self.metrics is not None:
                self.metrics.show_warm_bytes(session.node_id, warm_bytes(stored))
            self.scheduler.kick()
        else:
            # No churn stored before approval: the latest is stored on approval.
            session.held_inventory = msg.inventory

    def apply_status(self, session: NodeSession, status: pb.ShardStatus) -> None:
        state = _PB_STATE.get(status.state)
        if state is None:
            return
        try:
            shard = self.store.get_shard(status.shard_id)
        except NotFound:
            return  # a shard we already forgot (stopped or undeployed)
        if shard.node_id != session.node_id:
            return
        if shard.state == ShardState.STOPPING:
            # Retired by a scale-down (llmgw.server.fleet.retiring): never routed again,
            # whatever it says; gone once it exited.
            if state in (ShardState.EXITED, ShardState.FAILED):
                self.scheduler.retirements.shard_ended(shard)
            return
        if state == ShardState.EXITED:
            # We delete shards we stop, so an exit we did not order is a failure.
            state = ShardState.FAILED
        exit_code = status.exit_code if status.has_exit_code else None
        # What a reattaching agent reports again (every shard, at each reconnect of a
        # fleet) is mostly what is stored: nothing is written for it, and no event.
        unchanged = (
            shard.state == state
            and shard.port == (status.port or None)
            and shard.pid == (status.pid or None)
            and shard.exit_code == exit_code
            and (shard.reason or "") == status.reason
        )
        # Sleep and wake (llmgw.server.fleet.sleeps): their level, memory and events.
        self.scheduler.sleeps.on_status(shard, state, status)
        if not unchanged:
            self.store.update_shard(
                shard.id,
                state=state,
                port=status.port or None,
                pid=status.pid or None,
                exit_code=exit_code,
                reason=status.reason,
            )
        replica = self.store.get_replica(shard.replica_id)
        if replica.state != state:
            self.store.set_replica_state(shard.replica_id, ReplicaState(state))
        # Only rank 0 serves; workers of a multi-node replica are ready but not routable.
        if state == ShardState.READY and not session.draining and shard.rank == 0:
            self.router.set_ready(
                Endpoint(
                    model=replica.model,
                    replica_id=replica.id,
                    shard_id=shard.id,
                    node_id=session.node_id,
                    addr=session.dataplane_addr,
                    transfer_addr=transfer_addr(replica.model, shard.dist_init_addr),
                )
            )
            self.scheduler.shard_ready(shard.id)
            if not unchanged:
                took = self._start_time(replica, shard, status)
                self.store.add_event(
                    "shard_ready", shard.id, f"on {session.node_id} port {status.port}{took}"
                )
        else:
            self.router.remove_shard(shard.id)
            if state == ShardState.FAILED and not unchanged:
                self.scheduler.shard_failed(shard.id)
                self.store.add_event("shard_failed", shard.id, status.reason or "failed")
        self.on_routes_changed()

    def _start_time(self, replica: Replica, shard: Shard, status: pb.ShardStatus) -> str:
        """A replica's first start, placed to routable, in its two parts: the engine's (its
        agent measured it) and llmgw's (the rest); observed, and said for its event. '' for
        a restart or a shard that was ready before (an agent reattaching)."""
        if shard.restarts or replica.state != ReplicaState.STARTING or not status.startup_s:
            return ""
        total = max(0.0, self.store.database.clock() - replica.created_at)
        engine = min(total, status.startup_s)
        if self.metrics is not None:
            self.metrics.replica_start.observe((replica.model, "engine"), engine)
            self.metrics.replica_start.observe((replica.model, "llmgw"), total - engine)
        return f"; ready {total:.2f} s after placement (engine {engine:.2f} s, llmgw {total - engine:.2f} s)"

    def _apply_result(self, session: NodeSession, result: pb.OperationResult) -> None:
        if self.installs.on_result(session, result):
            # A checked install may let a replica of that engine be placed now.
            self.scheduler.kick()
            return
        if self.scheduler.sleeps.on_result(session, result):
            return
        if result.ok:
            return
        log.warning(
            "an order failed on a node",
            extra=kv(node=session.node_id, op=result.op_id, error=result.error),
        )
        for shard in self.store.list_shards(node_id=session.node_id):
            if shard.op_id == result.op_id and shard.state in (
                ShardState.STARTING,
                ShardState.PENDING,
            ):
                self.store.update_shard(shard.id, state=ShardState.FAILED, reason=result.error)
                self.store.set_replica_state(shard.replica_id, ReplicaState.FAILED)
                self.scheduler.shard_failed(shard.id)
                self.store.add_event("shard_failed", shard.id, result.error)


class UpdateStatus(Protocol):
    """Where an agent's progress on its update order goes (llmgw.server.fleet.updates)."""

    def on_status(self, session: NodeSession, status: pb.UpdateStatus) -> None: ...


def agent_messages(
    reports: AgentReports,
    *,
    kv_events: Callable[[str, pb.KvEvents], object],
    updates: UpdateStatus,
) -> dict[str, MessageHandler]:
    """The one table the Connect stream reads: each kind of message an agent sends after its
    Hello, and its handler (an unknown kind is logged and skipped)."""

    def kv_events_of(session: NodeSession, msg: pb.AgentMessage) -> None:
        session.last_heartbeat = time.monotonic()
        try:
            kv_events(session.node_id, msg.kv_events)
        except Exception:
            # The index's fault, not the node's: the stream and its other reports go on.
            log.exception(
                "cannot apply KV cache events",
                extra=kv(node=session.node_id, shard=msg.kv_events.shard_id),
            )

    def update_status(session: NodeSession, msg: pb.AgentMessage) -> None:
        session.last_heartbeat = time.monotonic()
        updates.on_status(session, msg.update_status)

    return {**reports.handlers(), "kv_events": kv_events_of, "update_status": update_status}
