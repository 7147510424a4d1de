"""Many models sharing the fleet by priority: when a model that scales by demand has no room
for a replica it wants, a replica of a model of lower priority gives way.

Run by the planner after each pass, on the models the scheduler could not place. A victim
comes from a model of a lower priority that has more replicas than its ``min``; an idle
one (nothing in flight on it) before a busy one, the lowest priority first. A model with
demand keeps at least one replica while any model has more than one (so that one model's
burst cannot take every GPU from the others). The victim is chosen only if the wanted
replica would then fit (placement asked on a view of its own); its model's count goes one
down (the planner's count: it holds there, as the wanted model's priority holds the GPUs)
and the replica is retired make-before-break, its requests drained (an idle one whose profile
sleeps is put to sleep instead: its GPUs free, its process and count kept). One victim at a time per
model: the next only once it is gone and the model still has no room. Each preemption is an
event naming both models.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from llmgw.contracts.catalog import deployed_profile, profile_sleep_level
from llmgw.contracts.scaling import ScalingPolicy, policy_of
from llmgw.errors import ConfigError, Conflict, NotFound
from llmgw.log import kv
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.gateway.capacity import Demand
from llmgw.server.store import Model, Replica
from llmgw.server.store.states import SLEEP_STATES, ReplicaState

__all__ = ["Preemption"]

log = logging.getLogger("llmgw.server.planner")


class Preemption:
    """Room for higher priorities, taken from lower ones."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.store = scheduler.store
        # model -> the replica retiring to make room for it
        self.making_room: dict[str, str] = {}

    def step(self, demand: Mapping[str, Demand]) -> None:
        store = self.store
        for model_name, replica_id in list(self.making_room.items()):
            try:
                state = store.get_replica(replica_id).state
            except NotFound:
                del self.making_room[model_name]  # gone: its room is there for the next pass
                continue
            if state == ReplicaState.ASLEEP:
                del self.making_room[model_name]  # asleep: its GPUs are free to placement
        wanting = sorted(self.scheduler.unplaceable)
        if not wanting:
            return
        models = {m.name: m for m in store.list_models()}
        policies = {name: _policy(m) for name, m in models.items()}
        counts = store.count_replicas()
        for name in sorted(wanting, key=lambda n: -_rank(policies.get(n))):
            policy = policies.get(name)
            model = models.get(name)
            if policy is None or model is None or name in self.making_room:
                continue
            if counts.get(name, 0) >= model.replicas:
                continue  # what it lacks is not room for more (a profile switch waiting)
            victim = self._victim(model, policy, models, policies, counts, demand)
            if victim is None:
                continue
            self._preempt(model, policy, victim, models, counts)

    def _victim(
        self,
        model: Model,
        policy: ScalingPolicy,
        models: Mapping[str, Model],
        policies: Mapping[str, ScalingPolicy | None],
        counts: dict[str, int],
        demand: Mapping[str, Demand],
    ) -> Replica | None:
        busy = {ep.replica_id: ep.inflight for ep in self.scheduler.router.endpoints()}
        crowded = any(c > 1 for c in counts.values())
        candidates: list[tuple[int, int, float, Replica]] = []
        for other, theirs in policies.items():
            if theirs is None or theirs.rank >= policy.rank:
                continue  # a fixed count, or not lower than the model wanting room
            have = counts.get(other, 0)
            if have <= theirs.min:
                continue  # never below its min
            if have == 1 and crowded and demand.get(other, Demand()).total > 0:
                continue  # a model with demand keeps one while another has more than one
            for replica in self.store.list_replicas(other):
                if replica.state == ReplicaState.STOPPING or replica.state in SLEEP_STATES:
                    continue  # going, or its GPUs free (asleep) or about to be
                inflight = busy.get(replica.id, 0)
                candidates.append((theirs.rank, inflight, -replica.created_at, replica))
        for *_, replica in sorted(candidates, key=lambda c: c[:3]):
            if self.scheduler.fits_without(model, {replica.id}):
                return replica
        return None

    def _preempt(
        self,
        model: Model,
        policy: ScalingPolicy,
        victim: Replica,
        models: Mapping[str, Model],
        counts: dict[str, int],
    ) -> None:
        other = models[victim.model]
        theirs = _policy(other)
        why = (
            f"{victim.id} of {other.name} (priority {theirs.priority if theirs else '?'}) gives "
            f"way to {model.name} (priority {policy.priority}), which has no room"
        )
        self.making_room[model.name] = victim.id
        log.info(
            "a lower priority gives way",
            extra=kv(model=model.name, victim=victim.id, victim_model=other.name),
        )
        self.store.add_event("preempting", model.name, why)
        if self._put_to_sleep(victim, other, why):
            self.store.add_event("preempted", other.name, f"{why}; it sleeps")
            return
        have = counts.get(other.name, 0)
        self.store.set_replicas(other.name, max(0, have - 1))
        counts[other.name] = have - 1
        self.store.add_event("preempted", other.name, f"{why}; {other.name} {have} → {have - 1}")
        self.scheduler.retirements.retire(victim.id, why=f"giving way to {model.name}")

    def _put_to_sleep(self, victim: Replica, other: Model, why: str) -> bool:
        """An idle victim whose profile sleeps is put to sleep (its GPU memory freed, its
        process kept): whether it was."""
        if victim.state != ReplicaState.READY:
            return False
        busy = {ep.replica_id: ep.inflight for ep in self.scheduler.router.endpoints()}
        if busy.get(victim.id, 0):
            return False
        profile = deployed_profile(other.profiles, other.profile, other.engine, other.params)
        level = profile_sleep_level(profile)
        if not level:
            return False
        try:
            self.scheduler.sleep_replica(victim.id, level, why=why, actor="planner")
        except (Conflict, NotFound):
            return False
        return True


def _policy(model: Model) -> ScalingPolicy | None:
    try:
        return policy_of(model.scaling)
    except ConfigError:
        return None


def _rank(policy: ScalingPolicy | None) -> int:
    return policy.rank if policy is not None else -1
