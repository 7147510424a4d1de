"""Tests for the placement engine: every filter and reason, both strategies, and a state
machine that drives nodes and deployments at random against a brute-force oracle."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from llmgw.contracts.inventory import DegradedCode, DegradedReason
from llmgw.server.fleet.placement import (
    Allocation,
    Cluster,
    GpuView,
    NodeView,
    Placement,
    Profile,
    ShardPlacement,
    Unplaceable,
    degraded_refusal,
    offered_engines,
)

GIB = 1024
BOTH = frozenset({"vllm", "sim"})


def node(
    node_id: str,
    gpus: int = 8,
    *,
    memory: int = 80 * GIB,
    memories: Iterable[int] | None = None,
    fabrics: tuple[str, ...] = (),
    engines: frozenset[str] = BOTH,
    approved: bool = True,
    connected: bool = True,
    draining: bool = False,
    lost: bool = False,
    degraded: tuple[DegradedReason, ...] = (),
) -> NodeView:
    sizes = list(memories) if memories is not None else [memory] * gpus
    return NodeView(
        id=node_id,
        approved=approved,
        connected=connected,
        draining=draining,
        lost=lost,
        engines=engines,
        gpus=tuple(GpuView(f"{node_id}-g{i}", m) for i, m in enumerate(sizes)),
        fabrics=fabrics,
        degraded=degraded,
    )


def held(node_id: str, *indexes: int, replica: str = "old") -> Allocation:
    return Allocation(replica, f"{replica}-s0", node_id, tuple(f"{node_id}-g{i}" for i in indexes))


def nodes_of(result: Placement | Unplaceable) -> list[str]:
    assert isinstance(result, Placement), result
    return [s.node_id for s in result.shards]


def reasons(result: Placement | Unplaceable) -> tuple[str, ...]:
    assert isinstance(result, Unplaceable), result
    return result.reasons


VLLM = Profile("vllm", 1)


# -- filters and their reasons -------------------------------------------------------------------


def test_no_nodes_at_all() -> None:
    assert reasons(Cluster([], []).place(VLLM)) == ("no nodes have joined",)


@pytest.mark.parametrize(
    ("view", "reason"),
    [
        (node("n1", approved=False), "n1: not approved"),
        (node("n1", lost=True, connected=False), "n1: lost"),
        (node("n1", connected=False), "n1: not connected"),
        (node("n1", draining=True), "n1: draining"),
        (
            node("n1", engines=frozenset({"sim"})),
            "n1: engine vllm not offered (installed: sim)",
        ),
        (
            node("n1", engines=frozenset({"sim", "sglang"})),
            "n1: engine vllm not offered (installed: sglang, sim)",
        ),
        (node("n1", engines=frozenset()), "n1: engine vllm not offered (installed: none)"),
        (node("n1", 0), "n1: no GPUs, needs 1"),
    ],
)
def test_each_filter_says_why(view: NodeView, reason: str) -> None:
    assert reasons(Cluster([view], []).place(VLLM)) == (reason,)


def test_first_failing_filter_wins() -> None:
    view = node("n1", 0, approved=False, draining=True, engines=frozenset())
    assert reasons(Cluster([view], []).place(VLLM)) == ("n1: not approved",)
    lost = node("n1", lost=True, connected=False, draining=True)
    assert reasons(Cluster([lost], []).place(VLLM)) == ("n1: lost",)


def test_free_gpus_reason() -> None:
    cluster = Cluster([node("node07")], [held("node07", 0, 1, 2, 3, 4, 5)])
    result = cluster.place(Profile("vllm", 4))
    assert reasons(result) == ("node07: 2 of 8 GPUs free, needs 4",)
    small = Cluster([node("n1", 2)], [])
    assert reasons(small.place(Profile("vllm", 4))) == ("n1: 2 of 2 GPUs free, needs 4",)


def test_memory_reasons() -> None:
    too_small = node("n1", 8, memory=24 * GIB)
    assert reasons(Cluster([too_small], []).place(Profile("vllm", 1, gpu_memory_mib=80 * GIB))) == (
        "n1: 0 of 8 GPUs have 80 GiB, needs 1",
    )
    mixed = node("n2", memories=[24 * GIB, 80 * GIB, 80 * GIB, 24 * GIB])
    cluster = Cluster([mixed], [held("n2", 1)])
    assert reasons(cluster.place(Profile("vllm", 2, gpu_memory_mib=40 * GIB))) == (
        "n2: 1 of 2 GPUs with 40 GiB free, needs 2",
    )
    odd = Profile("vllm", 3, gpu_memory_mib=30000)
    assert reasons(Cluster([mixed], []).place(odd)) == ("n2: 2 of 4 GPUs have 30000 MiB, needs 3",)


def test_avoid_reason_and_effect() -> None:
    cluster = Cluster([node("n1"), node("n2", 0)], [])
    result = cluster.place(VLLM, avoid=frozenset({"n1"}))
    assert reasons(result) == ("n1: avoided for this replica", "n2: no GPUs, needs 1")
    assert nodes_of(cluster.place(VLLM, avoid=frozenset({"n2"}))) == ["n1"]


def test_one_reason_per_node_in_id_order() -> None:
    views = [
        node("node09", lost=True, connected=False),
        node("node02", draining=True),
        node("node05", approved=False),
        node("node03", engines=frozenset({"sim"})),
    ]
    assert reasons(Cluster(views, []).place(VLLM)) == (
        "node02: draining",
        "node03: engine vllm not offered (installed: sim)",
        "node05: not approved",
        "node09: lost",
    )


def test_multi_node_reasons_per_node_and_per_fabric() -> None:
    views = [
        node("node04", fabrics=("ib-b",)),
        node("node05", fabrics=("ib-b",), draining=True),
        node("node11"),
        node("node12", fabrics=("ib-a",)),
        node("node13", fabrics=("ib-a",)),
    ]
    allocations = [held("node13", 0, 1, 2, 3, 4, 5, 6)]
    result = Cluster(views, allocations).place(Profile("vllm", 2, nodes=2))
    assert reasons(result) == (
        "node05: draining",
        "node11: no fabric (multi-node replicas need one)",
        "node13: 1 of 8 GPUs free, needs 2",
        "fabric ib-a: 1 of 2 nodes free, needs 2",
        "fabric ib-b: 1 of 2 nodes free, needs 2",
    )


def test_multi_node_reason_singular_node() -> None:
    result = Cluster([node("n1", fabrics=("ib-a",))], []).place(Profile("vllm", 1, nodes=3))
    assert reasons(result) == ("fabric ib-a: 1 of 1 node free, needs 3",)


def test_summary_shortens_long_reasons() -> None:
    result = Unplaceable(tuple(f"n{i}: draining" for i in range(8)))
    assert result.summary(limit=2) == "n0: draining; n1: draining; and 6 more"
    assert Unplaceable(("a", "b")).summary() == "a; b"


# -- single-node scoring -------------------------------------------------------------------------


def test_binpack_fills_the_fullest_node_that_fits() -> None:
    views = [node("n1"), node("n2"), node("n3")]
    allocations = [held("n2", 0, 1, 2, 3, 4, 5), held("n3", 0, 1, 2, 3, replica="b")]
    cluster = Cluster(views, allocations)
    assert nodes_of(cluster.place(Profile("vllm", 2))) == ["n2"]  # 2 free: exactly fits
    assert nodes_of(cluster.place(Profile("vllm", 4))) == ["n3"]  # n2 is full now
    assert nodes_of(cluster.place(Profile("vllm", 1))) == ["n1"]  # 8 free is all that is left


def test_binpack_breaks_ties_by_node_id_not_allocations() -> None:
    views = [node("n2"), node("n1"), node("n3")]
    # n3 holds 4 GPUs in four allocations, n2 in one: allocations do not count for binpack.
    allocations = [held("n3", i, replica=f"r{i}") for i in range(4)] + [held("n2", 0, 1, 2, 3)]
    assert nodes_of(Cluster(views, allocations).place(Profile("vllm", 1))) == ["n2"]
    assert nodes_of(Cluster(views, []).place(Profile("vllm", 1))) == ["n1"]


def test_spread_prefers_the_emptiest_node_then_fewest_allocations() -> None:
    views = [node("n1"), node("n2"), node("n3")]
    allocations = [held("n1", 0), held("n2", 0, 1, 2, replica="b"), held("n3", 0, replica="c")]
    cluster = Cluster(views, allocations)
    assert nodes_of(cluster.place(VLLM, strategy="spread")) == ["n1"]  # 7 free, ties n3 on id
    assert nodes_of(cluster.place(VLLM, strategy="spread")) == ["n3"]
    four = Cluster([node("a", 4), node("b", 4)], [held("a", 0), held("b", 0, replica="x")])
    four.place(Profile("vllm", 0), strategy="spread")  # a now has 2 allocations, b 1
    assert nodes_of(four.place(VLLM, strategy="spread")) == ["b"]


def test_gpu_less_profiles_share_nodes() -> None:
    sim = Profile("sim", 0)
    views = [node("cpu1", 0), node("cpu2", 0), node("gpu1")]
    cluster = Cluster(views, [])
    # binpack keeps GPU nodes open and spreads over the rest by allocations.
    assert [nodes_of(cluster.place(sim))[0] for _ in range(4)] == ["cpu1", "cpu2", "cpu1", "cpu2"]
    spread = Cluster(views, [])
    placed = [nodes_of(spread.place(sim, strategy="spread"))[0] for _ in range(4)]
    assert placed == ["gpu1", "cpu1", "cpu2", "gpu1"]
    result = spread.place(sim)
    assert isinstance(result, Placement) and result.shards[0].gpus == ()


def test_gpu_memory_is_a_fit_check_and_best_fit() -> None:
    mixed = node("n1", memories=[80 * GIB, 24 * GIB, 48 * GIB, 48 * GIB])
    cluster = Cluster([mixed], [])
    result = cluster.place(Profile("vllm", 1, gpu_memory_mib=40 * GIB))
    assert isinstance(result, Placement)
    assert result.shards[0].gpus == ("n1-g2",)  # the smallest GPU that is large enough
    whole = cluster.place(Profile("vllm", 2))  # no memory asked: inventory order
    assert isinstance(whole, Placement) and whole.shards[0].gpus == ("n1-g0", "n1-g1")
    assert cluster.free_gpus("n1") == ("n1-g3",)


# -- multi-node ----------------------------------------------------------------------------------


def test_multi_node_uses_distinct_nodes_on_one_fabric() -> None:
    views = [node(f"n{i}", fabrics=("ib-a",)) for i in range(3)]
    result = Cluster(views, []).place(Profile("vllm", 8, nodes=3))
    assert isinstance(result, Placement)
    assert [(s.node_id, s.rank, s.fabric) for s in result.shards] == [
        ("n0", 0, "ib-a"),
        ("n1", 1, "ib-a"),
        ("n2", 2, "ib-a"),
    ]
    assert all(len(s.gpus) == 8 for s in result.shards)


def test_single_node_replica_has_no_fabric() -> None:
    result = Cluster([node("n1", fabrics=("ib-a",))], []).place(VLLM)
    assert isinstance(result, Placement) and result.shards[0].fabric is None


def test_multi_node_never_spans_fabrics() -> None:
    views = [node("a1", fabrics=("ib-a",)), node("b1", fabrics=("ib-b",))]
    result = Cluster(views, []).place(Profile("vllm", 1, nodes=2))
    assert reasons(result) == (
        "fabric ib-a: 1 of 1 node free, needs 2",
        "fabric ib-b: 1 of 1 node free, needs 2",
    )


def test_node_without_fabric_never_takes_part() -> None:
    views = [node("n1"), node("n2"), node("n3", fabrics=("ib-a",))]
    result = Cluster(views, []).place(Profile("sim", 0, nodes=2))
    assert reasons(result) == (
        "n1: no fabric (multi-node replicas need one)",
        "n2: no fabric (multi-node replicas need one)",
        "fabric ib-a: 1 of 1 node free, needs 2",
    )


def test_node_on_two_fabrics_counts_for_either() -> None:
    views = [
        node("both", fabrics=("ib-b", "ib-a")),
        node("a1", fabrics=("ib-a",)),
        node("b1", fabrics=("ib-b",)),
    ]
    cluster = Cluster(views, [held("b1", 0, 1, 2, 3, 4, 5, 6, 7)])
    first = cluster.place(Profile("vllm", 4, nodes=2))
    assert isinstance(first, Placement)
    assert {s.fabric for s in first.shards} == {"ib-a"}
    assert sorted(nodes_of(first)) == ["a1", "both"]
    cluster.release("old")
    second = cluster.place(Profile("vllm", 4, nodes=2), avoid=frozenset({"a1"}))
    assert isinstance(second, Placement)
    assert {s.fabric for s in second.shards} == {"ib-b"}
    assert nodes_of(second) == ["both", "b1"]


def test_binpack_picks_the_tightest_fabric_and_spread_the_roomiest() -> None:
    views = [node(f"a{i}", fabrics=("ib-a",)) for i in range(4)]
    views += [node(f"b{i}", fabrics=("ib-b",)) for i in range(2)]
    views += [node(f"c{i}", fabrics=("ib-c",)) for i in range(3)]
    two = Profile("vllm", 8, nodes=2)
    assert nodes_of(Cluster(views, []).place(two)) == ["b0", "b1"]
    assert nodes_of(Cluster(views, []).place(two, strategy="spread")) == ["a0", "a1"]


def test_multi_node_binpack_fills_nodes_within_the_fabric() -> None:
    views = [node(f"n{i}", fabrics=("ib-a",)) for i in range(4)]
    allocations = [held("n2", 0, 1, 2, 3), held("n3", 0, 1, 2, 3, 4, 5, replica="b")]
    result = Cluster(views, allocations).place(Profile("vllm", 2, nodes=2))
    assert nodes_of(result) == ["n3", "n2"]  # rank 0 on the fullest
    spread = Cluster(views, allocations).place(Profile("vllm", 2, nodes=2), strategy="spread")
    assert nodes_of(spread) == ["n0", "n1"]


def test_multi_node_filters_engine_memory_and_avoid_within_a_fabric() -> None:
    views = [
        node("n0", fabrics=("ib-a",), engines=frozenset({"sim"})),
        node("n1", fabrics=("ib-a",), memory=24 * GIB),
        node("n2", fabrics=("ib-a",)),
        node("n3", fabrics=("ib-a",)),
        node("n4", fabrics=("ib-a",)),
    ]
    profile = Profile("vllm", 1, nodes=2, gpu_memory_mib=40 * GIB)
    assert nodes_of(Cluster(views, []).place(profile)) == ["n2", "n3"]
    avoided = Cluster(views, []).place(profile, avoid=frozenset({"n2"}))
    assert nodes_of(avoided) == ["n3", "n4"]


def test_multi_node_avoid_on_a_uniform_fabric() -> None:
    views = [node(f"n{i}", fabrics=("ib-a",)) for i in range(3)]
    views += [node(f"m{i}", fabrics=("ib-b",)) for i in range(3)]
    two = Profile("vllm", 8, nodes=2)
    assert nodes_of(Cluster(views, []).place(two, avoid=frozenset({"n0"}))) == ["n1", "n2"]
    # Avoiding m2 leaves ib-b with no spare node, so binpack now prefers it.
    assert nodes_of(Cluster(views, []).place(two, avoid=frozenset({"m2"}))) == ["m0", "m1"]
    result = Cluster(views, []).place(two, avoid=frozenset({"n0", "n1", "m0", "m1"}))
    assert reasons(result)[-2:] == (
        "fabric ib-a: 1 of 3 nodes free, needs 2",
        "fabric ib-b: 1 of 3 nodes free, needs 2",
    )


# -- the cluster as a mutable view ---------------------------------------------------------------


def test_a_placement_is_recorded_and_released() -> None:
    cluster = Cluster([node("n1", 4)], [])
    first = cluster.place(Profile("vllm", 3), replica_id="r1")
    assert isinstance(first, Placement) and first.replica_id == "r1"
    assert cluster.free_gpus("n1") == ("n1-g3",)
    assert reasons(cluster.place(Profile("vllm", 2))) == ("n1: 1 of 4 GPUs free, needs 2",)
    cluster.release("r1")
    assert cluster.free_gpus("n1") == ("n1-g0", "n1-g1", "n1-g2", "n1-g3")
    cluster.release("r1")  # already gone: a no-op
    assert cluster.free_gpus("n1") == ("n1-g0", "n1-g1", "n1-g2", "n1-g3")


def test_provisional_ids_can_be_released() -> None:
    cluster = Cluster([node("n1", 2)], [held("n1", 0, replica="new-1")])
    result = cluster.place(VLLM)
    assert isinstance(result, Placement) and result.replica_id == "new-2"
    cluster.release(result.replica_id)
    assert cluster.free_gpus("n1") == ("n1-g1",)


def test_allocations_given_at_construction_can_be_released() -> None:
    allocations = [
        Allocation("r1", "r1-s0", "n1", ("n1-g0",)),
        Allocation("r1", "r1-s1", "n2", ("n2-g0",)),
    ]
    cluster = Cluster([node("n1", 1), node("n2", 1)], allocations)
    assert cluster.free_gpus("n1") == () and cluster.free_gpus("n2") == ()
    cluster.release("r1")
    assert cluster.free_gpus("n1") == ("n1-g0",) and cluster.free_gpus("n2") == ("n2-g0",)


def test_stale_allocations_are_tolerated() -> None:
    allocations = [
        Allocation("gone", "gone-s0", "deleted-node", ("x",)),
        Allocation("r1", "r1-s0", "n1", ("n1-g0", "GPU-removed")),
        # Two allocations claiming one GPU: it stays held until both are released.
        Allocation("r2", "r2-s0", "n1", ("n1-g1",)),
        Allocation("r3", "r3-s0", "n1", ("n1-g1",)),
    ]
    cluster = Cluster([node("n1", 2)], allocations)
    assert cluster.free_gpus("n1") == ()
    cluster.release("gone")
    cluster.release("r1")
    cluster.release("r2")
    assert cluster.free_gpus("n1") == ("n1-g0",)
    cluster.release("r3")
    assert cluster.free_gpus("n1") == ("n1-g0", "n1-g1")


def test_a_failed_placement_changes_nothing() -> None:
    cluster = Cluster([node("n1", 2, fabrics=("ib-a",))], [])
    assert isinstance(cluster.place(Profile("vllm", 2, nodes=2)), Unplaceable)
    assert cluster.free_gpus("n1") == ("n1-g0", "n1-g1")


def test_unplaceable_nodes_still_report_free_gpus() -> None:
    cluster = Cluster([node("n1", 2, draining=True)], [held("n1", 0)])
    assert cluster.free_gpus("n1") == ("n1-g1",)


def test_caller_mistakes_raise() -> None:
    with pytest.raises(ValueError, match="0 or more GPUs"):
        Profile("vllm", -1)
    with pytest.raises(ValueError, match="1 or more nodes"):
        Profile("vllm", 1, nodes=0)
    with pytest.raises(ValueError, match="gpu_memory_mib"):
        Profile("vllm", 1, gpu_memory_mib=-5)
    cluster = Cluster([node("n1")], [held("n1", 0, replica="r1")])
    with pytest.raises(ValueError, match="unknown strategy 'tight'"):
        cluster.place(VLLM, strategy="tight")
    with pytest.raises(ValueError, match="replica r1 is already placed"):
        cluster.place(VLLM, replica_id="r1")
    with pytest.raises(KeyError, match="no node n9"):
        cluster.free_gpus("n9")
    with pytest.raises(ValueError, match="node n1 is listed twice"):
        Cluster([node("n1"), node("n1")], [])


# -- the state machine ---------------------------------------------------------------------------

FABRICS = ("ib-a", "ib-b", "ib-c")
FABRIC_CHOICES = [(), ("ib-a",), ("ib-a",), ("ib-b",), ("ib-a", "ib-b"), ("ib-c",)]
ENGINE_CHOICES = [BOTH, BOTH, BOTH, frozenset({"vllm"}), frozenset({"sim"})]
SMALL_CHOICES = ["none", "none", "some", "all"]  # which GPUs of a node have 24 GiB, not 80
MAX_NODES = 6
DEGRADED_CHOICES = [
    DegradedReason("docker", "dockerd cannot be reached"),
    DegradedReason("engine", "engine vllm will not run", engine="vllm"),
    DegradedReason("engine", "engine sim will not run", engine="sim"),
    DegradedReason("gpus", "no GPU driver"),
    DegradedReason("fabric", "fabric ib-z is down", fabric="ib-z"),
    DegradedReason("a-newer-code", "something a newer agent knows"),
]


@dataclasses.dataclass
class Deployment:
    profile: Profile
    strategy: str
    desired: int


def degraded_blocks(view: NodeView, profile: Profile) -> bool:
    """Whether one of the node's reasons keeps it from the profile, from the rule's words."""
    for reason in view.degraded:
        if reason.code == "docker":
            return True  # every shard is a container
        if reason.code == "engine" and reason.engine == profile.engine:
            return True
        if reason.code == "gpus" and profile.gpus > 0:
            return True
        if reason.code == "fabric" and profile.nodes > 1 and not view.fabrics:
            return True
    return False


def eligible(view: NodeView, profile: Profile, held: set[str], avoid: frozenset[str]) -> bool:
    """Whether a node can take one shard, computed from scratch."""
    if not (view.approved and view.connected and not view.draining and not view.lost):
        return False
    if profile.engine not in view.engines or view.id in avoid:
        return False
    if degraded_blocks(view, profile):
        return False
    fit = [
        g for g in view.gpus if g.uuid not in held and g.memory_total_mib >= profile.gpu_memory_mib
    ]
    return profile.gpus == 0 or len(fit) >= profile.gpus


def brute_force_can_place(
    views: Iterable[NodeView],
    allocations: Iterable[Allocation],
    profile: Profile,
    avoid: frozenset[str] = frozenset(),
) -> bool:
    """Try every set of ``profile.nodes`` nodes (the machine keeps at most six)."""
    taken = {g for a in allocations for g in a.gpus}
    ok = [v for v in views if eligible(v, profile, taken, avoid)]
    for combo in itertools.combinations(ok, profile.nodes):
        if profile.nodes == 1 or set.intersection(*(set(v.fabrics) for v in combo)):
            return True
    return False


class PlacementMachine(RuleBasedStateMachine):
    """Nodes come, go, drain; deployments come and shrink; a reconcile after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, NodeView] = {}
        self.deployments: dict[str, Deployment] = {}
        # replica id -> (deployment, its shards); insertion order is creation order.
        self.replicas: dict[str, tuple[str, tuple[Allocation, ...]]] = {}
        self.seq = 0

    # -- helpers -----------------------------------------------------------------------------

    def allocations(self) -> list[Allocation]:
        return [a for _, shards in self.replicas.values() for a in shards]

    def new_id(self) -> str:
        self.seq += 1
        return f"r{self.seq}"

    def record(
        self,
        deployment: str,
        profile: Profile,
        strategy: str,
        placement: Placement,
        avoid: frozenset[str] = frozenset(),
    ) -> None:
        """Check a placement against the truth as it is now, then add it to the truth."""
        allocations = self.allocations()
        taken = {g for a in allocations for g in a.gpus}
        shards = placement.shards
        assert [s.rank for s in shards] == list(range(profile.nodes))
        assert len({s.node_id for s in shards}) == profile.nodes, "two shards on one node"
        for s in shards:
            view = self.nodes[s.node_id]
            assert eligible(view, profile, taken, avoid), f"{s.node_id} was not eligible"
            assert len(s.gpus) == len(set(s.gpus)) == profile.gpus
            sizes = {g.uuid: g.memory_total_mib for g in view.gpus}
            for uuid in s.gpus:
                assert uuid not in taken, f"{uuid} is already held"
                assert sizes[uuid] >= profile.gpu_memory_mib
            if profile.nodes == 1:
                assert s.fabric is None
            else:
                assert s.fabric is not None and s.fabric in view.fabrics
        assert len({s.fabric for s in shards}) == 1, "a replica across two fabrics"
        self.check_score(profile, strategy, placement, allocations, avoid)
        self.replicas[placement.replica_id] = (
            deployment,
            tuple(
                Allocation(
                    placement.replica_id, f"{placement.replica_id}-s{s.rank}", s.node_id, s.gpus
                )
                for s in shards
            ),
        )

    def check_score(
        self,
        profile: Profile,
        strategy: str,
        placement: Placement,
        allocations: list[Allocation],
        avoid: frozenset[str],
    ) -> None:
        """The chosen nodes are the best ones for the strategy, ranked from scratch."""
        taken = {g for a in allocations for g in a.gpus}
        free = {n: sum(g.uuid not in taken for g in v.gpus) for n, v in self.nodes.items()}
        count = {n: sum(a.node_id == n for a in allocations) for n in self.nodes}

        def key(n: str) -> tuple[int, ...]:
            if profile.gpus and strategy == "binpack":
                return (free[n],)
            if profile.gpus:
                return (-free[n], count[n])
            if strategy == "binpack":
                return (free[n], count[n])
            return (count[n], -free[n])

        ok = sorted(
            (n for n, v in self.nodes.items() if eligible(v, profile, taken, avoid)),
            key=lambda n: (*key(n), n),
        )
        chosen = [s.node_id for s in placement.shards]
        if profile.nodes == 1:
            assert chosen == ok[:1]
            return
        by_fabric = {f: [n for n in ok if f in self.nodes[n].fabrics] for f in FABRICS}
        spare = {
            f: len(ns) - profile.nodes for f, ns in by_fabric.items() if len(ns) >= profile.nodes
        }
        sign = 1 if strategy == "binpack" else -1
        fabric = min(spare, key=lambda f: (sign * spare[f], f))
        assert placement.shards[0].fabric == fabric
        assert chosen == by_fabric[fabric][: profile.nodes]

    def drop(self, replica_id: str, cluster: Cluster | None = None) -> None:
        del self.replicas[replica_id]
        if cluster is not None:
            cluster.release(replica_id)

    def reconcile(self) -> None:
        cluster = Cluster(self.nodes.values(), self.allocations())
        # Scale down everything first, so that what it frees is there for every deployment.
        for name, dep in sorted(self.deployments.items()):
            mine = [r for r, (d, _) in self.replicas.items() if d == name]
            for replica_id in reversed(mine[dep.desired :]):  # newest first
                self.drop(replica_id, cluster)
        for name, dep in sorted(self.deployments.items()):
            mine = [r for r, (d, _) in self.replicas.items() if d == name]
            for _ in range(dep.desired - len(mine)):
                result = cluster.place(dep.profile, strategy=dep.strategy, replica_id=self.new_id())
                if isinstance(result, Unplaceable):
                    self.check_unplaceable(dep.profile, result)
                    break
                self.record(name, dep.profile, dep.strategy, result)
        self.check_view(cluster)

    def check_unplaceable(self, profile: Profile, result: Unplaceable) -> None:
        assert not brute_force_can_place(self.nodes.values(), self.allocations(), profile)
        if not self.nodes:
            assert result.reasons == ("no nodes have joined",)
        elif profile.nodes == 1:
            assert [r.split(":")[0] for r in result.reasons] == sorted(self.nodes)
        else:
            assert all(
                r.split(":")[0] in self.nodes or r.startswith("fabric ") for r in result.reasons
            )

    def check_view(self, cluster: Cluster) -> None:
        """The view after a pass of places and releases equals one built afresh."""
        fresh = Cluster(self.nodes.values(), self.allocations())
        for node_id in self.nodes:
            assert cluster.free_gpus(node_id) == fresh.free_gpus(node_id)
        for dep in self.deployments.values():
            a = cluster.place(dep.profile, strategy=dep.strategy, replica_id="probe")
            b = fresh.place(dep.profile, strategy=dep.strategy, replica_id="probe")
            assert a == b
            cluster.release("probe")
            fresh.release("probe")

    def update(self, node_id: str, **changes: bool) -> None:
        self.nodes[node_id] = dataclasses.replace(self.nodes[node_id], **changes)

    # -- rules -------------------------------------------------------------------------------

    @initialize(data=st.data())
    def start_with_nodes(self, data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, 3))):
            self.add_node(
                data.draw(st.integers(0, 8)),
                data.draw(st.sampled_from(SMALL_CHOICES)),
                data.draw(st.sampled_from(FABRIC_CHOICES)),
                data.draw(st.sampled_from(ENGINE_CHOICES)),
                approved=True,
            )

    @precondition(lambda self: len(self.nodes) < MAX_NODES)
    @rule(
        gpus=st.integers(0, 8),
        small=st.sampled_from(SMALL_CHOICES),
        fabrics=st.sampled_from(FABRIC_CHOICES),
        engines=st.sampled_from(ENGINE_CHOICES),
        approved=st.sampled_from([True, True, True, False]),
    )
    def add_node(
        self,
        gpus: int,
        small: str,
        fabrics: tuple[str, ...],
        engines: frozenset[str],
        approved: bool,
    ) -> None:
        sizes = [
            24 * GIB if small == "all" or (small == "some" and i % 2) else 80 * GIB
            for i in range(gpus)
        ]
        node_id = f"node{len(self.nodes) + 1:02d}"
        view = node(node_id, memories=sizes, fabrics=fabrics, engines=engines, approved=approved)
        self.nodes[node_id] = view
        self.reconcile()

    @precondition(lambda self: bool(self.nodes))
    @rule(data=st.data())
    def approve_node(self, data: st.DataObject) -> None:
        self.update(data.draw(st.sampled_from(sorted(self.nodes))), approved=True)
        self.reconcile()

    @precondition(lambda self: bool(self.nodes))
    @rule(data=st.data())
    def lose_node(self, data: st.DataObject) -> None:
        node_id = data.draw(st.sampled_from(sorted(self.nodes)))
        self.update(node_id, lost=True, connected=False)
        # The control plane rebuilds every replica with a shard there.
        for replica_id, (_, shards) in list(self.replicas.items()):
            if any(a.node_id == node_id for a in shards):
                self.drop(replica_id)
        self.reconcile()

    @precondition(lambda self: any(v.lost for v in self.nodes.values()))
    @rule(data=st.data())
    def recover_node(self, data: st.DataObject) -> None:
        lost = sorted(n for n, v in self.nodes.items() if v.lost)
        self.update(data.draw(st.sampled_from(lost)), lost=False, connected=True)
        self.reconcile()

    @precondition(lambda self: bool(self.nodes))
    @rule(data=st.data())
    def drain_node(self, data: st.DataObject) -> None:
        # A node with replicas to move when there is one: draining an empty node is dull.
        busy = sorted({a.node_id for a in self.allocations()})
        node_id = data.draw(st.sampled_from(busy or sorted(self.nodes)))
        self.update(node_id, draining=True)
        avoid = frozenset({node_id})
        cluster = Cluster(self.nodes.values(), self.allocations())
        moving = [
            r
            for r, (_, shards) in self.replicas.items()
            if any(a.node_id == node_id for a in shards)
        ]
        for replica_id in moving:
            name = self.replicas[replica_id][0]
            dep = self.deployments[name]
            # Replacement first: the original holds its GPUs until the new one is placed.
            result = cluster.place(
                dep.profile, strategy=dep.strategy, avoid=avoid, replica_id=self.new_id()
            )
            if isinstance(result, Unplaceable):
                assert not brute_force_can_place(
                    self.nodes.values(), self.allocations(), dep.profile, avoid
                )
                continue
            assert node_id not in [s.node_id for s in result.shards]
            self.record(name, dep.profile, dep.strategy, result, avoid)
            self.drop(replica_id, cluster)
        self.check_view(cluster)
        self.reconcile()

    @precondition(lambda self: bool(self.replicas))
    @rule(data=st.data())
    def move_replica(self, data: st.DataObject) -> None:
        """Rebuild a replica away from one of its nodes (as after a shard keeps failing there),
        the node staying eligible for everything else."""
        replica_id = data.draw(st.sampled_from(sorted(self.replicas)))
        name, shards = self.replicas[replica_id]
        avoid = frozenset({data.draw(st.sampled_from(sorted(a.node_id for a in shards)))})
        dep = self.deployments[name]
        cluster = Cluster(self.nodes.values(), self.allocations())
        result = cluster.place(
            dep.profile, strategy=dep.strategy, avoid=avoid, replica_id=self.new_id()
        )
        if isinstance(result, Unplaceable):
            assert not brute_force_can_place(
                self.nodes.values(), self.allocations(), dep.profile, avoid
            )
        else:
            self.record(name, dep.profile, dep.strategy, result, avoid)
            self.drop(replica_id, cluster)
        self.check_view(cluster)
        self.reconcile()

    @precondition(lambda self: bool(self.nodes))
    @rule(data=st.data(), reasons=st.lists(st.sampled_from(DEGRADED_CHOICES), max_size=2))
    def degrade_node(self, data: st.DataObject, reasons: list[DegradedReason]) -> None:
        """The node's agent reports reasons (none: it recovered). What it already runs stays;
        what it can no longer run is not placed there again."""
        node_id = data.draw(st.sampled_from(sorted(self.nodes)))
        self.nodes[node_id] = dataclasses.replace(self.nodes[node_id], degraded=tuple(reasons))
        self.reconcile()

    @precondition(lambda self: any(v.draining for v in self.nodes.values()))
    @rule(data=st.data())
    def undrain_node(self, data: st.DataObject) -> None:
        draining = sorted(n for n, v in self.nodes.items() if v.draining)
        self.update(data.draw(st.sampled_from(draining)), draining=False)
        self.reconcile()

    @precondition(lambda self: len(self.deployments) < 4)
    @rule(
        engine=st.sampled_from(["vllm", "sim"]),
        gpus=st.sampled_from([0, 1, 2, 4, 8]),
        nodes=st.sampled_from([1, 2]),
        memory=st.sampled_from([0, 0, 40 * GIB]),
        strategy=st.sampled_from(["binpack", "spread"]),
        desired=st.integers(1, 4),
    )
    def deploy(
        self, engine: str, gpus: int, nodes: int, memory: int, strategy: str, desired: int
    ) -> None:
        profile = Profile(engine, gpus, nodes=nodes, gpu_memory_mib=memory if gpus else 0)
        self.deployments[f"d{len(self.deployments) + 1}"] = Deployment(profile, strategy, desired)
        self.reconcile()

    @precondition(lambda self: any(d.desired for d in self.deployments.values()))
    @rule(data=st.data())
    def scale_down(self, data: st.DataObject) -> None:
        names = sorted(n for n, d in self.deployments.items() if d.desired)
        dep = self.deployments[data.draw(st.sampled_from(names))]
        dep.desired = data.draw(st.integers(0, dep.desired - 1))
        self.reconcile()

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def no_gpu_held_twice(self) -> None:
        uuids = [g for a in self.allocations() for g in a.gpus]
        assert len(uuids) == len(set(uuids))

    @invariant()
    def replicas_keep_to_one_fabric_and_distinct_nodes(self) -> None:
        for name, shards in self.replicas.values():
            nodes = [a.node_id for a in shards]
            assert len(nodes) == len(set(nodes)) == self.deployments[name].profile.nodes
            if len(nodes) > 1:
                common = set.intersection(*(set(self.nodes[n].fabrics) for n in nodes))
                assert common

    @invariant()
    def nothing_on_lost_nodes(self) -> None:
        for _, shards in self.replicas.values():
            assert all(not self.nodes[a.node_id].lost for a in shards)

    @invariant()
    def desired_counts_reached_when_capacity_allows(self) -> None:
        for name, dep in self.deployments.items():
            have = sum(d == name for d, _ in self.replicas.values())
            assert have <= dep.desired
            if have < dep.desired:
                assert not brute_force_can_place(
                    self.nodes.values(), self.allocations(), dep.profile
                )


PlacementMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
test_placement_machine = PlacementMachine.TestCase


def test_shard_placement_is_a_value() -> None:
    a = ShardPlacement("n1", 0, ("g",), None)
    assert a == ShardPlacement("n1", 0, ("g",), None)


def test_reason_names_the_approval_state_when_known() -> None:
    pending = NodeView(
        id="n1",
        approved=False,
        connected=True,
        draining=False,
        lost=False,
        engines=frozenset({"vllm"}),
        gpus=(),
        fabrics=(),
        state="pending",
    )
    revoked = NodeView(
        id="n2",
        approved=False,
        connected=False,
        draining=False,
        lost=False,
        engines=frozenset(),
        gpus=(),
        fabrics=(),
        state="revoked",
    )
    result = Cluster([pending, revoked], []).place(Profile(engine="vllm", gpus=0))
    assert isinstance(result, Unplaceable)
    assert result.reasons == ("n1: pending", "n2: revoked")


# -- engines held back until their desired build is installed (llmgw.server.fleet.installs) ---------


def test_a_held_engine_is_not_placed_and_the_reason_is_the_holds() -> None:
    waiting = dataclasses.replace(
        node("a", 8), held_engines=(("vllm", "vllm 0.9 is being installed"),)
    )
    assert offered_engines(waiting) == frozenset({"sim"})
    assert offered_engines(node("b")) == BOTH
    result = Cluster([waiting], []).place(Profile("vllm", 1))
    assert isinstance(result, Unplaceable)
    assert result.reasons == ("a: vllm 0.9 is being installed",)
    # Only that engine: the node still takes others, and another node takes vllm.
    assert nodes_of(Cluster([waiting], []).place(Profile("sim", 0))) == ["a"]
    assert nodes_of(Cluster([waiting, node("b", 8)], []).place(Profile("vllm", 1))) == ["b"]


