"""A drain moves a disaggregated model's pair together: off a node that hosts both pools alone
(no fabric), the whole pair goes to a node with room for both, every replacement routable
before any old replica stops; with no such node the drain is blocked, saying why, every old
replica serving; off a node that shares a fabric, each replica moves beside the others."""

from __future__ import annotations

from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.store.states import ShardState
from tests.unit.server.disagg_rig import deploy, join, nodes_of
from tests.unit.server.scheduler_rig import SchedulerRig, set_state


def _pools(cp: SchedulerRig) -> list[str]:
    return nodes_of(cp, "m#prefill") + nodes_of(cp, "m#decode")


def _serve_new(cp: SchedulerRig, scheduler: Scheduler) -> None:
    """Every replacement in a move becomes ready (and routable)."""
    for replacement in scheduler.moves.values():
        set_state(cp, replacement, ShardState.READY)


def _ready_all(cp: SchedulerRig) -> None:
    for pool in ("m#prefill", "m#decode"):
        for replica in cp.store.list_replicas(pool):
            set_state(cp, replica.id, ShardState.READY)


def test_a_pair_alone_on_a_draining_node_moves_as_a_whole(cp: SchedulerRig) -> None:
    join(cp, "n1", 3, None)
    deploy(cp, prefill=(1, 1), decode=(1, 2))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert _pools(cp) == ["n1", "n1", "n1"]
    _ready_all(cp)
    old = {r.id for p in ("m#prefill", "m#decode") for r in cp.store.list_replicas(p)}
    # n2 (no fabric either) has room for the whole pair; n3 would take one replica only.
    join(cp, "n2", 3, None)
    join(cp, "n3", 1, None)
    cp.store.set_node_draining("n1", True)
    scheduler.reconcile()
    assert len(scheduler.moves) == 1  # the first replacement, where both pools fit
    scheduler.reconcile()
    scheduler.reconcile()
    assert len(scheduler.moves) == 3  # the pair's replicas follow, pass after pass
    assert sorted(_pools(cp)) == ["n1", "n1", "n1", "n2", "n2", "n2"]
    # Two replacements ready: no old replica stops while one of the pair is not.
    first, *rest = list(scheduler.moves.values())
    for replacement in rest:
        set_state(cp, replacement, ShardState.READY)
    scheduler.reconcile()
    assert cp.removed == []
    set_state(cp, first, ShardState.READY)
    scheduler.reconcile()
    assert set(cp.removed) == old
    assert _pools(cp) == ["n2", "n2", "n2"]
    assert scheduler.drain_progress("n1")["replicas_left"] == []
    assert scheduler.drain_blocked == {}


def test_a_pair_with_nowhere_to_go_together_blocks_the_drain_saying_why(
    cp: SchedulerRig,
) -> None:
    join(cp, "n1", 2, None)
    deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _ready_all(cp)
    # Two nodes without a fabric, each with room for one replica: neither takes the pair.
    join(cp, "n2", 1, None)
    join(cp, "n3", 1, None)
    cp.store.set_node_draining("n1", True)
    scheduler.reconcile()
    assert scheduler.moves == {}
    assert _pools(cp) == ["n1", "n1"]  # nothing split, both serving
    blocked = scheduler.drain_progress("n1")["blocked"]
    assert isinstance(blocked, str)
    assert "no fabric with room for both pools of m (1 " in blocked
    assert "n2: room for 1 of 1 " in blocked and "n3: room for 1 of 1 " in blocked
    assert cp.removed == []


def test_a_pair_blocked_halfway_keeps_every_old_replica_serving(cp: SchedulerRig) -> None:
    join(cp, "n1", 2, None)
    deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _ready_all(cp)
    join(cp, "n2", 2, None)
    cp.store.set_node_draining("n1", True)
    scheduler.reconcile()
    assert len(scheduler.moves) == 1
    # Meanwhile an operator cordons n2's other GPU: the second of the pair has no room.
    (taken,) = [g for s in cp.store.list_shards(node_id="n2") for g in s.gpus]
    free = next(f"GPU-n2-{i}" for i in range(2) if f"GPU-n2-{i}" != taken)
    cp.store.cordon_gpus("n2", [free], reason="fan", actor="alice")
    scheduler.reconcile()
    _serve_new(cp, scheduler)
    scheduler.reconcile()
    assert cp.removed == []  # the moved one waits for its sibling: n1's pair serves on
    blocked = scheduler.drain_progress("n1")["blocked"]
    assert isinstance(blocked, str) and blocked.startswith("cannot move ")
    assert "shares a fabric with the replicas of m's pools (on n2)" in blocked


def test_a_pool_replica_on_a_fabric_moves_beside_its_pair(cp: SchedulerRig) -> None:
    join(cp, "n1", 1, "ib-a")
    join(cp, "n2", 1, "ib-a")
    deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert sorted(_pools(cp)) == ["n1", "n2"]
    _ready_all(cp)
    # n3 is on the pair's fabric, n4 (more room, bin-packing's pick otherwise) is not.
    join(cp, "n3", 1, "ib-a")
    join(cp, "n4", 1, "ib-b")
    cp.store.set_node_draining("n1", True)
    scheduler.reconcile()
    (replacement,) = scheduler.moves.values()
    (shard,) = cp.store.list_shards(replica_id=replacement)
    assert shard.node_id == "n3"
    set_state(cp, replacement, ShardState.READY)
    scheduler.reconcile()
    assert len(cp.removed) == 1
    assert sorted(_pools(cp)) == ["n2", "n3"]


def test_a_cordon_under_a_pair_alone_on_a_full_node_says_to_drain_it(cp: SchedulerRig) -> None:
    join(cp, "n1", 2, None)
    deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _ready_all(cp)
    join(cp, "n2", 2, None)  # room for the pair, but not for one replica alone
    (prefill,) = cp.store.list_replicas("m#prefill")
    (shard,) = cp.store.list_shards(replica_id=prefill.id)
    cp.store.cordon_gpus("n1", list(shard.gpus), reason="fan", actor="alice")
    scheduler.reconcile()
    assert scheduler.moves == {}
    blocked = scheduler.gpu_blocked["n1"]
    assert blocked.startswith(f"cannot move {prefill.id} off a cordoned GPU: no node that shares")
    assert blocked.endswith(
        "(its pair runs on n1 alone: free a GPU there, or drain n1 to move the pair as a whole)"
    )
    # As told: the drain moves the pair, off the cordoned GPU with the rest.
    cp.store.set_node_draining("n1", True)
    scheduler.reconcile()
    scheduler.reconcile()
    _serve_new(cp, scheduler)
    scheduler.reconcile()
    assert _pools(cp) == ["n2", "n2"]
