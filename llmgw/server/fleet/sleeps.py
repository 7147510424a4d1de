"""Sleeping replicas on the control plane: the orders that put a replica to sleep and wake
it, and what their answers change.

:meth:`Sleeps.sleep_replica` sends rank 0 of a ready replica a SleepShard, and
:meth:`Sleeps.wake_replica` an asleep one a WakeShard; the planner (issue 39) and the
operators' ``llmgw ctl replicas sleep|wake`` call them, through the scheduler. The agent's
reports do the rest (:mod:`llmgw.server.fleet.reports`): falling asleep, the replica leaves
routing; asleep, it holds no GPU memory and is neither restarted nor rebuilt (the scheduler
tends only failed and pending shards); waking, then ready, it is routed again. Each sleep
and wake is an event with the time it took: from the order to the report (llmgw's part and
the engine's) and the engine's own part (the agent's call to its answer). A refused order
(an engine that cannot sleep after all, a shard no longer ready) is an event with the
node's reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.contracts.catalog import deployed_profile, profile_sleep_level
from llmgw.engines.launch import sleep_args
from llmgw.engines.registry import sleeping_engines
from llmgw.errors import Conflict, EngineError, NotFound
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.meeting import transfer_addr
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.store import Replica, Shard, Store
from llmgw.server.store.states import ReplicaState, ShardState

__all__ = ["Sleeps", "sleeps_at"]


def sleeps_at(profile: Mapping[str, Any], level: int) -> bool:
    """Whether a replica of the stored ``profile`` may sleep at ``level``: its own level,
    or another its engine sleeps at with the flags it was started with (vLLM and the sim
    take level 2 as well as 1; SGLang has its one level)."""
    able = profile_sleep_level(profile)
    if not able or level == able:
        return bool(able)
    engine = str(profile.get("engine") or "")
    try:
        return sleep_args(engine, level) == sleep_args(engine, able)
    except EngineError:
        return False


@dataclass(frozen=True)
class _Order:
    replica_id: str
    shard_id: str
    kind: str  # "sleep" or "wake"
    level: int
    why: str
    actor: str
    sent: float  # monotonic


class Sleeps:
    """The sleep and wake orders in flight, and the events their reports make."""

    def __init__(
        self,
        store: Store,
        router: Router,
        sessions: Mapping[str, NodeSession],
        on_routes_changed: Callable[[], None],
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        # Each wake's time in its two parts (llmgw_replica_wake_seconds).
        self.metrics = metrics
        self.router = router
        self.sessions = sessions
        self.on_routes_changed = on_routes_changed
        self._orders: dict[str, _Order] = {}  # op id -> the order
        self._by_shard: dict[str, str] = {}  # shard id -> op id of its order in flight

    # -- orders --------------------------------------------------------------------------------

    def sleep_replica(self, replica_id: str, level: int, *, why: str, actor: str = "") -> str:
        """Order a ready replica's engine to sleep at ``level``; returns the op id. NotFound
        for an unknown replica; Conflict, saying why and what to do, when it cannot sleep."""
        replica, shard, profile = self._replica(replica_id)
        able = profile_sleep_level(profile)
        if not able:
            raise Conflict(
                f"replica {replica_id} of model {replica.model} cannot sleep: its profile has "
                "no 'sleep' (add sleep: {level: 1} to the profile, on an engine of "
                f"{', '.join(sleeping_engines())}, and deploy it again)"
            )
        if level not in (1, 2):
            raise Conflict(f"sleep level must be 1 or 2, not {level}")
        if not sleeps_at(profile, level):
            raise Conflict(
                f"replica {replica_id} was started to sleep at level {able} (its profile's "
                f"sleep.level), and its engine cannot sleep at {level} with that start: give "
                f"--level {able}"
            )
        if replica.state == ReplicaState.ASLEEP:
            raise Conflict(f"replica {replica_id} is asleep already")
        if replica.state != ReplicaState.READY:
            raise Conflict(
                f"replica {replica_id} is {replica.state}, not ready: only a ready replica can "
                "be put to sleep"
            )
        session = self._session(shard)
        op_id = session.sleep_shard(shard.id, level)
        self._note(
            op_id, _Order(replica.id, shard.id, "sleep", level, why, actor, time.monotonic())
        )
        # Out of routing at once: vLLM aborts what is in flight when it falls asleep.
        self.router.remove_shard(shard.id)
        self.store.set_replica_state(replica.id, ReplicaState.FALLING_ASLEEP)
        self.store.update_shard(shard.id, state=ShardState.FALLING_ASLEEP)
        self.on_routes_changed()
        return op_id

    def wake_replica(self, replica_id: str, *, why: str, actor: str = "") -> str:
        """Order an asleep replica's engine to wake; returns the op id. NotFound for an
        unknown replica; Conflict when it is not asleep."""
        replica, shard, _profile = self._replica(replica_id)
        if replica.state in (ReplicaState.READY, ReplicaState.WAKING):
            raise Conflict(f"replica {replica_id} is {replica.state}: it needs no waking")
        if replica.state != ReplicaState.ASLEEP:
            raise Conflict(
                f"replica {replica_id} is {replica.state}, not asleep: only an asleep replica "
                "can be woken"
            )
        session = self._session(shard)
        op_id = session.wake_shard(shard.id)
        self._note(
            op_id,
            _Order(replica.id, shard.id, "wake", shard.sleep_level, why, actor, time.monotonic()),
        )
        self.store.set_replica_state(replica.id, ReplicaState.WAKING)
        self.store.update_shard(shard.id, state=ShardState.WAKING)
        return op_id

    def _replica(self, replica_id: str) -> tuple[Replica, Shard, Mapping[str, Any]]:
        """The replica, its rank 0, and its stored profile."""
        replica = self.store.get_replica(replica_id)
        model = self.store.get_model(replica.model)
        profile = deployed_profile(
            model.profiles, replica.profile or model.profile, model.engine, model.params
        )
        shards = self.store.list_shards(replica_id=replica_id)
        rank0 = next((s for s in shards if s.rank == 0), None)
        if rank0 is None:
            raise Conflict(f"replica {replica_id} has no shard placed yet; try again once ready")
        return replica, rank0, profile

    def _session(self, shard: Shard) -> NodeSession:
        session = self.sessions.get(shard.node_id)
        if session is None:
            raise Conflict(
                f"node {shard.node_id} of shard {shard.id} is not connected; try again once "
                "its agent is back"
            )
        return session

    def _note(self, op_id: str, order: _Order) -> None:
        stale = self._by_shard.pop(order.shard_id, None)
        if stale is not None:
            self._orders.pop(stale, None)
        self._orders[op_id] = order
        self._by_shard[order.shard_id] = op_id

    # -- what the agents report ----------------------------------------------------------------

    def on_status(self, shard: Shard, state: ShardState, status: pb.ShardStatus) -> None:
        """A shard's new state, as its agent reported it (before it is stored): the level
        and host memory of a sleeping shard kept, and the event of a sleep or wake done."""
        if state == ShardState.ASLEEP:
            if (shard.sleep_level, shard.host_memory_mib) != (
                status.sleep_level,
                status.host_memory_mib,
            ):
                self.store.update_shard(
                    shard.id, sleep_level=status.sleep_level, host_memory_mib=status.host_memory_mib
                )
            self._done(shard, "sleep", status)
        elif state == ShardState.READY:
            if shard.sleep_level or shard.host_memory_mib:
                self.store.update_shard(shard.id, sleep_level=0, host_memory_mib=0)
            self._done(shard, "wake", status)
        elif state in (ShardState.FAILED, ShardState.EXITED):
            self._forget(shard.id)

    def _done(self, shard: Shard, kind: str, status: pb.ShardStatus) -> None:
        op_id = self._by_shard.get(shard.id)
        order = self._orders.get(op_id) if op_id else None
        if order is None or order.kind != kind:
            return
        self._forget(shard.id)
        took = time.monotonic() - order.sent
        engine_s = status.transition_ms / 1000
        if kind == "sleep":
            held = (
                f", holding {status.host_memory_mib} MiB of host memory"
                if status.host_memory_mib
                else ""
            )
            message = (
                f"asleep at level {order.level} in {took:.2f}s (engine {engine_s:.2f}s){held}: "
                f"{order.why}"
            )
            self.store.add_event("replica_asleep", order.replica_id, message, order.actor)
        else:
            if self.metrics is not None:
                model = self.store.get_replica(order.replica_id).model
                engine = min(took, engine_s)
                self.metrics.replica_wake.observe((model, "engine"), engine)
                self.metrics.replica_wake.observe((model, "llmgw"), took - engine)
            message = f"awake in {took:.2f}s (engine {engine_s:.2f}s): {order.why}"
            self.store.add_event("replica_awake", order.replica_id, message, order.actor)

    def on_result(self, session: NodeSession, result: pb.OperationResult) -> bool:
        """An order's result; True when it was a sleep or wake order of this. A refused one
        is an event with the node's reason, and the shard as it was before the order when
        the agent reported no change (it refused before touching the engine)."""
        order = self._orders.get(result.op_id)
        if order is None:
            return False
        if result.ok:
            return True
        self._forget(order.shard_id)
        self.store.add_event(
            f"replica_{order.kind}_refused", order.replica_id, result.error, order.actor
        )
        try:
            shard = self.store.get_shard(order.shard_id)
        except NotFound:
            return True
        if order.kind == "sleep" and shard.state == ShardState.FALLING_ASLEEP:
            self.store.update_shard(shard.id, state=ShardState.READY)
            self.store.set_replica_state(order.replica_id, ReplicaState.READY)
            if not session.draining:
                replica = self.store.get_replica(order.replica_id)
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
                self.on_routes_changed()
        elif order.kind == "wake" and shard.state == ShardState.WAKING:
            self.store.update_shard(shard.id, state=ShardState.ASLEEP)
            self.store.set_replica_state(order.replica_id, ReplicaState.ASLEEP)
        return True

    def _forget(self, shard_id: str) -> None:
        op_id = self._by_shard.pop(shard_id, None)
        if op_id is not None:
            self._orders.pop(op_id, None)
