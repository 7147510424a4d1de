"""The host memory of sleeping replicas in the planner's sleep (llmgw.server.fleet.dozing with
llmgw.server.fleet.hostmem): what a replica will hold asleep is its model's sleepers' word,
else its weights' size as the node lists them; past the node's share an engine that can
sleeps at level 2 instead (the event says why); the /metrics gauge per node."""

from __future__ import annotations

from typing import Any

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.dozing import Dozing
from llmgw.server.fleet.hostmem import sleepers, weights_mib
from llmgw.server.store.states import ReplicaState, ShardState
from tests.unit.server.scheduler_rig import SchedulerRig
from tests.unit.server.scheduler_rig import orders as _orders
from tests.unit.server.scheduler_rig import set_state as _set

GIB = 1 << 30


def _node(cp: SchedulerRig, *, gpus: int = 3, weights: int = 20 * GIB) -> None:
    """n1: 64 GiB of memory (32 for sleeping weights) and the folder ``llama`` listed, its
    own size left out (an agent that reports only files): ``weights`` in two files."""
    inventory: dict[str, Any] = {
        "gpus": [{"uuid": f"GPU-{i}", "memory_total_mib": 81920} for i in range(gpus)],
        "memory_total_bytes": 64 * GIB,
        "sources": {
            "models_root": "/srv/models",
            "entries": [
                {"name": "llama", "size_bytes": 0, "dir": True},
                {"name": "llama/a.safetensors", "size_bytes": weights // 2, "dir": False},
                {"name": "llama/b.safetensors", "size_bytes": weights - weights // 2},
                {"name": "other", "size_bytes": 99 * GIB, "dir": False},
            ],
            "listed_depth": 3,
        },
    }
    cp.join("n1", inventory, dataplane_addr="127.0.0.1:9443", engines=frozenset({"sim"}))


def _ready(cp: SchedulerRig, name: str, count: int) -> tuple[Any, list[Any]]:
    profile = {"engine": "sim", "gpus": 1, "source": "llama", "sleep": {"level": 1}}
    cp.store.put_catalog_model(name, {"default": profile})
    cp.store.deploy_model(name, profile="default", replicas=count)
    policy = ScalingPolicy(min=0, max=count, sleep_after=1)
    cp.store.set_scaling(name, policy.to_json(), replicas=count)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    replicas = cp.store.list_replicas(name)
    for r in replicas:
        _set(cp, r.id, ShardState.READY)
    return scheduler, replicas


def _asleep(cp: SchedulerRig, replica_id: str, level: int = 1, said: int = 0) -> None:
    _set(cp, replica_id, ShardState.ASLEEP)
    for shard in cp.store.list_shards(replica_id=replica_id):
        cp.store.update_shard(shard.id, sleep_level=level, host_memory_mib=said)


def _sleep_levels(cp: SchedulerRig) -> list[int]:
    return [order.level for kind, order in _orders(cp) if kind == "sleep_shard"]


def _steps(dozing: Dozing, now: list[float]) -> None:
    dozing.step({})
    now[0] += 5
    dozing.step({})


def test_the_weights_size_is_the_estimate_before_any_engine_said(cp: SchedulerRig) -> None:
    _node(cp)
    scheduler, (first, _second, _third) = _ready(cp, "m", 3)
    inventory = cp.store.get_node("n1").inventory
    assert weights_mib(inventory, {"source": "llama"}) == 20 * 1024  # the files summed
    assert weights_mib(inventory, {"source": "missing"}) == 0
    assert weights_mib(inventory, {"source": {"url": "https://h/f.gguf", "sha256": "a"}}) == 0
    # Asleep at level 1, its engine (as vLLM) said nothing: it holds its weights' size.
    _asleep(cp, first.id)
    (held,) = sleepers(cp.store)
    assert (held.replica_id, held.node_id, held.level, held.mib) == (first.id, "n1", 1, 20480)
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    _steps(dozing, now)
    # 20 GiB held and 20 more would pass 32: both idle ones sleep at level 2 (weights dropped).
    assert _sleep_levels(cp) == [2, 2]
    assert dozing.host_mib == {}  # nothing learnt: no engine said


def test_the_engines_word_comes_before_the_estimate(cp: SchedulerRig) -> None:
    _node(cp)
    scheduler, (first, _second, _third) = _ready(cp, "m", 3)
    # Its engine said 4 GiB (a quantised copy, say): the next ones will hold as much.
    _asleep(cp, first.id, said=4 * 1024)
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    _steps(dozing, now)
    assert dozing.host_mib == {"m": 4 * 1024}
    assert _sleep_levels(cp) == [1, 1]  # 4 held, 4 more each: within 32 (the step's view)
    assert cp.store.learnt_host_memory() == {"m": 4 * 1024}  # for a new leader


def test_a_new_leader_keeps_what_the_engines_said_rather_than_the_estimate(
    cp: SchedulerRig,
) -> None:
    _node(cp)
    scheduler, (first, _second, _third) = _ready(cp, "m", 3)
    # A former leader learnt that a sleeper of m holds 4 GiB; the one asleep now is of an
    # engine that says nothing (its weights' size counts: 20 GiB held).
    cp.store.set_learnt_host_memory("m", 4 * 1024)
    _asleep(cp, first.id)
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    _steps(dozing, now)
    assert dozing.host_mib == {"m": 4 * 1024}
    # 20 held + 4 each: within 32, level 1 (the estimate, 20 more, would have passed it).
    assert _sleep_levels(cp) == [1, 1]


def test_the_learnt_host_memory_is_written_only_when_it_grows(cp: SchedulerRig) -> None:
    _node(cp)
    scheduler, (first, second, _third) = _ready(cp, "m", 3)
    cp.store.set_learnt_host_memory("m", 6 * 1024)
    written: list[int] = []
    real = cp.store.set_learnt_host_memory

    def counted(model: str, mib: int) -> None:
        written.append(mib)
        real(model, mib)

    cp.store.set_learnt_host_memory = counted
    _asleep(cp, first.id, said=4 * 1024)  # less than what was learnt: kept at 6
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    _steps(dozing, now)
    assert written == [] and dozing.host_mib == {"m": 6 * 1024}
    _asleep(cp, second.id, said=8 * 1024)
    _steps(dozing, now)
    _steps(dozing, now)
    assert written == [8 * 1024] and cp.store.learnt_host_memory() == {"m": 8 * 1024}


def test_past_the_share_the_sim_sleeps_at_level_2_and_the_event_says_why(
    cp: SchedulerRig,
) -> None:
    _node(cp, gpus=2)
    scheduler, (first, second) = _ready(cp, "m", 2)
    _asleep(cp, first.id, said=30 * 1024)
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    _steps(dozing, now)
    assert cp.store.get_replica(second.id).state == ReplicaState.FALLING_ASLEEP
    (shard,) = cp.store.list_shards(replica_id=second.id)
    status = pb.ShardStatus(shard_id=shard.id, sleep_level=2, transition_ms=10)
    scheduler.sleeps.on_status(shard, ShardState.ASLEEP, status)
    (event,) = [e for e in cp.store.list_events() if e.kind == "replica_asleep"]
    assert event.message.startswith("asleep at level 2 in ")
    assert event.message.endswith(
        "idle for 1s; slept at level 2: its node n1's sleepers hold 30720 MiB of host memory; "
        "30720 MiB more would pass 50% of its 65536 MiB"
    )


def test_within_the_share_a_level_1_sleep_stays_level_1(cp: SchedulerRig) -> None:
    _node(cp, gpus=2, weights=8 * GIB)
    scheduler, (first, _second) = _ready(cp, "m", 2)
    _asleep(cp, first.id)  # holds 8 GiB (estimated); 8 more is within 32
    now = [0.0]
    dozing = Dozing(scheduler, clock=lambda: now[0])
    _steps(dozing, now)
    assert _sleep_levels(cp) == [1]


def test_the_gauge_shows_each_nodes_sleepers_host_memory(cp: SchedulerRig) -> None:
    _node(cp, gpus=2)
    scheduler, (first, _second) = _ready(cp, "m", 2)
    metrics = Metrics()
    scheduler.sleeps.metrics = metrics
    _asleep(cp, first.id, said=3 * 1024)
    dozing = Dozing(scheduler, clock=lambda: 0.0)
    dozing.step({"m": 2})  # demand for both: none sleeps, one wakes
    assert metrics.sleepers_host_memory.values[("n1",)] == 3 * GIB
    assert 'llmgw_sleepers_host_memory_bytes{node="n1"} 3221225472' in metrics.render()
    _set(cp, first.id, ShardState.READY)
    dozing.step({"m": 2})
    assert metrics.sleepers_host_memory.values[("n1",)] == 0  # its sleeper woke