def test_a_held_engine_keeps_its_node_out_of_a_multi_node_replica() -> None:
    hold = (("vllm", "no vllm 0.9 build for its architecture aarch64"),)
    views = [
        node("a", 8, fabrics=("ib",)),
        dataclasses.replace(node("b", 8, fabrics=("ib",)), held_engines=hold),
        node("c", 8, fabrics=("ib",)),
    ]
    assert sorted(nodes_of(Cluster(views, []).place(Profile("vllm", 8, nodes=2)))) == ["a", "c"]
    result = Cluster(views, []).place(Profile("vllm", 8, nodes=3))
    assert isinstance(result, Unplaceable)
    assert "b: no vllm 0.9 build for its architecture aarch64" in result.reasons
    assert "fabric ib: 2 of 3 nodes free, needs 3" in result.reasons


# -- degraded nodes: kept from what they cannot run, and only from that ---------------------------

DOCKER = DegradedReason(DegradedCode.DOCKER, "runtime is docker but dockerd cannot be reached")
BROKEN_VLLM = DegradedReason(DegradedCode.ENGINE, "engine vllm will not run", engine="vllm")
NO_DRIVER = DegradedReason(DegradedCode.GPUS, "2 NVIDIA GPUs are on the PCI bus, but none usable")
IB_A_DOWN = DegradedReason(DegradedCode.FABRIC, "fabric ib-a is down", fabric="ib-a")


