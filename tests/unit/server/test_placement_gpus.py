"""Placement and blocked GPUs: a cordoned or unhealthy GPU is never given out, its node keeps
its other GPUs, and a refusal names the GPU and why."""

from __future__ import annotations

from llmgw.server.fleet.placement import (
    Allocation,
    Cluster,
    GpuView,
    NodeView,
    Placement,
    Profile,
    Unplaceable,
)

GIB = 1024


def view(node_id: str, blocked: dict[int, str], gpus: int = 4) -> NodeView:
    return NodeView(
        id=node_id,
        approved=True,
        connected=True,
        draining=False,
        lost=False,
        engines=frozenset({"sim"}),
        gpus=tuple(
            GpuView(f"{node_id}-g{i}", 80 * GIB, index=i, blocked=blocked.get(i, ""))
            for i in range(gpus)
        ),
        fabrics=(),
    )


def test_blocked_gpus_are_skipped_and_the_rest_of_the_node_used() -> None:
    cluster = Cluster([view("n1", {0: "cordoned", 2: "unhealthy: XID 79"})], [])
    placed = cluster.place(Profile("sim", 2))
    assert isinstance(placed, Placement)
    assert placed.shards[0].gpus == ("n1-g1", "n1-g3")


def test_refusal_names_the_blocked_gpus() -> None:
    cluster = Cluster([view("n1", {3: "cordoned", 2: "unhealthy: XID 79"})], [])
    result = cluster.place(Profile("sim", 3))
    assert isinstance(result, Unplaceable)
    assert result.reasons == (
        "n1: 2 of 4 GPUs free (GPU 2 unhealthy: XID 79, GPU 3 cordoned), needs 3",
    )


def test_refusal_of_nodes_without_blocked_gpus_is_unchanged() -> None:
    cluster = Cluster([view("n1", {3: "cordoned"}), view("n2", {})], [])
    result = cluster.place(Profile("sim", 5))
    assert isinstance(result, Unplaceable)
    assert result.reasons == (
        "n1: 3 of 4 GPUs free (GPU 3 cordoned), needs 5",
        "n2: 4 of 4 GPUs free, needs 5",
    )


def test_a_replica_on_a_blocked_gpu_released_does_not_free_it() -> None:
    alloc = Allocation("r1", "r1-s0", "n1", ("n1-g0",))
    cluster = Cluster([view("n1", {0: "cordoned"}, gpus=2)], [alloc])
    assert cluster.free_gpus("n1") == ("n1-g1",)
    cluster.release("r1")
    assert cluster.free_gpus("n1") == ("n1-g1",)
    placed = cluster.place(Profile("sim", 1))
    assert isinstance(placed, Placement)
    assert placed.shards[0].gpus == ("n1-g1",)
    assert isinstance(cluster.place(Profile("sim", 1)), Unplaceable)
