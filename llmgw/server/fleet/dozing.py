"""Idle replicas put to sleep, and woken by demand: the planner's use of sleeping replicas
(:mod:`llmgw.server.fleet.sleeps` sends the orders).

For a model that scales by demand with ``sleep_after`` and a profile that sleeps
(``sleep: {level: N}``): a ready replica with nothing in flight for ``sleep_after`` goes to
sleep while the model has more awake replicas than its demand asks for; its GPUs are then
free to placement (the scheduler's view leaves asleep shards out). When demand asks for more
awake replicas than it has, asleep ones are woken first (seconds, where a start is a weights
load). A replica whose GPUs another replica took while it slept takes them back from a lower
priority: the occupant is put to sleep if it is idle and can, else retired (drained), and
the wake follows once its GPUs are free; from an equal or higher priority it does not: the
asleep replica is retired instead, and the scheduler places the model's replica where there
is room (or a lower priority gives way: :mod:`llmgw.server.fleet.preemption`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from llmgw.contracts.catalog import deployed_profile, profile_sleep_level
from llmgw.contracts.scaling import ScalingPolicy, policy_of
from llmgw.durations import format_duration
from llmgw.errors import ConfigError, Conflict, NotFound
from llmgw.log import kv
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.store import Model, Replica, Shard
from llmgw.server.store.states import ReplicaState, ShardState

__all__ = ["Dozing"]

log = logging.getLogger("llmgw.server.planner")

_AWAKE = (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.PENDING, ReplicaState.WAKING)
HOST_SHARE = 0.5
"""The share of a node's memory the weights of its level-1 sleepers may hold."""
_MIB = 1 << 20


