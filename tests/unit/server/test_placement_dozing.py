"""Placement and asleep replicas' GPUs: free (an asleep replica gave its memory back), but
used last, since a sleeper whose GPUs another replica took cannot wake where it is: on its
node the other free GPUs first, and nodes with room elsewhere before a node whose only room
is a sleeper's; a sleeper's GPU is still taken when nothing else is free."""

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


def view(node_id: str, gpus: int = 4, memory: tuple[int, ...] = ()) -> NodeView:
    return NodeView(
        id=node_id,
        approved=True,
        connected=True,
        draining=False,
        lost=False,
        engines=frozenset({"sim"}),
        fabrics=(),
        gpus=tuple(
            GpuView(f"{node_id}-g{i}", memory[i] if memory else 81920, index=i) for i in range(gpus)
        ),
    )


def gpus_of(result: Placement | Unplaceable) -> list[tuple[str, tuple[str, ...]]]:
    assert isinstance(result, Placement), result
    return [(s.node_id, s.gpus) for s in result.shards]


def test_on_a_node_the_sleepers_gpus_come_after_the_other_free_ones() -> None:
    cluster = Cluster([view("a")], [], dozing={"a": ["a-g0", "a-g1"]})
    assert gpus_of(cluster.place(Profile("sim", 1))) == [("a", ("a-g2",))]
    assert gpus_of(cluster.place(Profile("sim", 1))) == [("a", ("a-g3",))]
    # Nothing else free: a sleeper's GPU is used rather than refusing.
    assert gpus_of(cluster.place(Profile("sim", 2))) == [("a", ("a-g0", "a-g1"))]
    assert isinstance(cluster.place(Profile("sim", 1)), Unplaceable)


def test_a_node_whose_only_room_is_a_sleepers_comes_after_one_with_room() -> None:
    # Binpack would take "a" (one GPU free: fewest) but that GPU is a sleeper's.
    taken = [Allocation(f"r{i}", f"r{i}-s0", "a", (f"a-g{i}",)) for i in range(3)]
    cluster = Cluster([view("a"), view("b")], taken, dozing={"a": ["a-g3"]})
    assert gpus_of(cluster.place(Profile("sim", 1))) == [("b", ("b-g0",))]
    # Spread likewise.
    cluster = Cluster([view("a"), view("b", gpus=2)], [], dozing={"a": ["a-g0", "a-g1", "a-g2"]})
    assert gpus_of(cluster.place(Profile("sim", 2), strategy="spread")) == [("b", ("b-g0", "b-g1"))]


def test_best_fit_holds_within_the_gpus_no_sleeper_takes_back() -> None:
    # Sizes 80, 40, 48 GiB; 40 GiB needed: best fit is g1, but it is a sleeper's, so g2.
    memory = (81920, 40960, 49152)
    cluster = Cluster([view("a", 3, memory)], [], dozing={"a": ["a-g1"]})
    assert gpus_of(cluster.place(Profile("sim", 1, gpu_memory_mib=40960))) == [("a", ("a-g2",))]


def test_without_sleepers_placement_is_as_before() -> None:
    plain = Cluster([view("a"), view("b")], [])
    marked = Cluster([view("a"), view("b")], [], dozing={"b": []})
    for _ in range(8):
        assert gpus_of(plain.place(Profile("sim", 1))) == gpus_of(marked.place(Profile("sim", 1)))
