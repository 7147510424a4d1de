"""Sleeping replicas by demand (llmgw.server.fleet.dozing): an idle replica sleeps after
sleep_after while the model has more awake than its demand asks for, demand wakes it, and
its GPUs, free to placement while it sleeps, are taken back from a lower priority (put to
sleep, or retired) before it wakes; from an equal priority they are not: the sleeper gives
its place up instead."""

from __future__ import annotations

from typing import Any

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.dozing import Dozing
from llmgw.server.store.states import ReplicaState, ShardState
from tests.unit.server.scheduler_rig import SchedulerRig
from tests.unit.server.scheduler_rig import order_kinds as _kinds
from tests.unit.server.scheduler_rig import orders as _orders
from tests.unit.server.scheduler_rig import set_state as _set

SLEEPY = {"engine": "sim", "gpus": 1, "sleep": {"level": 1}}


def _join(cp: SchedulerRig, gpus: int = 1) -> None:
    inventory = {"gpus": [{"uuid": f"GPU-{i}", "memory_total_mib": 81920} for i in range(gpus)]}
    cp.join("n1", inventory, dataplane_addr="127.0.0.1:9443", engines=frozenset({"sim"}))


def _deploy(
    cp: SchedulerRig, name: str, policy: ScalingPolicy, replicas: int = 1, **profile: Any
) -> None:
    cp.store.put_catalog_model(name, {"default": {**SLEEPY, **profile}})
    cp.store.deploy_model(name, profile="default", replicas=replicas)
    cp.store.set_scaling(name, policy.to_json(), replicas=replicas)


