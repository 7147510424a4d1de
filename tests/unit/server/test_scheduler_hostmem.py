"""The scheduler and host memory: a profile's ``host_memory`` reaches placement, a node whose
sleepers hold too much is refused with the figures, the lowest-priority level-1 sleepers of
the node are retired for it (none of a higher priority), and a profile without it is placed
as before."""

from __future__ import annotations

from typing import Any

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.server.store.states import ShardState
from tests.unit.server.scheduler_rig import SchedulerRig
from tests.unit.server.scheduler_rig import order_kinds as _kinds
from tests.unit.server.scheduler_rig import set_state as _set

GIB = 1 << 30


def _node(cp: SchedulerRig) -> None:
    """n1: two GPUs, 64 GiB of memory, the folder ``llama`` (40 GiB) listed."""
    inventory: dict[str, Any] = {
        "gpus": [{"uuid": f"GPU-{i}", "memory_total_mib": 81920} for i in range(2)],
        "memory_total_bytes": 64 * GIB,
        "sources": {
            "models_root": "/srv/models",
            "entries": [{"name": "llama", "size_bytes": 40 * GIB, "dir": True}],
            "listed_depth": 3,
        },
    }
    cp.join("n1", inventory, dataplane_addr="127.0.0.1:9443", engines=frozenset({"sim"}))


def _sleeper(cp: SchedulerRig, priority: str = "low") -> str:
    """A replica of ``low`` asleep at level 1 on n1 (its engine said nothing: it holds its
    weights, 40 GiB)."""
    profile = {"engine": "sim", "gpus": 1, "source": "llama", "sleep": {"level": 1}}
    cp.store.put_catalog_model("low", {"default": profile})
    cp.store.deploy_model("low", profile="default", replicas=1)
    policy = ScalingPolicy(min=0, max=1, priority=priority, sleep_after=60)
    cp.store.set_scaling("low", policy.to_json(), replicas=1)
    cp.scheduler().reconcile()
    (replica,) = cp.store.list_replicas("low")
    _set(cp, replica.id, ShardState.ASLEEP)
    for shard in cp.store.list_shards(replica_id=replica.id):
        cp.store.update_shard(shard.id, sleep_level=1)
    _kinds(cp)
    return replica.id


def _deploy(cp: SchedulerRig, name: str, policy: ScalingPolicy | None = None, **more: Any) -> None:
    cp.store.put_catalog_model(name, {"default": {"engine": "sim", "gpus": 1, **more}})
    cp.store.deploy_model(name, profile="default", replicas=1)
    if policy is not None:
        cp.store.set_scaling(name, policy.to_json(), replicas=1)


def test_the_lowest_priority_sleeper_is_retired_for_a_replica_that_needs_its_memory(
    cp: SchedulerRig,
) -> None:
    _node(cp)
    sleeper = _sleeper(cp)
    _deploy(cp, "big", host_memory=32 * 1024)  # stored form: MiB
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert cp.removed == [sleeper]
    assert _kinds(cp) == ["stop_shard"]
    assert cp.store.get_model("low").replicas == 0  # not started again awake
    (placed,) = cp.store.list_replicas("big")
    assert cp.store.list_shards(replica_id=placed.id)[0].node_id == "n1"
    assert "big" not in scheduler.unplaceable
    (event,) = [e for e in cp.store.list_events() if e.kind == "replica_removed"]
    assert event.message == (
        "retired asleep for a replica of big: it held 40 GiB of n1's host memory, which "
        "needs 32 GiB"
    )


def test_a_sleeper_of_a_higher_priority_is_kept_and_the_refusal_says_why(
    cp: SchedulerRig,
) -> None:
    _node(cp)
    sleeper = _sleeper(cp, priority="high")
    _deploy(cp, "big", ScalingPolicy(min=1, max=1, priority="normal"), host_memory="32GiB")
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert cp.removed == [] and cp.store.list_replicas("big") == []
    assert cp.store.get_replica(sleeper).state == "asleep"
    assert scheduler.unplaceable["big"].reason == (
        "n1: sleepers hold 40 GiB of 64 GiB host memory; needs 32 GiB"
    )
    assert scheduler.refusals_on("n1") == [
        ("big", "sleepers hold 40 GiB of 64 GiB host memory; needs 32 GiB")
    ]


def test_a_profile_without_host_memory_is_placed_beside_the_sleeper(cp: SchedulerRig) -> None:
    _node(cp)
    sleeper = _sleeper(cp)
    _deploy(cp, "plain")
    cp.scheduler().reconcile()
    assert cp.removed == []
    assert cp.store.get_replica(sleeper).state == "asleep"
    assert len(cp.store.list_replicas("plain")) == 1


def test_a_need_the_sleepers_leave_room_for_retires_none(cp: SchedulerRig) -> None:
    _node(cp)
    _sleeper(cp)
    _deploy(cp, "small", host_memory=16 * 1024)  # 64 - 40 = 24 GiB free
    cp.scheduler().reconcile()
    assert cp.removed == []
    assert len(cp.store.list_replicas("small")) == 1


def test_no_sleeper_is_retired_where_that_would_not_make_room(cp: SchedulerRig) -> None:
    _node(cp)
    sleeper = _sleeper(cp)
    _deploy(cp, "huge", host_memory="70GiB")  # more than the node's 64 GiB
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert cp.removed == [] and cp.store.get_replica(sleeper).state == "asleep"
    assert scheduler.unplaceable["huge"].reason == (
        "n1: sleepers hold 40 GiB of 64 GiB host memory; needs 70 GiB"
    )


def test_a_sleeper_of_the_model_itself_is_not_retired_for_it(cp: SchedulerRig) -> None:
    _node(cp)
    sleeper = _sleeper(cp)
    model = cp.store.get_model("low")
    profile = {**model.profiles["default"], "host_memory": 32 * 1024}
    cp.store.put_catalog_model("low", {"default": profile})
    cp.store.deploy_model("low", profile="default", replicas=2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert cp.removed == [] and cp.store.get_replica(sleeper).state == "asleep"
    assert "sleepers hold 40 GiB of 64 GiB host memory" in scheduler.unplaceable["low"].reason
