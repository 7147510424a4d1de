"""The pairing rule in every trial of placement, not just the placement itself: preemption
gives way only where the freed GPUs are on the pair's fabric, sleepers are retired for a pool
replica only on a node its pair may use, and the console's reasons per node say a node off
the pair's fabric is off it; a pool's sleeper wakes only beside its pair."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.server.fleet.dozing import Dozing
from llmgw.server.fleet.preemption import Preemption
from llmgw.server.gateway.capacity import Demand
from llmgw.server.store.states import ReplicaState, ShardState
from tests.unit.server.disagg_rig import GIB, deploy, join, nodes_of
from tests.unit.server.scheduler_rig import SchedulerRig, orders, set_state

LOW = ScalingPolicy(min=0, max=4, priority="low")
HIGH = ScalingPolicy(min=1, max=4, priority="high")


def _low(cp: SchedulerRig, **more: Any) -> str:
    """A replica of ``low`` (priority low, 1 GPU) placed and serving; its id."""
    cp.store.put_catalog_model("low", {"default": {"engine": "sim", "gpus": 1, **more}})
    cp.store.deploy_model("low", profile="default", replicas=1)
    cp.store.set_scaling("low", LOW.to_json(), replicas=1)
    cp.scheduler().reconcile()
    (replica,) = cp.store.list_replicas("low")
    set_state(cp, replica.id, ShardState.READY)
    return replica.id


def _serve_pools(cp: SchedulerRig) -> None:
    for pool in ("m#prefill", "m#decode"):
        for replica in cp.store.list_replicas(pool):
            set_state(cp, replica.id, ShardState.READY)


@pytest.mark.parametrize("fabric", ["ib-b", "ib-a"])
def test_preemption_gives_way_only_where_the_pair_may_use_the_room(
    cp: SchedulerRig, fabric: str
) -> None:
    # The low replica runs on n2 before m's pools come: then the pools fill n1 (ib-a).
    join(cp, "n2", 1, fabric)
    victim = _low(cp)
    join(cp, "n1", 2, "ib-a")
    deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert nodes_of(cp, "m#prefill") + nodes_of(cp, "m#decode") == ["n1", "n1"]
    _serve_pools(cp)
    cp.store.set_scaling("m#decode", HIGH.to_json(), replicas=2)
    scheduler.reconcile()
    assert "m#decode" in scheduler.unplaceable
    decode = cp.store.get_model("m#decode")
    Preemption(scheduler).step({"m#decode": Demand(inflight=5)})
    if fabric == "ib-b":
        # n2's GPU would fit a replica but not beside the prefill: nothing is taken from low.
        assert not scheduler.fits_without(decode, {victim})
        assert cp.store.get_replica(victim).state == ReplicaState.READY
        assert cp.store.get_model("low").replicas == 1
        assert not [e for e in cp.store.list_events() if e.kind == "preempting"]
    else:
        assert scheduler.fits_without(decode, {victim})
        assert cp.store.get_replica(victim).state == ReplicaState.STOPPING
        assert cp.store.get_model("low").replicas == 0


def test_sleepers_off_the_pairs_fabric_are_not_retired_for_a_pool_replica(
    cp: SchedulerRig,
) -> None:
    listed = {
        "models_root": "/srv/models",
        "entries": [{"name": "llama", "size_bytes": 40 * GIB, "dir": True}],
        "listed_depth": 3,
    }
    # n2 (ib-b): a level-1 sleeper of low holds 40 of its 64 GiB of host memory.
    join(cp, "n2", 2, "ib-b", memory_total_bytes=64 * GIB, sources=listed)
    sleeper = _low(cp, source="llama", sleep={"level": 1})
    set_state(cp, sleeper, ShardState.ASLEEP)
    for shard in cp.store.list_shards(replica_id=sleeper):
        cp.store.update_shard(shard.id, sleep_level=1)
    # n1 (ib-a): the pools, each replica declaring 32 GiB of host memory, fill it.
    join(cp, "n1", 2, "ib-a", memory_total_bytes=64 * GIB)
    deploy(cp, prefill=(1, 1), decode=(1, 1), host_memory="32GiB")
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert nodes_of(cp, "m#prefill") + nodes_of(cp, "m#decode") == ["n1", "n1"]
    cp.store.set_scaling("m#decode", HIGH.to_json(), replicas=2)
    scheduler.reconcile()
    # Retiring the sleeper would free n2's memory, but the pair may not use n2: kept.
    assert cp.removed == []
    assert cp.store.get_model("low").replicas == 1
    reason = scheduler.unplaceable["m#decode"].reason
    assert reason.startswith(
        "no node that shares a fabric with the replicas of m's pools (on n1) has room: "
    )


def test_the_reasons_per_node_name_the_pairs_fabric(cp: SchedulerRig) -> None:
    join(cp, "n1", 2, "ib-a")
    join(cp, "n2", 4, "ib-b")
    deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert nodes_of(cp, "m#prefill") + nodes_of(cp, "m#decode") == ["n1", "n1"]
    cp.store.set_replicas("m#decode", 2)
    scheduler.reconcile()
    assert "m#decode" in scheduler.unplaceable
    # n2 has four free GPUs: what keeps it off is the pairing, not its room.
    assert scheduler.refusals_on("n2") == [
        ("m#decode", "shares no fabric with the replicas of m's pools (on n1)")
    ]
    assert scheduler.refusals_on("n1") == [("m#decode", "0 of 2 GPUs free, needs 1")]


def test_a_pair_with_no_home_gives_each_node_its_part(cp: SchedulerRig) -> None:
    join(cp, "n1", 1, "ib-a")
    join(cp, "n2", 1, "ib-b")
    deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert set(scheduler.unplaceable) == {"m#prefill", "m#decode"}
    assert scheduler.refusals_on("n2") == [
        ("m#decode", "room for 1 of 1 decode, 0 of 1 prefill"),
        ("m#prefill", "room for 1 of 1 prefill, 0 of 1 decode"),
    ]


@pytest.mark.parametrize("moved", [False, True])
def test_a_pool_sleeper_wakes_only_beside_its_pair(cp: SchedulerRig, moved: bool) -> None:
    join(cp, "n1", 1, "ib-a")
    join(cp, "n2", 1, "ib-a")
    deploy(cp, prefill=(1, 1), decode=(1, 1), sleep={"level": 1})
    policy = ScalingPolicy(min=0, max=1, sleep_after=60)
    cp.store.set_scaling("m#decode", policy.to_json(), replicas=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serve_pools(cp)
    (decode,) = cp.store.list_replicas("m#decode")
    (shard,) = cp.store.list_shards(replica_id=decode.id)
    set_state(cp, decode.id, ShardState.ASLEEP)
    if moved:
        # While it slept its node was moved to another fabric: the prefill cannot reach it.
        join(cp, shard.node_id, 1, "ib-b")
    orders(cp)
    Dozing(scheduler).step({"m#decode": 1})
    sent = [kind for kind, _ in orders(cp)]
    state = cp.store.get_replica(decode.id).state
    if moved:
        assert "wake_shard" not in sent and state == ReplicaState.STOPPING
        why = f"cannot wake on {shard.node_id}: it shares no fabric with the replicas of m's"
        assert any(why in e.message for e in cp.store.list_events()), cp.store.list_events()
    else:
        assert sent == ["wake_shard"] and state == ReplicaState.WAKING