class Dozing:
    """Sleep for the idle, waking for demand."""

    def __init__(
        self, scheduler: Scheduler, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.scheduler = scheduler
        self.store = scheduler.store
        self.clock = clock
        # replica id -> since when nothing was in flight on it (monotonic)
        self.idle_since: dict[str, float] = {}
        # replica to wake -> the replicas giving its GPUs back
        self.making_room: dict[str, set[str]] = {}
        # model -> the host memory (MiB) a replica of it held asleep at level 1, as the
        # engines said: what the next one will hold
        self.host_mib: dict[str, int] = {}

    def step(self, demand_of: Mapping[str, int]) -> None:
        """One pass: ``demand_of`` is each model's demand (in flight, queued, waiting)."""
        store = self.store
        sleepy = [(m, *_sleeping(m)) for m in store.list_models()]
        sleepy = [(m, policy, level) for m, policy, level in sleepy if policy and level]
        if not sleepy:  # a fleet where nothing sleeps: nothing more is read
            self.idle_since.clear()
            return
        busy = {ep.replica_id: ep.inflight for ep in self.scheduler.router.endpoints()}
        replicas: dict[str, list[Replica]] = {}
        for replica in store.list_replicas():
            replicas.setdefault(replica.model, []).append(replica)
        now = self.clock()
        self._learn_host_memory(replicas)
        seen: set[str] = set()
        for model, policy, level in sleepy:
            assert policy is not None
            mine = replicas.get(model.name, [])
            seen.update(r.id for r in mine)
            wanted = policy.wanted(demand_of.get(model.name, 0)) if demand_of.get(model.name) else 0
            awake = [r for r in mine if r.state in _AWAKE]
            asleep = [r for r in mine if r.state == ReplicaState.ASLEEP]
            for replica in asleep[: max(0, wanted - len(awake))]:
                self._wake(replica, model, policy)
            if policy.sleep_after is not None:
                self._sleep_idle(model, policy, level, awake, wanted, busy, now)
        for gone in set(self.idle_since) - seen:
            del self.idle_since[gone]

    # -- to sleep ---------------------------------------------------------------------------

    def _sleep_idle(
        self,
        model: Model,
        policy: ScalingPolicy,
        level: int,
        awake: list[Replica],
        wanted: int,
        busy: Mapping[str, int],
        now: float,
    ) -> None:
        assert policy.sleep_after is not None
        spare = len(awake) - wanted
        for replica in awake:
            if replica.state != ReplicaState.READY or busy.get(replica.id, 0):
                self.idle_since.pop(replica.id, None)
                continue
            since = self.idle_since.setdefault(replica.id, now)
            if spare <= 0 or now - since < policy.sleep_after:
                continue
            full = self._host_full(replica, level)
            if full:
                log.info("an idle replica stays awake", extra=kv(replica=replica.id, why=full))
                continue
            try:
                self.scheduler.sleep_replica(
                    replica.id,
                    level,
                    why=f"idle for {format_duration(policy.sleep_after)}",
                    actor="planner",
                )
            except (Conflict, NotFound) as exc:
                log.info("an idle replica cannot sleep", extra=kv(replica=replica.id, why=str(exc)))
                continue
            self.idle_since.pop(replica.id, None)
            spare -= 1

    def _learn_host_memory(self, replicas: Mapping[str, list[Replica]]) -> None:
        asleep = {
            r.id: model
            for model, rs in replicas.items()
            for r in rs
            if r.state == ReplicaState.ASLEEP
        }
        if not asleep:
            return
        for shard in self.store.list_shards(states=(ShardState.ASLEEP,)):
            model = asleep.get(shard.replica_id)
            if model is not None and shard.host_memory_mib:
                self.host_mib[model] = max(self.host_mib.get(model, 0), shard.host_memory_mib)

    def _host_full(self, replica: Replica, level: int) -> str:
        """Why ``replica`` may not sleep at ``level`` on its node for want of host memory
        ('' when it may): a level-1 sleeper keeps its weights in the node's memory, and the
        sleepers of a node may hold at most HOST_SHARE of it."""
        if level != 1:
            return ""  # level 2 drops its weights
        shards = [s for s in self.store.list_shards(replica_id=replica.id) if s.rank == 0]
        if not shards:
            return ""
        node_id = shards[0].node_id
        try:
            total = int(self.store.get_node(node_id).inventory.get("memory_total_bytes") or 0)
        except NotFound:
            return ""
        need = self.host_mib.get(replica.model, 0)
        if not total or not need:
            return ""  # unknown: it may (its engine will say what it holds)
        held = sum(
            s.host_memory_mib
            for s in self.store.list_shards(node_id=node_id)
            if s.state == ShardState.ASLEEP
        )
        budget = int(total / _MIB * HOST_SHARE)
        if held + need <= budget:
            return ""
        return (
            f"its node {node_id}'s sleepers hold {held} MiB of host memory; {need} MiB more "
            f"would pass {HOST_SHARE:.0%} of its {total // _MIB} MiB"
        )

    # -- awake -------------------------------------------------------------------------------

    def _wake(self, replica: Replica, model: Model, policy: ScalingPolicy) -> None:
        """Wake ``replica``, its GPUs taken back first if another replica has them."""
        store = self.store
        try:
            (shard,) = [s for s in store.list_shards(replica_id=replica.id) if s.rank == 0]
        except ValueError:
            return
        giving = self.making_room.get(replica.id)
        occupants = self._occupants(shard)
        if giving is not None and occupants:
            return  # those giving its GPUs back are not done yet
        self.making_room.pop(replica.id, None)
        if not occupants:
            try:
                self.scheduler.wake_replica(replica.id, why="demand", actor="planner")
            except (Conflict, NotFound) as exc:
                log.info("a replica cannot be woken", extra=kv(replica=replica.id, why=str(exc)))
            return
        theirs = {r.id: r for r in (store.get_replica(o) for o in occupants)}
        models = {m.name: m for m in store.list_models()}
        if all(_rank(models.get(r.model)) < policy.rank for r in theirs.values()):
            self._take_back(replica, model, shard, list(theirs.values()), models)
            return
        # Held by an equal or higher priority: this one gives its place up; the scheduler
        # places the model's replica where there is room.
        holders = ", ".join(sorted(f"{r.id} ({r.model})" for r in theirs.values()))
        self.scheduler.retirements.retire(
            replica.id, why=f"cannot wake: its GPUs on {shard.node_id} are held by {holders}"
        )

    def _occupants(self, shard: Shard) -> set[str]:
        """The replicas (other than ``shard``'s) holding any of its GPUs on its node now."""
        gpus = set(shard.gpus)
        return {
            s.replica_id
            for s in self.store.list_shards(node_id=shard.node_id)
            if s.replica_id != shard.replica_id
            and s.state != ShardState.ASLEEP
            and gpus & set(s.gpus)
        }

    def _take_back(
        self,
        replica: Replica,
        model: Model,
        shard: Shard,
        occupants: list[Replica],
        models: Mapping[str, Model],
    ) -> None:
        busy = {ep.replica_id: ep.inflight for ep in self.scheduler.router.endpoints()}
        for other in occupants:
            if other.state == ReplicaState.STOPPING or other.state == ReplicaState.FALLING_ASLEEP:
                continue  # on its way out already
            why = f"giving GPUs of {shard.node_id} back to {replica.id} of {model.name}, waking"
            _policy, level = _sleeping(models[other.model])
            if level and not busy.get(other.id, 0) and other.state == ReplicaState.READY:
                try:
                    self.scheduler.sleep_replica(other.id, level, why=why, actor="planner")
                except (Conflict, NotFound):
                    pass
                else:
                    continue
            count = len(
                [
                    r
                    for r in self.store.list_replicas(other.model)
                    if r.state != ReplicaState.STOPPING
                ]
            )
            self.store.set_replicas(other.model, max(0, count - 1))
            self.scheduler.retirements.retire(other.id, why=why)
        self.store.add_event(
            "preempted",
            replica.model,
            f"{replica.id} takes its GPUs of {shard.node_id} back from "
            f"{', '.join(sorted(f'{o.id} ({o.model})' for o in occupants))} to wake",
        )
        self.making_room[replica.id] = {o.id for o in occupants}


def _sleeping(model: Model) -> tuple[ScalingPolicy | None, int]:
    """A model's scaling policy and the level its deployed profile sleeps at (0: none)."""
    try:
        policy = policy_of(model.scaling)
    except ConfigError:
        return None, 0
    profile = deployed_profile(model.profiles, model.profile, model.engine, model.params)
    return policy, profile_sleep_level(profile)


def _rank(model: Model | None) -> int:
    """A model's priority rank; a fixed count's above every other (it neither takes nor
    gives)."""
    policy, _level = _sleeping(model) if model is not None else (None, 0)
    return policy.rank if policy is not None else 99
