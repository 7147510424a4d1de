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
is room (or a lower priority gives way: :mod:`llmgw.server.fleet.preemption`). A
disaggregated model's pool replica wakes only where its pair may use it (the sibling pool
may have moved while it slept): else it is retired, and the scheduler places one beside the
pair.

A level-1 sleeper keeps its weights in its node's memory: the sleepers of a node hold at
most :data:`HOST_SHARE` of it. What a replica will hold asleep is what its model's sleepers
held as their engines said, else the size of its weights as its node lists them
(:mod:`llmgw.server.fleet.hostmem`), else unknown (it may sleep). An idle replica that would
pass the share sleeps at level 2 instead where its engine can (vLLM, the sim: the weights
dropped, reloaded by its wake), and stays awake where it cannot (SGLang).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from llmgw.contracts.catalog import deployed_profile
from llmgw.contracts.scaling import ScalingPolicy
from llmgw.durations import format_duration
from llmgw.errors import Conflict, NotFound
from llmgw.log import kv
from llmgw.server.fleet.hostmem import Sleeper, rank_of, sleepers, sleeping, weights_mib
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.sleeps import sleeps_at
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
        # replica id -> since when nothing was in flight on it (monotonic). Not kept in the
        # store: it changes with every request that starts or ends on an idle replica (a
        # write a second per replica), and a new leader that starts it again only lets its
        # replicas sleep up to sleep_after later: nothing restarts, nothing flaps.
        self.idle_since: dict[str, float] = {}
        # replica to wake -> the replicas giving its GPUs back
        self.making_room: dict[str, set[str]] = {}
        # model -> the host memory (MiB) a replica of it held asleep at level 1, as the
        # engines said: what the next one will hold. Kept in the store (written when it
        # grows, read on the first pass that something sleeps): a new leader that fell back
        # to the weights' size could let a node's sleepers pass HOST_SHARE (an engine holds
        # more than its weights), or wrongly send one to level 2, until one slept again.
        self.host_mib: dict[str, int] = {}
        self._host_mib_read = False
        # This pass's sleepers (hostmem), read once per pass where something sleeps.
        self._asleep: list[Sleeper] = []
        # The nodes the sleepers' host memory gauge was last set for.
        self._shown: set[str] = set()

    def step(
        self, demand_of: Mapping[str, int], tokens_of: Mapping[str, int] | None = None
    ) -> None:
        """One pass: ``demand_of`` is each model's demand (in flight, queued, waiting),
        ``tokens_of`` its tokens (what a policy's target_tokens weighs; None: none)."""
        tokens_of = tokens_of or {}
        store = self.store
        sleepy = [(m, *sleeping(m)) for m in store.list_models()]
        sleepy = [(m, policy, level) for m, policy, level in sleepy if policy and level]
        if not sleepy:  # a fleet where nothing sleeps: nothing more is read
            self.idle_since.clear()
            self._show_held([])
            return
        if not self._host_mib_read:
            self.host_mib = {**store.learnt_host_memory(), **self.host_mib}
            self._host_mib_read = True
        busy = {ep.replica_id: ep.inflight for ep in self.scheduler.router.endpoints()}
        replicas: dict[str, list[Replica]] = {}
        for replica in store.list_replicas():
            replicas.setdefault(replica.model, []).append(replica)
        now = self.clock()
        self._learn_host_memory(replicas)
        self._show_held(self._asleep)
        seen: set[str] = set()
        for model, policy, level in sleepy:
            assert policy is not None
            mine = replicas.get(model.name, [])
            seen.update(r.id for r in mine)
            asked, tokens = demand_of.get(model.name, 0), tokens_of.get(model.name, 0)
            wanted = policy.wanted(asked, tokens) if asked or tokens else 0
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
            why = f"idle for {format_duration(policy.sleep_after)}"
            at = level
            full = self._host_full(replica, model, level)
            if full and sleeps_at(_profile(model, replica), 2):
                at, why = 2, f"{why}; slept at level 2: {full}"
                log.info(
                    "an idle replica sleeps at level 2", extra=kv(replica=replica.id, why=full)
                )
            elif full:
                log.info("an idle replica stays awake", extra=kv(replica=replica.id, why=full))
                continue
            try:
                self.scheduler.sleep_replica(replica.id, at, why=why, actor="planner")
            except (Conflict, NotFound) as exc:
                log.info("an idle replica cannot sleep", extra=kv(replica=replica.id, why=str(exc)))
                continue
            self.idle_since.pop(replica.id, None)
            spare -= 1

    def _learn_host_memory(self, replicas: Mapping[str, list[Replica]]) -> None:
        """This pass's sleepers, and what the level-1 ones of each model said they hold."""
        if not any(r.state == ReplicaState.ASLEEP for rs in replicas.values() for r in rs):
            self._asleep = []
            return
        self._asleep = sleepers(self.store)
        said = {
            s.replica_id: s.host_memory_mib
            for s in self.store.list_shards(states=(ShardState.ASLEEP,))
            if s.rank == 0 and s.host_memory_mib and s.sleep_level != 2
        }
        for sleeper in self._asleep:
            mib = said.get(sleeper.replica_id, 0)
            if mib > self.host_mib.get(sleeper.model, 0):
                self.host_mib[sleeper.model] = mib
                self.store.set_learnt_host_memory(sleeper.model, mib)

    def _show_held(self, asleep: list[Sleeper]) -> None:
        """The sleepers' host memory gauge, per node (0 for a node whose sleepers left)."""
        metrics = self.scheduler.sleeps.metrics
        if metrics is None:
            return
        held: dict[str, int] = {}
        for sleeper in asleep:
            held[sleeper.node_id] = held.get(sleeper.node_id, 0) + sleeper.mib
        for node_id in self._shown | set(held):
            metrics.sleepers_host_memory.set((node_id,), held.get(node_id, 0) * _MIB)
        self._shown = set(held)

    def _host_full(self, replica: Replica, model: Model, level: int) -> str:
        """Why ``replica`` may not sleep at ``level`` on its node for want of host memory
        ('' when it may): a level-1 sleeper keeps its weights in the node's memory, and the
        sleepers of a node may hold at most HOST_SHARE of it. What it will hold: what its
        model's sleepers said, else its weights' size as the node lists them."""
        if level != 1:
            return ""  # level 2 drops its weights
        shards = [s for s in self.store.list_shards(replica_id=replica.id) if s.rank == 0]
        if not shards:
            return ""
        node_id = shards[0].node_id
        try:
            inventory = self.store.get_node(node_id).inventory
        except NotFound:
            return ""
        total = int(inventory.get("memory_total_bytes") or 0)
        need = self.host_mib.get(replica.model, 0) or weights_mib(
            inventory, _profile(model, replica)
        )
        if not total or not need:
            return ""  # unknown: it may (its engine will say what it holds)
        held = sum(s.mib for s in self._asleep if s.node_id == node_id)
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
        # A pool's sleeper wakes only beside its pair (which may have moved meanwhile);
        # else it gives its place up and the scheduler places one beside the pair.
        unpaired = self.scheduler.unpaired(model, replica.id, shard.node_id)
        if unpaired:
            self.making_room.pop(replica.id, None)
            self.scheduler.retirements.retire(
                replica.id,
                why=f"cannot wake on {shard.node_id}: it {unpaired}; the scheduler places "
                f"a replica of {model.name} beside its pair",
            )
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
        if all(rank_of(models.get(r.model)) < policy.rank for r in theirs.values()):
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
            _policy, level = sleeping(models[other.model])
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


def _profile(model: Model, replica: Replica) -> Mapping[str, Any]:
    """The stored profile ``replica`` runs."""
    return deployed_profile(
        model.profiles, replica.profile or model.profile, model.engine, model.params
    )
