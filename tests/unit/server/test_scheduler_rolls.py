"""A profile switch of a deployed model: the scheduler replaces each replica of an older
profile one at a time, the replacement routable before the original stops; with no room for
one more it gives up one old replica only while others serve, and a single replica waits,
with the reason shown."""

from __future__ import annotations

from llmgw.server.fleet.scheduler import Scheduler
from tests.unit.server.scheduler_rig import SchedulerRig


def _join(cp: SchedulerRig, node_id: str, gpus: int) -> None:
    inventory = {
        "gpus": [{"uuid": f"GPU-{node_id}-{i}", "memory_total_mib": 81920} for i in range(gpus)]
    }
    cp.join(
        node_id,
        inventory,
        dataplane_addr=f"127.0.0.1:{9443 + len(cp.sessions)}",
        session_addr="127.0.0.1:9443",
        engines=frozenset({"sim"}),
    )


PROFILES = {
    "a": {"engine": "sim", "gpus": 1, "params": {"seed": "1"}},
    "b": {"engine": "sim", "gpus": 1, "params": {"seed": "2"}},
}


def _profiles(cp: SchedulerRig) -> list[str | None]:
    return sorted(r.profile for r in cp.store.list_replicas("m"))


def _all_ready(cp: SchedulerRig) -> None:
    cp.router.routable = {r.id for r in cp.store.list_replicas("m")}


def _roll_to_b(cp: SchedulerRig, scheduler: Scheduler, replicas: int) -> int:
    """Switch m to profile b and run passes (new replicas turn routable between passes) until
    none of profile a is left; returns the fewest routable replicas seen during the roll."""
    cp.store.deploy_model("m", profile="b", replicas=replicas)
    fewest = replicas
    for _ in range(20):
        scheduler.reconcile()
        fewest = min(fewest, len(cp.router.routable))
        if _profiles(cp) == ["b"] * replicas and not scheduler.rolls:
            return fewest
        _all_ready(cp)
    raise AssertionError(f"the roll did not finish: {_profiles(cp)}, rolls {scheduler.rolls}")


def test_with_room_every_replica_is_replaced_before_it_stops(cp: SchedulerRig) -> None:
    _join(cp, "n1", 4)
    cp.store.put_catalog_model("m", PROFILES)
    cp.store.deploy_model("m", profile="a", replicas=2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _all_ready(cp)
    old = {r.id for r in cp.store.list_replicas("m")}
    assert _profiles(cp) == ["a", "a"]
    cp.store.deploy_model("m", profile="b", replicas=2)
    scheduler.reconcile()
    # One replacement at a time, the originals untouched until it serves.
    assert len(scheduler.rolls) == 1 and set(scheduler.rolls) <= old
    assert _profiles(cp) == ["a", "a", "b"] and cp.removed == []
    assert "m" in scheduler.rolling
    assert _roll_to_b(cp, scheduler, 2) == 2  # never fewer than two serving
    assert set(cp.removed) == old
    assert "m" not in scheduler.rolling
    events = [e.kind for e in cp.store.list_events()]
    assert events.count("profile_replacing") == 2 and events.count("profile_replaced") == 2


def test_without_room_one_old_replica_gives_way_while_another_serves(cp: SchedulerRig) -> None:
    _join(cp, "n1", 1)
    _join(cp, "n2", 1)
    cp.store.put_catalog_model("m", PROFILES)
    cp.store.deploy_model("m", profile="a", replicas=2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _all_ready(cp)
    assert _profiles(cp) == ["a", "a"]
    fewest = _roll_to_b(cp, scheduler, 2)
    assert fewest == 1  # one serves while the other's GPU goes to its successor


def test_a_single_replica_without_room_keeps_serving_and_says_why(cp: SchedulerRig) -> None:
    _join(cp, "n1", 1)
    cp.store.put_catalog_model("m", PROFILES)
    cp.store.deploy_model("m", profile="a", replicas=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    _all_ready(cp)
    cp.store.deploy_model("m", profile="b", replicas=1)
    for _ in range(3):
        scheduler.reconcile()
    assert _profiles(cp) == ["a"] and cp.removed == []
    assert "m" in scheduler.rolling
    assert scheduler.unplaceable["m"].reason == "n1: 0 of 1 GPUs free, needs 1"
    # Room appears (another node joins): the roll goes on and finishes.
    _join(cp, "n2", 1)
    assert _roll_to_b(cp, scheduler, 1) == 1


def test_an_old_replica_that_serves_nothing_yet_is_stopped_at_once(cp: SchedulerRig) -> None:
    _join(cp, "n1", 4)
    cp.store.put_catalog_model("m", PROFILES)
    cp.store.deploy_model("m", profile="a", replicas=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    (starting,) = cp.store.list_replicas("m")  # never became routable
    cp.store.deploy_model("m", profile="b", replicas=1)
    scheduler.reconcile()
    assert cp.removed == [starting.id]
    assert _profiles(cp) == ["b"] and scheduler.rolls == {}
