"""Many models on a fixed fleet by priority: a model with no room takes a replica from a model
of lower priority (idle first, never below its min, a model with demand keeps one while
another has more than one), drained make-before-break, both named in the events."""

from __future__ import annotations

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.server.fleet.preemption import Preemption
from llmgw.server.gateway.capacity import Demand
from llmgw.server.store.states import ReplicaState, ShardState
from tests.unit.server.scheduler_rig import SchedulerRig


def _join(cp: SchedulerRig, gpus: int) -> None:
    inventory = {"gpus": [{"uuid": f"GPU-{i}", "memory_total_mib": 81920} for i in range(gpus)]}
    cp.join("n1", inventory, dataplane_addr="127.0.0.1:9443", engines=frozenset({"sim"}))


def _deploy(cp: SchedulerRig, name: str, policy: ScalingPolicy, replicas: int) -> None:
    cp.store.put_catalog_model(name, {"default": {"engine": "sim", "gpus": 1}})
    cp.store.deploy_model(name, profile="default", replicas=replicas)
    cp.store.set_scaling(name, policy.to_json(), replicas=replicas)


def _serving(cp: SchedulerRig) -> None:
    for shard in cp.store.list_shards():
        if shard.state != ShardState.STOPPING:
            cp.store.update_shard(shard.id, state=ShardState.READY)
            cp.store.set_replica_state(shard.replica_id, ReplicaState.READY)
            cp.router.routable.add(shard.replica_id)


def _placed(cp: SchedulerRig, model: str) -> list[str]:
    return [r.id for r in cp.store.list_replicas(model) if r.state != ReplicaState.STOPPING]


LOW = ScalingPolicy(min=0, max=4, priority="low")
HIGH = ScalingPolicy(min=0, max=4, priority="high")


def test_a_high_priority_takes_an_idle_low_replica_and_is_placed_once_it_is_gone(
    cp: SchedulerRig,
) -> None:
    _join(cp, 2)
    _deploy(cp, "low", LOW, 2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    busy, idle = _placed(cp, "low")
    cp.router.inflight[busy] = 3
    _deploy(cp, "high", HIGH, 1)
    scheduler.reconcile()
    assert "high" in scheduler.unplaceable
    preemption = Preemption(scheduler)
    preemption.step({"low": Demand(inflight=3)})
    assert cp.store.get_replica(idle).state == ReplicaState.STOPPING  # the idle one
    assert cp.store.get_model("low").replicas == 1
    events = {e.kind: e.message for e in cp.store.list_events()}
    assert events["preempted"] == (
        f"{idle} of low (priority low) gives way to high (priority high), which has no room; "
        "low 2 → 1"
    )
    assert events["preempting"].startswith(f"{idle} of low")
    preemption.step({})  # one victim at a time: nothing more while it drains
    assert cp.store.get_replica(busy).state == ReplicaState.READY
    (shard,) = cp.store.list_shards(replica_id=idle)
    scheduler.retirements.shard_ended(shard)  # its requests ended, its engine stopped
    scheduler.reconcile()
    assert len(_placed(cp, "high")) == 1
    preemption.step({})
    assert preemption.making_room == {}


def test_never_below_min_nor_an_equal_or_higher_priority(cp: SchedulerRig) -> None:
    _join(cp, 2)
    _deploy(cp, "low", ScalingPolicy(min=1, max=4, priority="low"), 1)
    _deploy(cp, "normal", ScalingPolicy(min=0, max=4), 1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    _deploy(cp, "other", ScalingPolicy(min=0, max=4), 1)  # normal: takes nothing from normal
    scheduler.reconcile()
    Preemption(scheduler).step({})
    assert not [e for e in cp.store.list_events() if e.kind == "preempted"]
    assert len(_placed(cp, "low")) == 1 and len(_placed(cp, "normal")) == 1


def test_a_model_with_demand_keeps_one_while_another_has_more(cp: SchedulerRig) -> None:
    _join(cp, 3)
    _deploy(cp, "high", HIGH, 2)
    _deploy(cp, "low", LOW, 1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    cp.store.set_replicas("high", 3)  # a burst
    scheduler.reconcile()
    preemption = Preemption(scheduler)
    preemption.step({"low": Demand(queued=1)})
    assert len(_placed(cp, "low")) == 1  # its one replica stays
    preemption.step({})  # no demand of its own: it gives way
    assert _placed(cp, "low") == []
    assert cp.store.get_model("low").replicas == 0


def test_a_fixed_count_is_never_taken(cp: SchedulerRig) -> None:
    _join(cp, 1)
    cp.store.put_catalog_model("fixed", {"default": {"engine": "sim", "gpus": 1}})
    cp.store.deploy_model("fixed", profile="default", replicas=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    _deploy(cp, "high", HIGH, 1)
    scheduler.reconcile()
    Preemption(scheduler).step({})
    assert len(_placed(cp, "fixed")) == 1 and _placed(cp, "high") == []


def test_an_idle_victim_that_can_sleep_is_put_to_sleep_not_stopped(cp: SchedulerRig) -> None:
    _join(cp, 1)
    cp.store.put_catalog_model(
        "low", {"default": {"engine": "sim", "gpus": 1, "sleep": {"level": 1}}}
    )
    cp.store.deploy_model("low", profile="default", replicas=1)
    cp.store.set_scaling("low", LOW.to_json(), replicas=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    (victim,) = _placed(cp, "low")
    _deploy(cp, "high", HIGH, 1)
    scheduler.reconcile()
    preemption = Preemption(scheduler)
    preemption.step({})
    assert cp.store.get_replica(victim).state == ReplicaState.FALLING_ASLEEP
    assert cp.store.get_model("low").replicas == 1  # its count kept: it sleeps
    events = {e.kind: e.message for e in cp.store.list_events()}
    assert events["preempted"].endswith("which has no room; it sleeps")
    # Asleep, its GPU is free: the next pass places the high priority's replica there.
    for shard in cp.store.list_shards(replica_id=victim):
        cp.store.update_shard(shard.id, state=ShardState.ASLEEP)
    cp.store.set_replica_state(victim, ReplicaState.ASLEEP)
    preemption.step({})
    assert preemption.making_room == {}
    scheduler.reconcile()
    assert len(_placed(cp, "high")) == 1