def test_a_broken_engine_keeps_only_that_engine_off() -> None:
    # What the agent sends: the engine not offered, and the reason.
    view = node("n1", engines=frozenset({"sim"}), degraded=(BROKEN_VLLM,))
    cluster = Cluster([view], [])
    assert reasons(cluster.place(VLLM)) == ("n1: degraded: engine vllm will not run",)
    assert nodes_of(cluster.place(Profile("sim", 0))) == ["n1"]
    assert nodes_of(cluster.place(Profile("sim", 2))) == ["n1"]  # its GPUs are fine
    # Even were the engine still listed (an older view), the reason keeps it off.
    listed = node("n2", degraded=(BROKEN_VLLM,))
    assert reasons(Cluster([listed], []).place(VLLM)) == ("n2: degraded: engine vllm will not run",)


def test_gpus_without_a_driver_keep_only_gpu_work_off() -> None:
    view = node("n1", 0, degraded=(NO_DRIVER,))
    cluster = Cluster([view], [])
    assert reasons(cluster.place(VLLM)) == (f"n1: degraded: {NO_DRIVER.message}",)
    assert nodes_of(cluster.place(Profile("vllm", 0))) == ["n1"]
    assert nodes_of(cluster.place(Profile("sim", 0))) == ["n1"]


def test_unreachable_docker_keeps_everything_off() -> None:
    cluster = Cluster([node("n1", degraded=(DOCKER,)), node("n2", 0)], [])
    for profile in (VLLM, Profile("sim", 0), Profile("vllm", 0)):
        assert degraded_refusal((DOCKER,), (), profile) == f"degraded: {DOCKER.message}"
    assert nodes_of(cluster.place(Profile("sim", 0))) == ["n2"]
    assert reasons(cluster.place(VLLM)) == (
        f"n1: degraded: {DOCKER.message}",
        "n2: no GPUs, needs 1",
    )