def test_an_idle_replica_sleeps_after_sleep_after_and_demand_wakes_it(cp: SchedulerRig) -> None:
    _join(cp)
    _deploy(cp, "m", ScalingPolicy(min=1, max=2, sleep_after=60))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    (replica,) = cp.store.list_replicas("m")
    _set(cp, replica.id, ShardState.READY)
    _orders(cp)
    now = [100.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    dozing.step({})
    now[0] += 59
    dozing.step({})
    assert _kinds(cp) == []  # not idle long enough
    now[0] += 1
    dozing.step({})
    assert _kinds(cp) == ["sleep_shard"]
    assert cp.store.get_replica(replica.id).state == ReplicaState.FALLING_ASLEEP
    _set(cp, replica.id, ShardState.ASLEEP)
    # Asleep, its GPU is free to placement.
    assert scheduler.fits_without(cp.store.get_model("m"), set())
    dozing.step({"m": 1})  # a request waits
    assert _kinds(cp) == ["wake_shard"]
    assert cp.store.get_replica(replica.id).state == ReplicaState.WAKING


def test_a_busy_replica_or_one_demand_needs_stays_awake(cp: SchedulerRig) -> None:
    _join(cp, 2)
    _deploy(cp, "m", ScalingPolicy(min=0, max=2, target_inflight=4, sleep_after=1), 2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    a, b = cp.store.list_replicas("m")
    _set(cp, a.id, ShardState.READY)
    _set(cp, b.id, ShardState.READY)
    cp.router.inflight[a.id] = 3
    _orders(cp)
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    dozing.step({"m": 3})
    now[0] += 10
    dozing.step({"m": 3})  # demand 3 asks for one awake: the idle one sleeps, not the busy
    kinds = _orders(cp)
    assert [k for k, _ in kinds] == ["sleep_shard"]
    assert cp.store.get_replica(b.id).state == ReplicaState.FALLING_ASLEEP
    assert cp.store.get_replica(a.id).state == ReplicaState.READY


def test_tokens_a_policy_weighs_keep_a_replica_awake(cp: SchedulerRig) -> None:
    # One request (it asks for one replica) carrying tokens that ask for two: neither idle
    # replica sleeps; without the tokens the idle one would.
    _join(cp, 2)
    policy = ScalingPolicy(min=0, max=2, target_inflight=4, target_tokens=1000, sleep_after=1)
    _deploy(cp, "m", policy, 2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    a, b = cp.store.list_replicas("m")
    _set(cp, a.id, ShardState.READY)
    _set(cp, b.id, ShardState.READY)
    cp.router.inflight[a.id] = 1
    _orders(cp)
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    dozing.step({"m": 1}, {"m": 1500})
    now[0] += 10
    dozing.step({"m": 1}, {"m": 1500})
    assert _orders(cp) == []
    dozing.step({"m": 1}, {"m": 500})  # the tokens ask for one now: the idle one sleeps
    assert [k for k, _ in _orders(cp)] == ["sleep_shard"]
    assert cp.store.get_replica(b.id).state == ReplicaState.FALLING_ASLEEP


def _asleep_with_an_occupant(cp: SchedulerRig, mine: str, theirs: str) -> tuple[Any, Any, Dozing]:
    """``mine`` asleep on n1's one GPU; ``theirs`` placed on that GPU meanwhile, ready."""
    _join(cp)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    (sleeper,) = cp.store.list_replicas(mine)
    _set(cp, sleeper.id, ShardState.ASLEEP)
    cp.store.set_replicas(theirs, 1)
    scheduler.reconcile()
    (occupant,) = cp.store.list_replicas(theirs)
    assert list(cp.store.list_shards(replica_id=occupant.id)[0].gpus) == ["GPU-0"]
    _set(cp, occupant.id, ShardState.READY)
    _orders(cp)
    return sleeper, occupant, Dozing(scheduler)


def test_a_lower_priority_gives_the_gpu_back_before_the_wake(cp: SchedulerRig) -> None:
    _deploy(cp, "vip", ScalingPolicy(min=0, max=1, priority="high", sleep_after=60))
    _deploy(cp, "low", ScalingPolicy(min=0, max=1, priority="low", sleep_after=60), 0)
    sleeper, occupant, dozing = _asleep_with_an_occupant(cp, "vip", "low")
    dozing.step({"vip": 1})
    assert _kinds(cp) == ["sleep_shard"]  # the idle occupant goes to sleep first
    assert cp.store.get_replica(occupant.id).state == ReplicaState.FALLING_ASLEEP
    events = [e.message for e in cp.store.list_events() if e.kind == "preempted"]
    assert events == [f"{sleeper.id} takes its GPUs of n1 back from {occupant.id} (low) to wake"]
    dozing.step({"vip": 1})
    assert _kinds(cp) == []  # not asleep yet: the wake waits
    _set(cp, occupant.id, ShardState.ASLEEP)
    dozing.step({"vip": 1})
    assert _kinds(cp) == ["wake_shard"]


def test_a_busy_lower_priority_is_retired_drained(cp: SchedulerRig) -> None:
    _deploy(cp, "vip", ScalingPolicy(min=0, max=1, priority="high", sleep_after=60))
    _deploy(cp, "low", ScalingPolicy(min=0, max=1, priority="low"), 0)  # cannot sleep
    cp.store.put_catalog_model("low", {"default": {"engine": "sim", "gpus": 1}})
    _sleeper, occupant, dozing = _asleep_with_an_occupant(cp, "vip", "low")
    dozing.step({"vip": 1})
    orders = _orders(cp)
    assert [k for k, _ in orders] == ["stop_shard"]
    stop: pb.StopShard = orders[0][1]
    assert stop.drain_s > 0
    assert cp.store.get_replica(occupant.id).state == ReplicaState.STOPPING
    assert cp.store.get_model("low").replicas == 0


def test_an_equal_priority_keeps_the_gpu_and_the_sleeper_gives_its_place_up(
    cp: SchedulerRig,
) -> None:
    _deploy(cp, "a", ScalingPolicy(min=0, max=1, sleep_after=60))
    _deploy(cp, "b", ScalingPolicy(min=0, max=1, sleep_after=60), 0)
    sleeper, occupant, dozing = _asleep_with_an_occupant(cp, "a", "b")
    dozing.step({"a": 1})
    assert _kinds(cp) == ["stop_shard"]
    assert cp.store.get_replica(sleeper.id).state == ReplicaState.STOPPING
    assert cp.store.get_replica(occupant.id).state == ReplicaState.READY


def test_the_sleepers_of_a_node_hold_at_most_half_its_memory_sglang_stays_awake(
    cp: SchedulerRig,
) -> None:
    # SGLang sleeps at its one level (weights kept): past the share it stays awake (the sim
    # and vLLM sleep at level 2 instead: test_dozing_hostmem).
    inventory = {
        "gpus": [{"uuid": f"GPU-{i}", "memory_total_mib": 81920} for i in range(3)],
        "memory_total_bytes": 64 << 30,  # 64 GiB: 32 GiB for sleeping weights
        "sources": {
            "models_root": "/srv/models",
            "entries": [{"name": "m", "size_bytes": 20 << 30, "dir": True}],
            "listed_depth": 3,
        },
    }
    cp.join("n1", inventory, dataplane_addr="127.0.0.1:9443", engines=frozenset({"sglang"}))
    policy = ScalingPolicy(min=0, max=3, sleep_after=1)
    _deploy(cp, "m", policy, 3, engine="sglang", source="m")
    scheduler = cp.scheduler()
    scheduler.reconcile()
    first, second, third = cp.store.list_replicas("m")
    for r in (first, second, third):
        _set(cp, r.id, ShardState.READY)
    # The first sleeps already, holding 20 GiB (as its engine said).
    _set(cp, first.id, ShardState.ASLEEP)
    for shard in cp.store.list_shards(replica_id=first.id):
        cp.store.update_shard(shard.id, sleep_level=1, host_memory_mib=20 * 1024)
    _orders(cp)
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    dozing.step({})
    now[0] += 5
    dozing.step({})
    # Another 20 GiB would pass 32: both stay awake.
    assert _kinds(cp) == []
    assert dozing.host_mib == {"m": 20 * 1024}
    assert cp.store.get_replica(second.id).state == ReplicaState.READY
