"""Which sources each node keeps warm (llmgw.server.fleet.warming): a model with prefetch
whose profile placement may put on the node (its source there or fetchable, its engine
offered, GPUs large enough), told on every HeartbeatAck; nothing before the first look."""

from __future__ import annotations

from typing import Any

from llmgw.contracts.scaling import ScalingPolicy
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.placement import Cluster, Placement
from llmgw.server.fleet.reports import AgentReports
from llmgw.server.fleet.warming import Warming
from tests.unit.server.scheduler_rig import SchedulerRig

SHA = "cd" * 32
PREFETCH = ScalingPolicy(min=0, max=2, prefetch=True).to_json()


def _join(
    cp: SchedulerRig,
    node_id: str,
    *names: str,
    gpu_mib: int = 81920,
    engines: frozenset[str] = frozenset({"sim"}),
    prefixes: tuple[str, ...] = (),
) -> None:
    inventory: dict[str, Any] = {
        "gpus": [{"uuid": f"{node_id}-GPU-0", "memory_total_mib": gpu_mib}],
        "sources": {
            "models_root": "/srv/llmgw/models",
            "entries": [{"name": n, "size_bytes": 1, "dir": True} for n in names],
            "listed_depth": 3,
            "fetch_prefixes": list(prefixes),
            "cached": [],
            "problem": "",
        },
    }
    cp.join(node_id, inventory, dataplane_addr=f"{node_id}:9443", engines=engines)


def _deploy(
    cp: SchedulerRig, name: str, source: Any, scaling: dict[str, Any], **profile: Any
) -> None:
    spec = {"engine": "sim", "gpus": 1, "source": source, **profile}
    cp.store.put_catalog_model(name, {"default": spec})
    cp.store.deploy_model(name, profile="default", replicas=0)
    cp.store.set_scaling(name, scaling, replicas=0)


def _warming(cp: SchedulerRig) -> Warming:
    scheduler = cp.scheduler()
    return Warming(cp.store, views=scheduler.node_views, profile=scheduler.placement_profile)


def _names(sets: dict[str, tuple[pb.WarmSource, ...]]) -> dict[str, list[str]]:
    return {node: [s.source for s in sources] for node, sources in sets.items()}


def test_a_prefetch_model_is_warmed_where_placement_may_put_it(cp: SchedulerRig) -> None:
    _join(cp, "n1", "llama")
    _join(cp, "n2", "other")  # the source is not there
    _join(cp, "n3", "llama", gpu_mib=8192)  # its GPU is too small for the profile
    _join(cp, "n4", "llama", engines=frozenset({"vllm"}))  # the engine is not offered
    _join(cp, "n5", "llama")
    _deploy(cp, "m", "llama", PREFETCH, gpu_memory="40GiB")
    _deploy(cp, "cold", "other", ScalingPolicy(min=0, max=2).to_json())  # no prefetch
    _deploy(cp, "fixed", "other", {})  # a fixed count: no policy, no prefetch
    assert _names(_warming(cp).refresh()) == {"n1": ["llama"], "n5": ["llama"]}


def test_the_nodes_are_placements_own(cp: SchedulerRig) -> None:
    # Whatever Cluster.place may choose, and nothing else, is warmed: the same test.
    for i in range(4):
        _join(cp, f"n{i}", "llama" if i % 2 else "x", gpu_mib=8192 * (i + 1))
    _deploy(cp, "m", "llama", PREFETCH, gpu_memory="16000MiB")
    warming = _warming(cp)
    sets = warming.refresh()
    profile = cp.scheduler().placement_profile(cp.store.get_model("m"))
    cluster = Cluster(cp.scheduler().node_views(), ())
    placed = set()
    while isinstance(result := cluster.place(profile), Placement):
        placed.add(result.shards[0].node_id)
    assert set(sets) == placed == {"n1", "n3"}


def test_a_fixed_count_with_prefetch_and_a_url_source(cp: SchedulerRig) -> None:
    _join(cp, "n1", prefixes=("http://10.0.0.2:8000/m/",))
    _join(cp, "n2")  # may not fetch it
    url = "http://10.0.0.2:8000/m/w.gguf"
    _deploy(cp, "m", {"url": url, "sha256": SHA}, ScalingPolicy(2, 2, prefetch=True).to_json())
    sets = _warming(cp).refresh()
    assert [(s.source, s.sha256) for s in sets["n1"]] == [(url, SHA)]
    assert "n2" not in sets


def test_each_source_once_per_node_in_a_steady_order(cp: SchedulerRig) -> None:
    _join(cp, "n1", "b", "a")
    _deploy(cp, "m1", "b", PREFETCH)
    _deploy(cp, "m2", "a", PREFETCH)
    _deploy(cp, "m3", "a", PREFETCH)
    assert _names(_warming(cp).refresh()) == {"n1": ["a", "b"]}


