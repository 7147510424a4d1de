"""The scheduler and blocked GPUs: a replica on a cordoned GPU moves make-before-break, one
on an unhealthy GPU is rebuilt elsewhere at once, and the rest of the node keeps serving."""

from __future__ import annotations

from typing import Any

from llmgw.server.fleet.scheduler import Scheduler
from tests.unit.server.scheduler_rig import SchedulerRig

XID = "XID 79: GPU has fallen off the bus"


def _inventory(gpus: int, health: dict[int, str] | None = None) -> dict[str, Any]:
    health = health or {}
    return {
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{i}",
                "memory_total_mib": 81920,
                **({"health": health[i]} if i in health else {}),
            }
            for i in range(gpus)
        ]
    }


def _setup(cp: SchedulerRig, gpus: int, replicas: int = 1) -> Scheduler:
    cp.join("n1", _inventory(gpus), dataplane_addr="10.0.0.1:9443", engines=frozenset({"sim"}))
    profile = {"engine": "sim", "gpus": 1}
    cp.store.put_catalog_model("m", {"default": profile})
    cp.store.deploy_model("m", profile="default", replicas=replicas)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    return scheduler


def _on(cp: SchedulerRig) -> dict[str, list[str]]:
    """replica id -> the GPUs its shard holds."""
    return {sh.replica_id: list(sh.gpus) for sh in cp.store.list_shards()}


def _events(cp: SchedulerRig, kind: str) -> list[str]:
    return [e.message for e in reversed(cp.store.list_events(limit=100)) if e.kind == kind]


def test_a_replica_on_a_cordoned_gpu_moves_before_it_stops(cp: SchedulerRig) -> None:
    scheduler = _setup(cp, gpus=2)
    [(original, gpus)] = _on(cp).items()
    assert gpus == ["GPU-0"]
    cp.router.routable.add(original)
    cp.store.cordon_gpus("n1", ["GPU-0"], reason="fan noise", actor="alice")
    scheduler.reconcile()
    placed = _on(cp)
    assert placed[original] == ["GPU-0"]  # still serving until its replacement is
    [replacement] = [r for r in placed if r != original]
    assert placed[replacement] == ["GPU-1"]
    assert _events(cp, "gpu_moving") == [f"{original} -> {replacement} (off a cordoned GPU)"]
    scheduler.reconcile()
    assert cp.removed == []  # the replacement is not routable yet
    cp.router.routable.add(replacement)
    scheduler.reconcile()
    assert cp.removed == [original]
    assert _on(cp) == {replacement: ["GPU-1"]}
    assert _events(cp, "replica_removed") == ["moved off a cordoned GPU of n1"]
    scheduler.reconcile()
    assert list(_on(cp)) == [replacement]  # nothing more to move, nothing placed on GPU-0


def test_with_no_room_the_replica_stays_and_the_reason_names_the_gpu(cp: SchedulerRig) -> None:
    scheduler = _setup(cp, gpus=1)
    [original] = _on(cp)
    cp.router.routable.add(original)
    cp.store.cordon_gpus("n1", ["GPU-0"], reason="", actor="alice")
    scheduler.reconcile()
    assert list(_on(cp)) == [original]
    assert cp.removed == []
    assert scheduler.gpu_blocked["n1"].startswith(f"cannot move {original} off a cordoned GPU: ")
    assert "n1: 0 of 1 GPUs free (GPU 0 cordoned), needs 1" in scheduler.gpu_blocked["n1"]
    cp.store.uncordon_gpus("n1", ["GPU-0"])
    scheduler.reconcile()
    assert scheduler.gpu_blocked == {}


def test_a_replica_on_an_unhealthy_gpu_is_rebuilt_elsewhere(cp: SchedulerRig) -> None:
    scheduler = _setup(cp, gpus=3, replicas=2)
    before = _on(cp)
    on_gpu0 = next(r for r, g in before.items() if g == ["GPU-0"])
    other = next(r for r in before if r != on_gpu0)
    cp.store.upsert_node(
        "n1",
        dataplane_addr="10.0.0.1:9443",
        agent_version="0.1.0",
        inventory=_inventory(3, {0: XID}),
        connected=True,
    )
    scheduler.gpus.note("n1", cp.store.get_node("n1").inventory)
    scheduler.reconcile()
    assert cp.removed == [on_gpu0]
    after = _on(cp)
    assert after[other] == before[other]  # the rest of the node keeps serving
    [rebuilt] = [r for r in after if r != other]
    assert after[rebuilt] == ["GPU-2"]
    assert _events(cp, "replica_removed") == [
        f"GPU 0 (GPU-0) of n1 is unhealthy: {XID}; rebuilding it elsewhere"
    ]


def test_unhealthy_gpus_are_read_from_the_store_by_a_fresh_scheduler(cp: SchedulerRig) -> None:
    cp.join(
        "n1",
        _inventory(2, {1: XID}),
        dataplane_addr="10.0.0.1:9443",
        engines=frozenset({"sim"}),
    )
    cp.store.put_catalog_model("m", {"default": {"engine": "sim", "gpus": 2}})
    cp.store.deploy_model("m", profile="default", replicas=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert _on(cp) == {}
    assert f"n1: 1 of 2 GPUs free (GPU 1 unhealthy: {XID}), needs 2" in (
        scheduler.unplaceable["m"].reason
    )


def test_each_pass_counts_the_gpus_by_state(cp: SchedulerRig) -> None:
    cp.join(
        "n1",
        _inventory(3, {2: XID}),
        dataplane_addr="10.0.0.1:9443",
        engines=frozenset({"sim"}),
    )
    cp.join("n2", _inventory(2), dataplane_addr="10.0.0.2:9443", engines=frozenset({"sim"}))
    cp.store.cordon_gpus("n1", ["GPU-0", "GPU-2"], reason="", actor="alice")
    told: list[dict[str, int]] = []
    scheduler = cp.scheduler()
    scheduler.gpu_counts = lambda counts: told.append(dict(counts))
    scheduler.reconcile()
    # GPU-2 is unhealthy and cordoned: counted once, as unhealthy.
    assert told[-1] == {"healthy": 3, "unhealthy": 1, "cordoned": 1}


def test_a_moving_replica_whose_gpu_turns_unhealthy_is_dropped_at_once(cp: SchedulerRig) -> None:
    scheduler = _setup(cp, gpus=2)
    [original] = _on(cp)
    cp.router.routable.add(original)
    cp.store.cordon_gpus("n1", ["GPU-0"], reason="", actor="alice")
    scheduler.reconcile()
    [replacement] = [r for r in _on(cp) if r != original]
    inventory = _inventory(2, {0: XID})
    cp.store.upsert_node(
        "n1",
        dataplane_addr="10.0.0.1:9443",
        agent_version="0.1.0",
        inventory=inventory,
        connected=True,
    )
    scheduler.gpus.note("n1", inventory)
    scheduler.reconcile()
    assert cp.removed == [original]
    assert _on(cp) == {replacement: ["GPU-1"]}
    assert scheduler.moves == {} and scheduler.move_whys == {} and scheduler.move_nodes == {}
