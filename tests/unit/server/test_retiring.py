"""A scale-down of a model that scales by demand retires its replica make-before-break: out of
routing at once, its rows kept (stopping, their GPUs held) while its agent drains and stops
it, gone when the agent says it exited; a new leader takes over what it finds stopping, and
a retirement no agent can confirm is removed."""

from __future__ import annotations

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet import retiring
from llmgw.server.store.states import ReplicaState, ShardState
from tests.unit.server.scheduler_rig import SchedulerRig


def _join(cp: SchedulerRig, node_id: str = "n1", gpus: int = 2) -> None:
    inventory = {
        "gpus": [{"uuid": f"GPU-{node_id}-{i}", "memory_total_mib": 81920} for i in range(gpus)]
    }
    cp.join(node_id, inventory, dataplane_addr="127.0.0.1:9443", engines=frozenset({"sim"}))


def _deploy(cp: SchedulerRig, replicas: int, policy: ScalingPolicy | None) -> None:
    cp.store.put_catalog_model("m", {"default": {"engine": "sim", "gpus": 1}})
    cp.store.deploy_model("m", profile="default", replicas=replicas)
    cp.store.set_scaling("m", policy.to_json() if policy else {}, replicas=replicas)


def _stops(cp: SchedulerRig) -> list[pb.StopShard]:
    out = []
    for session in cp.sessions.values():
        while not session.queue.empty():
            msg = session.queue.get_nowait()
            if msg is not None and msg.WhichOneof("msg") == "stop_shard":
                out.append(msg.stop_shard)
    return out


def _serving(cp: SchedulerRig) -> None:
    for shard in cp.store.list_shards():
        cp.store.update_shard(shard.id, state=ShardState.READY)
    for replica in cp.store.list_replicas("m"):
        cp.store.set_replica_state(replica.id, ReplicaState.READY)
    cp.router.routable = {r.id for r in cp.store.list_replicas("m")}


def test_a_scale_down_by_demand_drains_before_it_stops(cp: SchedulerRig) -> None:
    _join(cp)
    _deploy(cp, 2, ScalingPolicy(min=0, max=2))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    _stops(cp)
    cp.store.set_replicas("m", 1)
    scheduler.reconcile()
    stopping = [r for r in cp.store.list_replicas("m") if r.state == ReplicaState.STOPPING]
    assert len(stopping) == 1 and cp.removed == []
    (shard,) = cp.store.list_shards(replica_id=stopping[0].id)
    assert shard.state == ShardState.STOPPING and shard.gpus  # its GPU held while it drains
    (order,) = _stops(cp)
    assert order.shard_id == shard.id
    assert order.drain_s == retiring.DRAIN_TIMEOUT and order.grace_s == retiring.STOP_GRACE
    # Passes while it drains neither count it nor replace it.
    scheduler.reconcile()
    assert len(cp.store.list_replicas("m")) == 2 and _stops(cp) == []
    scheduler.retirements.shard_ended(cp.store.get_shard(shard.id))
    assert [r.id for r in cp.store.list_replicas("m")] != [stopping[0].id]
    assert len(cp.store.list_replicas("m")) == 1
    events = {e.kind: e.message for e in cp.store.list_events()}
    assert events["replica_retiring"] == "scaled m to 1; draining its requests"
    assert events["replica_removed"] == "scaled m to 1; its requests ended"


def test_a_fixed_count_scales_down_as_before(cp: SchedulerRig) -> None:
    _join(cp)
    _deploy(cp, 2, None)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    _stops(cp)
    cp.store.deploy_model("m", profile="default", replicas=1)
    scheduler.reconcile()
    assert len(cp.removed) == 1 and len(cp.store.list_replicas("m")) == 1
    (order,) = _stops(cp)
    assert order.drain_s == 0


def test_a_new_leader_takes_over_what_is_stopping(cp: SchedulerRig) -> None:
    _join(cp)
    _deploy(cp, 2, ScalingPolicy(min=0, max=2))
    first = cp.scheduler()
    first.reconcile()
    _serving(cp)
    cp.store.set_replicas("m", 1)
    first.reconcile()
    _stops(cp)
    second = cp.scheduler()  # the next leader, on the same store
    second.reconcile()
    (order,) = _stops(cp)  # told again: the first order may not have reached the agent
    assert order.drain_s == retiring.DRAIN_TIMEOUT
    assert len(second.retirements.pending) == 1
    assert cp.removed == []


def test_a_retirement_whose_node_is_away_is_removed(cp: SchedulerRig) -> None:
    _join(cp)
    _deploy(cp, 2, ScalingPolicy(min=0, max=2))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _serving(cp)
    cp.store.set_replicas("m", 1)
    scheduler.reconcile()
    (retired,) = scheduler.retirements.pending
    del cp.sessions["n1"]
    scheduler.reconcile()
    assert cp.removed == [retired]
    assert scheduler.retirements.pending == {}


def test_a_retirement_no_agent_confirms_is_removed_after_the_drain(cp: SchedulerRig) -> None:
    _join(cp)
    _deploy(cp, 2, ScalingPolicy(min=0, max=2))
    scheduler = cp.scheduler()
    now = [100.0]
    scheduler.retirements.clock = lambda: now[0]
    scheduler.reconcile()
    _serving(cp)
    cp.store.set_replicas("m", 1)
    scheduler.reconcile()
    (retired,) = scheduler.retirements.pending
    now[0] += retiring.GIVE_UP_AFTER - 1
    scheduler.reconcile()
    assert cp.removed == []
    now[0] += 2
    scheduler.reconcile()
    assert cp.removed == [retired]
