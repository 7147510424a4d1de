"""Placement and host memory: a profile's ``host_memory`` is checked against each node's
memory less what its sleepers hold and what its allocations declare; a node that fails it
is skipped, named in the refusal with the figures; a profile without it is placed as before;
the trial with sleepers' memory counted free (what retiring them would give)."""

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

GIB = 1024  # MiB


def view(node_id: str, host_gib: int, gpus: int = 2, fabrics: tuple[str, ...] = ()) -> NodeView:
    return NodeView(
        id=node_id,
        approved=True,
        connected=True,
        draining=False,
        lost=False,
        engines=frozenset({"sim"}),
        gpus=tuple(GpuView(f"{node_id}-g{i}", 80 * GIB, index=i) for i in range(gpus)),
        fabrics=fabrics,
        host_total_mib=host_gib * GIB,
    )


def needs(gib: int, gpus: int = 1, nodes: int = 1) -> Profile:
    return Profile("sim", gpus, nodes=nodes, host_memory_mib=gib * GIB)


def test_a_node_whose_sleepers_hold_its_memory_is_skipped_with_a_reason() -> None:
    # dm-a packs better (fewer free GPUs) but its sleepers hold 250 of 256 GiB.
    taken = Allocation("r0", "r0-s0", "dm-a", ("dm-a-g0",))
    nodes = [view("dm-a", 256), view("dm-b", 256, gpus=1)]
    cluster = Cluster(nodes, [taken], {"dm-a": 250 * GIB})
    placed = cluster.place(needs(16))
    assert isinstance(placed, Placement) and placed.shards[0].node_id == "dm-b"
    result = cluster.place(needs(16))
    assert isinstance(result, Unplaceable)
    assert result.reasons == (
        "dm-a: sleepers hold 250 GiB of 256 GiB host memory; needs 16 GiB",
        "dm-b: 0 of 1 GPUs free, needs 1",
    )
    # A node that lacks GPUs says so, not its host memory.
    result = cluster.place(needs(16, gpus=2))
    assert isinstance(result, Unplaceable)
    assert result.reasons[0] == "dm-a: 1 of 2 GPUs free, needs 2"


def test_a_profile_without_host_memory_is_placed_as_before() -> None:
    cluster = Cluster([view("dm-a", 256)], [], {"dm-a": 256 * GIB})
    placed = cluster.place(Profile("sim", 1))
    assert isinstance(placed, Placement) and placed.shards[0].node_id == "dm-a"
    # Nor does one without it take any host memory from the next.
    placed = cluster.place(needs(0))
    assert isinstance(placed, Placement)


def test_replicas_declared_host_memory_counts_and_is_given_back_on_release() -> None:
    declared = Allocation("r0", "r0-s0", "n1", ("n1-g0",), host_memory_mib=200 * GIB)
    cluster = Cluster([view("n1", 256, gpus=4)], [declared], {"n1": 20 * GIB})
    result = cluster.place(needs(40))
    assert isinstance(result, Unplaceable)
    assert result.reasons == (
        "n1: sleepers hold 20 GiB and replicas 200 GiB of 256 GiB host memory; needs 40 GiB",
    )
    placed = cluster.place(needs(30))  # 36 GiB left
    assert isinstance(placed, Placement)
    result = cluster.place(needs(30))  # now 6
    assert isinstance(result, Unplaceable)
    assert result.reasons == (
        "n1: sleepers hold 20 GiB and replicas 230 GiB of 256 GiB host memory; needs 30 GiB",
    )
    cluster.release("r0")
    assert isinstance(cluster.place(needs(30)), Placement)


def test_a_node_too_small_and_one_of_unknown_memory() -> None:
    cluster = Cluster([view("big", 0), view("small", 8)], [])
    result = cluster.place(needs(16, gpus=0))
    assert isinstance(result, Placement) and result.shards[0].node_id == "big"  # unknown: ok
    cluster = Cluster([view("small", 8)], [])
    result = cluster.place(needs(16, gpus=0))  # no GPUs needed: the host memory still is
    assert isinstance(result, Unplaceable)
    assert result.reasons == ("small: 8 GiB host memory; needs 16 GiB",)


def test_a_multi_node_replica_counts_only_nodes_with_the_memory() -> None:
    nodes = [view(n, 24, fabrics=("ib0",)) for n in ("a", "b", "c")]
    cluster = Cluster(nodes, [], {"b": 20 * GIB})
    placed = cluster.place(needs(16, nodes=2))
    assert isinstance(placed, Placement)
    assert sorted(s.node_id for s in placed.shards) == ["a", "c"]
    result = cluster.place(needs(16, nodes=2))
    assert isinstance(result, Unplaceable)
    assert result.reasons == (
        "a: replicas hold 16 GiB of 24 GiB host memory; needs 16 GiB",
        "b: sleepers hold 20 GiB of 24 GiB host memory; needs 16 GiB",
        "c: replicas hold 16 GiB of 24 GiB host memory; needs 16 GiB",
        "fabric ib0: 0 of 3 nodes free, needs 2",
    )


def test_the_trial_with_sleepers_free_and_what_a_node_lacks() -> None:
    cluster = Cluster([view("n1", 64)], [], {"n1": 60 * GIB})
    assert cluster.sleepers_hold()
    assert isinstance(cluster.place(needs(16)), Unplaceable)
    trial = cluster.place(needs(16), sleepers_free=True)
    assert isinstance(trial, Placement)
    cluster.release(trial.replica_id)
    assert cluster.host_short("n1", 16 * GIB) == 12 * GIB
    cluster.sleeper_gone("n1", 12 * GIB)
    assert cluster.host_short("n1", 16 * GIB) == 0
    assert isinstance(cluster.place(needs(16)), Placement)
    assert not Cluster([view("n1", 64)], []).sleepers_hold()