def test_acks_carry_the_set_and_nothing_before_the_first_look(cp: SchedulerRig) -> None:
    _join(cp, "n1", "llama")
    _join(cp, "n2", "other")
    _deploy(cp, "m", "llama", PREFETCH)
    warming = _warming(cp)
    assert warming.for_node("n1") is None  # the agent keeps what it has
    warming.refresh()
    n1, n2 = warming.for_node("n1"), warming.for_node("n2")
    assert n1 is not None and [s.source for s in n1.sources] == ["llama"]
    assert n2 is not None and list(n2.sources) == []  # told: nothing
    # Prefetch turned off: every node is told to warm nothing.
    cp.store.set_scaling("m", ScalingPolicy(min=0, max=2).to_json(), replicas=0)
    warming.refresh()
    n1 = warming.for_node("n1")
    assert n1 is not None and list(n1.sources) == []


def test_a_fleet_without_prefetch_reads_no_nodes(cp: SchedulerRig) -> None:
    _join(cp, "n1", "llama")
    _deploy(cp, "m", "llama", ScalingPolicy(min=0, max=2).to_json())
    scheduler = cp.scheduler()

    def views() -> Any:
        raise AssertionError("nodes read")

    warming = Warming(cp.store, views=views, profile=scheduler.placement_profile)
    assert warming.refresh() == {}


def test_the_heartbeat_ack_carries_it_to_approved_nodes_only(cp: SchedulerRig) -> None:
    _join(cp, "n1", "llama")
    _deploy(cp, "m", "llama", PREFETCH)
    warming = _warming(cp)
    warming.refresh()
    reports = AgentReports(
        cp.store,
        cp.router,  # type: ignore[arg-type]
        cp.scheduler(),
        installs=None,  # type: ignore[arg-type]
        renew=lambda session, csr: None,
        on_routes_changed=lambda: None,
        warm=warming.for_node,
    )
    session = cp.sessions["n1"]
    handler = reports.handlers()["heartbeat"]
    handler(session, pb.AgentMessage(heartbeat=pb.Heartbeat(seq=7)))
    ack = session.queue.get_nowait()
    assert ack is not None and ack.heartbeat_ack.seq == 7
    assert [s.source for s in ack.heartbeat_ack.warm.sources] == ["llama"]
    session.approved = False
    handler(session, pb.AgentMessage(heartbeat=pb.Heartbeat(seq=8)))
    ack = session.queue.get_nowait()
    assert ack is not None and not ack.heartbeat_ack.HasField("warm")


def _warm_report(*entries: tuple[str, str, int, str]) -> pb.AgentMessage:
    """An inventory whose prefetch says (source, state, bytes, reason) of each source."""
    return pb.AgentMessage(
        inventory=pb.Inventory(
            hostname="n1",
            warm=[
                pb.WarmStatus(source=s, state=st, bytes=n, reason=why, pass_seconds=2.5)
                for s, st, n, why in entries
            ],
        )
    )


def test_what_nodes_report_warm_is_a_gauge_and_each_change_of_state_one_event(
    cp: SchedulerRig,
) -> None:
    _join(cp, "n1", "llama")
    _join(cp, "n2", "llama")
    metrics = Metrics()
    reports = AgentReports(
        cp.store,
        cp.router,  # type: ignore[arg-type]
        cp.scheduler(),
        installs=None,  # type: ignore[arg-type]
        renew=lambda session, csr: None,
        on_routes_changed=lambda: None,
        metrics=metrics,
    )
    inventory = reports.handlers()["inventory"]
    n1 = cp.sessions["n1"]

    def events() -> list[tuple[str, str]]:
        kinds = ("source_warm", "source_skipped")
        listed = cp.store.list_events(limit=100, subject="n1")
        return [(e.kind, e.message) for e in reversed(listed) if e.kind in kinds]

    inventory(n1, _warm_report(("llama", "warming", 0, "")))
    assert events() == [] and ("n1",) not in metrics.warm_source_bytes.values
    inventory(cp.sessions["n2"], _warm_report())
    gib = 1 << 30
    inventory(n1, _warm_report(("llama", "warm", 15 * gib, ""), ("qwen", "warming", 0, "")))
    inventory(n1, _warm_report(("llama", "warm", 15 * gib, ""), ("qwen", "warm", 3 * gib, "")))
    # Read again (a later pass): no news.
    inventory(n1, _warm_report(("llama", "warm", 15 * gib, ""), ("qwen", "warm", 3 * gib, "")))
    assert events() == [
        ("source_warm", "llama warm in the page cache: 15.0 GiB, read in 2.5 s"),
        ("source_warm", "qwen warm in the page cache: 3.0 GiB, read in 2.5 s"),
    ]
    assert metrics.warm_source_bytes.values[("n1",)] == 18 * gib
    assert 'llmgw_warm_source_bytes{node="n1"} 19327352832' in metrics.render()
    short = "the node is short of memory: 2.0 GiB available"
    inventory(
        n1, _warm_report(("llama", "skipped", 15 * gib, short), ("qwen", "warm", 3 * gib, ""))
    )
    inventory(n1, _warm_report(("llama", "skipped", 15 * gib, short)))
    assert events()[2:] == [("source_skipped", f"llama not kept warm: {short}")]
    assert metrics.warm_source_bytes.values[("n1",)] == 0  # had some, has none now
    assert ("n2",) not in metrics.warm_source_bytes.values  # never had any: no series
