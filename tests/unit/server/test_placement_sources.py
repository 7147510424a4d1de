"""Placement and model sources: a node is chosen only when it has the profile's source under
its models_root or may fetch it, and the reasons say which nodes were checked."""

from __future__ import annotations

from typing import Any

from llmgw.contracts.model_sources import NodeSources, SourceSpec
from llmgw.server.fleet.placement import Cluster, GpuView, NodeView, Placement, Profile, Unplaceable

ROOT = "/srv/llmgw/models"
SHA = "ab" * 32


def sources(
    *names: str,
    root: str = ROOT,
    prefixes: tuple[str, ...] = (),
    cached: tuple[str, ...] = (),
    problem: str = "",
    depth: int = 3,
) -> NodeSources:
    data: dict[str, Any] = {
        "models_root": root,
        "entries": [{"name": n, "size_bytes": 1, "dir": True} for n in names],
        "listed_depth": depth,
        "fetch_prefixes": list(prefixes),
        "cached": list(cached),
        "problem": problem,
    }
    return NodeSources(data)


def node(
    node_id: str,
    src: NodeSources | None,
    *,
    gpus: int = 1,
    fabrics: tuple[str, ...] = (),
    connected: bool = True,
) -> NodeView:
    return NodeView(
        id=node_id,
        approved=True,
        connected=connected,
        draining=False,
        lost=False,
        engines=frozenset({"sim", "vllm"}),
        gpus=tuple(GpuView(f"{node_id}-g{i}", 81920) for i in range(gpus)),
        fabrics=fabrics,
        sources=src,
    )


def placed(result: Placement | Unplaceable) -> list[str]:
    assert isinstance(result, Placement), result
    return [s.node_id for s in result.shards]


def why(result: Placement | Unplaceable) -> tuple[str, ...]:
    assert isinstance(result, Unplaceable), result
    return result.reasons


def vllm(source: str, sha256: str = "", *, nodes: int = 1) -> Profile:
    return Profile("vllm", 1, nodes=nodes, source=SourceSpec(source, sha256))


def test_the_node_with_the_source_is_chosen_whatever_the_strategy() -> None:
    # n1 would win binpack (fewest free GPUs) and n3 spread; only n2 has the weights.
    views = [
        node("n1", sources("other")),
        node("n2", sources("llama", "org/model"), gpus=4),
        node("n3", sources(), gpus=8),
    ]
    for strategy in ("binpack", "spread"):
        cluster = Cluster(views, [])
        assert placed(cluster.place(vllm("llama"), strategy=strategy)) == ["n2"]
        # An absolute path is the same name on a node whose models_root holds it.
        assert placed(cluster.place(vllm(f"{ROOT}/org/model"), strategy=strategy)) == ["n2"]


def test_no_node_has_it_names_the_source_and_the_nodes_checked() -> None:
    views = [
        node("n1", sources("other")),
        node("n2", sources()),
        node("n3", sources("llama"), connected=False),
    ]
    result = Cluster(views, []).place(vllm("llama"))
    assert why(result) == (
        "no node has source llama under models_root; nodes checked: n1, n2 (copy the weights "
        "under a node's models_root, or fix the profile's source)",
        "n3: not connected",
    )
    assert Unplaceable(why(result)).summary().startswith("no node has source llama under")


def test_a_node_that_has_it_but_no_room_keeps_the_per_node_reasons() -> None:
    views = [node("n1", sources("other")), node("n2", sources("llama"), gpus=0)]
    assert why(Cluster(views, []).place(vllm("llama"))) == (
        f"n1: no source llama under its models_root {ROOT}",
        "n2: no GPUs, needs 1",
    )


def test_a_path_outside_a_nodes_models_root_is_not_there() -> None:
    views = [node("n1", sources("llama", root="/data/models")), node("n2", sources("llama"))]
    assert placed(Cluster(views, []).place(vllm(f"{ROOT}/llama"))) == ["n2"]
    result = Cluster(views[:1], []).place(vllm(f"{ROOT}/llama"))
    # The specific reason stays under the headline.
    assert why(result) == (
        f"no node has source {ROOT}/llama under models_root; nodes checked: n1 (copy the "
        "weights under a node's models_root, or fix the profile's source)",
        f"n1: source {ROOT}/llama is not under its models_root /data/models",
    )


def test_a_listing_that_failed_or_stopped_short() -> None:
    failed = node("n1", sources(problem="Permission denied"))
    assert why(Cluster([failed], []).place(vllm("llama")))[1] == (
        f"n1: cannot list its models_root {ROOT}: Permission denied"
    )
    # A name deeper than the listing reached cannot be told missing: the node is not filtered.
    shallow = node("n1", sources("a", depth=1))
    assert placed(Cluster([shallow], []).place(vllm("a/b"))) == ["n1"]
    assert not isinstance(Cluster([shallow], []).place(vllm("b")), Placement)


def test_an_agent_that_reports_no_sources_is_not_filtered() -> None:
    assert placed(Cluster([node("old", None)], []).place(vllm("llama"))) == ["old"]


def test_a_url_source_goes_to_a_node_that_may_fetch_it_or_has_it_cached() -> None:
    https = vllm("https://models.example/tiny.gguf", SHA)
    http = vllm("http://10.0.0.2:8000/models/tiny.gguf", SHA)
    views = [
        node("n1", sources()),
        node("n2", sources(prefixes=("http://10.0.0.2:8000/models/",))),
    ]
    # https:// is fetched by every node; http:// only where install_sources lists it.
    assert placed(Cluster(views, []).place(https, strategy="binpack")) == ["n1"]
    assert placed(Cluster(views, []).place(http)) == ["n2"]
    result = Cluster(views[:1], []).place(http)
    assert why(result) == (
        "no node may fetch source http://10.0.0.2:8000/models/tiny.gguf; nodes checked: n1 "
        "(list its place in a node's install_sources (agent.yaml), or give an https:// URL)",
    )
    # A node that fetched it before keeps offering it, whatever its list says now.
    assert placed(Cluster([node("n1", sources(cached=(SHA,)))], []).place(http)) == ["n1"]


def test_every_shard_of_a_multi_node_replica_needs_the_source() -> None:
    views = [
        node("n1", sources("big"), fabrics=("ib",)),
        node("n2", sources(), fabrics=("ib",)),
        node("n3", sources("big"), fabrics=("ib",)),
    ]
    assert sorted(placed(Cluster(views, []).place(vllm("big", nodes=2)))) == ["n1", "n3"]
    result = Cluster(views[:2], []).place(vllm("big", nodes=2))
    assert why(result) == (
        f"n2: no source big under its models_root {ROOT}",
        "fabric ib: 1 of 2 nodes free, needs 2",
    )