def test_a_fabric_down_keeps_off_multi_node_only_without_another_fabric() -> None:
    # The agent reports only healthy fabrics; ib-a is down on both nodes of the first pair.
    down = [node(f"a{i}", fabrics=(), degraded=(IB_A_DOWN,)) for i in range(2)]
    cluster = Cluster(down, [])
    multi = Profile("vllm", 1, nodes=2)
    assert reasons(cluster.place(multi)) == (
        "a0: degraded: fabric ib-a is down",
        "a1: degraded: fabric ib-a is down",
    )
    assert nodes_of(cluster.place(VLLM)) == ["a0"]  # single-node replicas still go there
    # A node on a second, healthy fabric takes multi-node replicas over that one.
    both = [node(f"b{i}", fabrics=("ib-b",), degraded=(IB_A_DOWN,)) for i in range(2)]
    result = Cluster(both, []).place(multi)
    assert isinstance(result, Placement) and {s.fabric for s in result.shards} == {"ib-b"}


def test_a_degraded_node_on_a_uniform_fabric_is_left_out_of_the_count() -> None:
    # Every node on ib-a offers vllm with the same GPUs: the fast count must still see that
    # one of them cannot run anything.
    views = [node("f1", fabrics=("ib-a",), degraded=(DOCKER,))] + [
        node(f"f{i}", fabrics=("ib-a",)) for i in (2, 3)
    ]
    multi = Profile("vllm", 1, nodes=2)
    assert sorted(nodes_of(Cluster(views, []).place(multi))) == ["f2", "f3"]
    three = Profile("vllm", 1, nodes=3)
    result = Cluster(views, []).place(three)
    assert reasons(result)[0] == f"f1: degraded: {DOCKER.message}"
    assert reasons(result)[-1] == "fabric ib-a: 2 of 3 nodes free, needs 3"


def test_a_reason_a_newer_agent_gives_blocks_nothing() -> None:
    newer = DegradedReason("thermal", "GPU 3 is throttling")
    view = node("n1", degraded=(newer,))
    assert degraded_refusal(view.degraded, view.fabrics, VLLM) == ""
    assert nodes_of(Cluster([view], []).place(VLLM)) == ["n1"]
