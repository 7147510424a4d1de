"""The placement index against a brute-force reference: on random clusters (mixed GPU sizes,
fabrics, engines held back, degraded and unusable nodes, sources, stale and conflicting
allocations), each placement is the best node by the rules computed from scratch and each
refusal gives every node's reason as the per-node rules give it, after any sequence of
places and releases; and the reasons grouped per group of nodes say the same as per node."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.contracts.inventory import DegradedCode, DegradedReason
from llmgw.contracts.model_sources import NodeSources, SourceSpec
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
ROOT = "/srv/models"
SHA = "cd" * 32
ENGINES = ("vllm", "sim", "llamacpp")
FABRICS = ("ib-a", "ib-b", "ib-c")

# -- the reference: every rule, node by node ------------------------------------------------


def usable(view: NodeView) -> bool:
    return view.approved and view.connected and not view.draining and not view.lost


def size(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"


def why_not(view: NodeView, held: set[str], profile: Profile, avoid: frozenset[str]) -> str:
    """Why the node cannot take a shard of ``profile``, in the order the rules are checked;
    "" when it can."""
    if not view.approved:
        return view.state if view.state and view.state != "approved" else "not approved"
    if view.lost:
        return "lost"
    if not view.connected:
        return "not connected"
    if view.draining:
        return "draining"
    if view.id in avoid:
        return "avoided for this replica"
    for engine, why in view.held_engines:
        if engine == profile.engine:
            return why
    refusal = degraded_refusal(view.degraded, view.fabrics, profile)
    if refusal:
        return refusal
    if profile.engine not in view.engines:
        return f"engine {profile.engine} not offered (installed: {', '.join(sorted(view.engines)) or 'none'})"
    if profile.nodes > 1 and not view.fabrics:
        return "no fabric (multi-node replicas need one)"
    if profile.source is not None and view.sources is not None:
        problem = view.sources.problem(profile.source)
        if problem:
            return problem
    need = profile.gpus
    if need == 0:
        return ""
    total = len(view.gpus)
    if total == 0:
        return f"no GPUs, needs {need}"
    memory = profile.gpu_memory_mib
    large = [g for g in view.gpus if g.memory_total_mib >= memory]
    free = [g for g in large if g.uuid not in held]
    if len(large) < total:
        if len(large) < need:
            return f"{len(large)} of {total} GPUs have {size(memory)}, needs {need}"
        if len(free) < need:
            return f"{len(free)} of {len(large)} GPUs with {size(memory)} free, needs {need}"
        return ""
    if len(free) < need:
        return f"{len(free)} of {total} GPUs free, needs {need}"
    return ""


def reference_reasons(
    views: Sequence[NodeView],
    allocations: Sequence[Allocation],
    profile: Profile,
    avoid: frozenset[str],
) -> tuple[str, ...]:
    if not views:
        return ("no nodes have joined",)
    held = {g for a in allocations for g in a.gpus}
    ordered = sorted(views, key=lambda v: v.id)
    whys = {v.id: why_not(v, held, profile, avoid) for v in ordered}
    lines = [f"{v.id}: {whys[v.id]}" for v in ordered if whys[v.id]]
    source = profile.source
    if source is not None:
        checked = [
            v
            for v in ordered
            if v.sources is not None
            and usable(v)
            and profile.engine in offered_engines(v)
            and not (profile.nodes > 1 and not v.fabrics)
        ]
        problems = {v.id: v.sources.problem(source) for v in checked if v.sources is not None}
        if checked and all(problems.values()):
            if source.fetched:
                what = f"no node may fetch source {source.text}"
                fix = "list its place in a node's install_sources (agent.yaml), or give an https:// URL"
            else:
                what = f"no node has source {source.text} under models_root"
                fix = "copy the weights under a node's models_root, or fix the profile's source"
            plain = {
                f"{n}: {p}"
                for n, p in problems.items()
                if p.startswith(("no source ", "may not fetch "))
            }
            names = ", ".join(v.id for v in checked)
            lines = [f"{what}; nodes checked: {names} ({fix})"] + [
                r for r in lines if r not in plain
            ]
    if profile.nodes > 1:
        for fabric in sorted({f for v in views for f in v.fabrics}):
            on = [v for v in views if fabric in v.fabrics]
            fits = sum(1 for v in on if not whys[v.id])
            nodes = f"{len(on)} node" if len(on) == 1 else f"{len(on)} nodes"
            lines.append(f"fabric {fabric}: {fits} of {nodes} free, needs {profile.nodes}")
    return tuple(lines)


def reference_placement(
    views: Sequence[NodeView],
    allocations: Sequence[Allocation],
    profile: Profile,
    strategy: str,
    avoid: frozenset[str],
) -> tuple[ShardPlacement, ...] | None:
    """The best shards for the strategy, ranked from scratch; None when there are none."""
    held = {g for a in allocations for g in a.gpus}
    free = {v.id: sum(g.uuid not in held for g in v.gpus) for v in views}
    count = Counter(a.node_id for a in allocations)

    def key(v: NodeView) -> tuple[object, ...]:
        if profile.gpus and strategy == "binpack":
            rank: tuple[int, ...] = (free[v.id],)
        elif profile.gpus:
            rank = (-free[v.id], count[v.id])
        elif strategy == "binpack":
            rank = (free[v.id], count[v.id])
        else:
            rank = (count[v.id], -free[v.id])
        return (*rank, v.id)

    ok = sorted((v for v in views if not why_not(v, held, profile, avoid)), key=key)
    memory = profile.gpu_memory_mib if profile.gpus else 0

    def gpus(v: NodeView) -> tuple[str, ...]:
        fit = [g for g in v.gpus if g.uuid not in held and g.memory_total_mib >= memory]
        if memory:
            fit.sort(key=lambda g: g.memory_total_mib)
        return tuple(g.uuid for g in fit[: profile.gpus])

    if profile.nodes == 1:
        return (ShardPlacement(ok[0].id, 0, gpus(ok[0]), None),) if ok else None
    by_fabric = {f: [v for v in ok if f in v.fabrics] for f in {f for v in ok for f in v.fabrics}}
    spare = {f: len(vs) - profile.nodes for f, vs in by_fabric.items() if len(vs) >= profile.nodes}
    if not spare:
        return None
    sign = 1 if strategy == "binpack" else -1
    fabric = min(spare, key=lambda f: (sign * spare[f], f))
    chosen = by_fabric[fabric][: profile.nodes]
    return tuple(ShardPlacement(v.id, r, gpus(v), fabric) for r, v in enumerate(chosen))


def group_counts(result: Unplaceable) -> Counter[str]:
    """Per reason, how many nodes the grouped lines say share it."""
    counts: Counter[str] = Counter()
    for line in result.lines:
        if not _about_a_node(line):
            continue
        names, why = line.split(": ", 1)
        more = re.fullmatch(r"(.+) and (\d+) other nodes", names)
        counts[why] += int(more.group(2)) + 2 if more else len(names.split(", "))
    return counts


# -- random clusters -----------------------------------------------------------------------

DEGRADED = [
    DegradedReason(DegradedCode.DOCKER, "dockerd cannot be reached"),
    DegradedReason(DegradedCode.ENGINE, "engine vllm will not run", engine="vllm"),
    DegradedReason(DegradedCode.GPUS, "no GPU driver"),
    DegradedReason(DegradedCode.FABRIC, "fabric ib-z is down", fabric="ib-z"),
    DegradedReason("a-newer-code", "something a newer agent knows"),
]


def node_sources(names: Sequence[str], prefixes: Sequence[str]) -> NodeSources:
    return NodeSources(
        {
            "models_root": ROOT,
            "entries": [{"name": n, "size_bytes": 1, "dir": True} for n in names],
            "listed_depth": 3,
            "fetch_prefixes": list(prefixes),
            "cached": [],
            "problem": "",
        }
    )


GPU_SHAPES = [
    (80 * GIB,) * 8,
    (80 * GIB,) * 8,
    (),
    (24 * GIB,) * 4,
    (24 * GIB, 80 * GIB) * 4,
    (48 * GIB, 80 * GIB, 24 * GIB),
]
ENGINE_SETS = [frozenset({"vllm", "sim"}), frozenset({"sim"}), frozenset(ENGINES), frozenset()]


@st.composite
def node_views(draw: st.DrawFn, node_id: str) -> NodeView:
    """A node like most others but for a few things (so that nodes alike but for one rule
    share most of what decides, and kinds both hold several nodes and split them)."""
    changes = set(
        draw(
            st.lists(
                st.sampled_from(["gpus", "engines", "held", "degraded", "flags", "fabrics"]),
                max_size=2,
            )
        )
    )
    sizes = draw(st.sampled_from(GPU_SHAPES)) if "gpus" in changes else GPU_SHAPES[0]
    flags = (
        draw(st.sampled_from(["pending", "unapproved", "lost", "gone", "draining"]))
        if ("flags" in changes)
        else "ok"
    )
    engines = draw(st.sampled_from(ENGINE_SETS)) if "engines" in changes else ENGINE_SETS[0]
    held: tuple[tuple[str, str], ...] = ()
    if "held" in changes:
        held = (("vllm", "vllm 0.9 is being installed"),)
    fabrics: tuple[str, ...] = ("ib-a",)
    if "fabrics" in changes:
        fabrics = draw(st.sampled_from([(), ("ib-b",), ("ib-b", "ib-a")]))
    degraded = (draw(st.sampled_from(DEGRADED)),) if "degraded" in changes else ()
    sources = None
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from(["llama", "qwen"]), unique=True))
        prefixes = ["http://10.0.0.2/"] if draw(st.booleans()) else []
        sources = node_sources(names, prefixes)
    return NodeView(
        id=node_id,
        approved=flags not in ("pending", "unapproved"),
        connected=flags not in ("lost", "gone"),
        draining=flags == "draining",
        lost=flags == "lost",
        engines=engines,
        gpus=tuple(GpuView(f"{node_id}-g{i}", m) for i, m in enumerate(sizes)),
        fabrics=fabrics,
        state="pending" if flags == "pending" else "",
        held_engines=held,
        sources=sources,
        degraded=degraded,
    )


SOURCES = [
    None,
    None,
    SourceSpec("llama"),
    SourceSpec("absent"),
    SourceSpec("http://10.0.0.2/w.gguf", SHA),
    SourceSpec("http://10.0.0.9/w.gguf", SHA),
]


@st.composite
def profiles(draw: st.DrawFn) -> Profile:
    gpus = draw(st.sampled_from([0, 1, 2, 4, 8]))
    return Profile(
        draw(st.sampled_from(["vllm", "vllm", "sim", "llamacpp"])),
        gpus,
        nodes=draw(st.sampled_from([1, 1, 2, 3])),
        gpu_memory_mib=draw(st.sampled_from([0, 0, 40 * GIB, 80 * GIB])) if gpus else 0,
        source=draw(st.sampled_from(SOURCES)),
    )


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeView], list[Allocation]]:
    count = draw(st.integers(0, 14))
    views = [draw(node_views(f"n{i:02d}")) for i in range(count)]
    allocations = []
    for r in range(draw(st.integers(0, 10))):
        if not views:
            break
        view = draw(st.sampled_from(views))
        uuids = [g.uuid for g in view.gpus] + ["GPU-gone"]  # one the inventory no longer lists
        taken = draw(st.lists(st.sampled_from(uuids), unique=True, max_size=4))
        allocations.append(Allocation(f"old{r}", f"old{r}-s0", view.id, tuple(taken)))
    return views, allocations


TEMPLATES = [
    ((80 * GIB,) * 8, ("ib-a",)),
    ((80 * GIB,) * 8, ("ib-a",)),
    ((80 * GIB,) * 8, ("ib-b",)),
    ((48 * GIB,) * 4, ("ib-b",)),
    ((24 * GIB, 80 * GIB) * 4, ("ib-a", "ib-b")),
]


@st.composite
def fleets(draw: st.DrawFn) -> tuple[list[NodeView], list[Allocation]]:
    """Many nodes of a few kinds, partly full: buckets of several nodes each, where order
    and counts within and across buckets show."""
    views = []
    for i in range(draw(st.integers(8, 40))):
        sizes, fabrics = draw(st.sampled_from(TEMPLATES))
        views.append(
            NodeView(
                id=f"f{i:02d}",
                approved=True,
                connected=True,
                draining=False,
                lost=False,
                engines=frozenset({"vllm", "sim"}),
                gpus=tuple(GpuView(f"f{i:02d}-g{g}", m) for g, m in enumerate(sizes)),
                fabrics=fabrics,
            )
        )
    allocations = []
    for view in views:
        uuids = [g.uuid for g in view.gpus]
        taken = draw(st.lists(st.sampled_from(uuids), unique=True, max_size=len(uuids)))
        parts = draw(st.integers(1, 3))
        for p in range(parts):
            if taken[p::parts]:
                replica = f"old-{view.id}-{p}"
                allocations.append(
                    Allocation(replica, f"{replica}-s0", view.id, tuple(taken[p::parts]))
                )
    return views, allocations


Step = tuple[str, Profile, str, frozenset[str], int]


@st.composite
def fleet_profiles(draw: st.DrawFn) -> Profile:
    """GPU work, often multi-node, often asking for large GPUs (which mixed nodes have only
    some of)."""
    return Profile(
        "vllm",
        draw(st.sampled_from([1, 2, 4, 8])),
        nodes=draw(st.sampled_from([1, 2, 3])),
        gpu_memory_mib=draw(st.sampled_from([0, 40 * GIB, 80 * GIB])),
    )


@st.composite
def operations(
    draw: st.DrawFn, ids: Sequence[str], kinds: st.SearchStrategy[Profile] | None = None
) -> Step:
    avoid = frozenset(draw(st.lists(st.sampled_from(ids), max_size=2))) if ids else frozenset()
    return (
        draw(st.sampled_from(["place", "place", "place", "release"])),
        draw(kinds if kinds is not None else profiles()),
        draw(st.sampled_from(["binpack", "spread"])),
        avoid,
        draw(st.integers(0, 100)),
    )


# -- the properties --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_places_and_refusals_match_the_reference_after_any_sequence(data: st.DataObject) -> None:
    check_against_the_reference(data, *data.draw(clusters()), steps=12)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_a_fleet_of_a_few_kinds_matches_the_reference(data: st.DataObject) -> None:
    check_against_the_reference(data, *data.draw(fleets()), steps=30, kinds=fleet_profiles())


def check_against_the_reference(
    data: st.DataObject,
    views: list[NodeView],
    allocations: list[Allocation],
    steps: int,
    kinds: st.SearchStrategy[Profile] | None = None,
) -> None:
    ids = [v.id for v in views] + ["not-a-node"]
    cluster = Cluster(views, allocations)
    truth = list(allocations)
    refusals: list[tuple[Unplaceable, tuple[str, ...]]] = []
    for n, (op, profile, strategy, avoid, pick) in enumerate(
        data.draw(st.lists(operations(ids, kinds), max_size=steps))
    ):
        if op == "release":
            replicas = sorted({a.replica_id for a in truth})
            if replicas:
                gone = replicas[pick % len(replicas)]
                cluster.release(gone)
                truth = [a for a in truth if a.replica_id != gone]
            continue
        expected = reference_placement(views, truth, profile, strategy, avoid)
        result = cluster.place(profile, strategy=strategy, avoid=avoid, replica_id=f"r{n}")
        if expected is None:
            assert isinstance(result, Unplaceable), (profile, strategy, avoid, result)
            # Kept to be read later: what it says must be the cluster as it was then.
            refusals.append((result, reference_reasons(views, truth, profile, avoid)))
            continue
        assert isinstance(result, Placement), (profile, strategy, avoid, result)
        assert result.shards == expected
        truth.extend(
            Allocation(f"r{n}", f"r{n}-s{s.rank}", s.node_id, s.gpus) for s in result.shards
        )
    for result, expected_reasons in refusals:
        assert result.reasons == expected_reasons
        per_node = Counter(r.split(": ", 1)[1] for r in expected_reasons if _about_a_node(r))
        assert group_counts(result) == per_node
    # The view after it all answers as one built afresh.
    fresh = Cluster(views, truth)
    for view in views:
        assert cluster.free_gpus(view.id) == fresh.free_gpus(view.id)


def _about_a_node(reason: str) -> bool:
    return not reason.startswith(("fabric ", "no node has ", "no node may ", "no nodes have "))


# -- groups ----------------------------------------------------------------------------------


def eight(node_id: str, fabrics: tuple[str, ...] = ()) -> NodeView:
    return NodeView(
        id=node_id,
        approved=True,
        connected=True,
        draining=False,
        lost=False,
        engines=frozenset({"vllm", "sim"}),
        gpus=tuple(GpuView(f"{node_id}-g{i}", 80 * GIB) for i in range(8)),
        fabrics=fabrics,
    )


def test_a_large_refusal_is_told_per_group_and_in_full_on_demand() -> None:
    views = [eight(f"n{i:03d}") for i in range(300)]
    views[7] = dataclasses.replace(views[7], draining=True)
    allocations = [
        Allocation(
            f"r{i}", f"r{i}-s0", f"n{i:03d}", tuple(f"n{i:03d}-g{g}" for g in range(8 - i % 3))
        )
        for i in range(300)
    ]
    result = Cluster(views, allocations).place(Profile("vllm", 4))
    assert isinstance(result, Unplaceable)
    # n000 holds 8 GPUs (0 free), n001 7 (1 free), n002 6 (2 free), and so on; the largest
    # groups first, the first node breaking ties.
    assert result.lines == (
        "n000, n003 and 98 other nodes: 0 of 8 GPUs free, needs 4",
        "n002, n005 and 98 other nodes: 2 of 8 GPUs free, needs 4",
        "n001, n004 and 97 other nodes: 1 of 8 GPUs free, needs 4",
        "n007: draining",
    )
    assert result.summary(limit=8) == "; ".join(result.lines)
    assert result.summary(limit=2) == "; ".join(result.lines[:2]) + "; and 2 more"
    assert len(result.reasons) == 300
    assert result.reasons[:3] == (
        "n000: 0 of 8 GPUs free, needs 4",
        "n001: 1 of 8 GPUs free, needs 4",
        "n002: 2 of 8 GPUs free, needs 4",
    )
    assert result.reasons[7] == "n007: draining"


def test_a_small_refusal_is_told_per_node() -> None:
    views = [eight("a"), eight("b"), dataclasses.replace(eight("c"), lost=True)]
    allocations = [Allocation("r", "r-s0", v, tuple(f"{v}-g{g}" for g in range(8))) for v in "ab"]
    result = Cluster(views, allocations).place(Profile("vllm", 1))
    assert isinstance(result, Unplaceable)
    assert result.summary(limit=8) == (
        "a: 0 of 8 GPUs free, needs 1; b: 0 of 8 GPUs free, needs 1; c: lost"
    )
    assert result.lines == ("a, b: 0 of 8 GPUs free, needs 1", "c: lost")


def test_a_multi_node_refusal_leads_with_the_fabrics() -> None:
    views = [eight(f"a{i:02d}", ("ib-a",)) for i in range(20)]
    views += [eight(f"b{i:02d}", ("ib-b",)) for i in range(20)]
    allocations = [
        Allocation(f"r{i}", f"r{i}-s0", v.id, tuple(g.uuid for g in v.gpus[:6]))
        for i, v in enumerate(views)
        if v.id not in ("a03", "b11")
    ]
    result = Cluster(views, allocations).place(Profile("vllm", 4, nodes=2))
    assert isinstance(result, Unplaceable)
    assert result.summary(limit=8) == (
        "fabric ib-a: 1 of 20 nodes free, needs 2; fabric ib-b: 1 of 20 nodes free, needs 2; "
        "a00, a01 and 36 other nodes: 2 of 8 GPUs free, needs 4"
    )


def test_the_source_headline_names_a_few_nodes_of_many() -> None:
    src = node_sources(["qwen"], [])
    views = [dataclasses.replace(eight(f"n{i:02d}"), sources=src) for i in range(30)]
    result = Cluster(views, []).place(Profile("vllm", 1, source=SourceSpec("llama")))
    assert isinstance(result, Unplaceable)
    assert result.summary(limit=8) == (
        "no node has source llama under models_root; nodes checked: n00, n01 and 28 other "
        "nodes (copy the weights under a node's models_root, or fix the profile's source)"
    )
    names = ", ".join(f"n{i:02d}" for i in range(30))
    assert result.reasons == (
        f"no node has source llama under models_root; nodes checked: {names} (copy the "
        "weights under a node's models_root, or fix the profile's source)",
    )


def test_a_pool_built_after_placements_sees_them() -> None:
    # The 8-GPU profile's pool is built after the 1-GPU one has placed: it must see them.
    cluster = Cluster([eight("a"), eight("b")], [])
    for n in range(2):
        assert isinstance(cluster.place(Profile("vllm", 1), replica_id=f"r{n}"), Placement)
    placed = cluster.place(Profile("vllm", 8), replica_id="big")
    assert isinstance(placed, Placement) and placed.shards[0].node_id == "b"
    refused = cluster.place(Profile("vllm", 8))
    assert isinstance(refused, Unplaceable)
    assert refused.reasons == ("a: 6 of 8 GPUs free, needs 8", "b: 0 of 8 GPUs free, needs 8")
    # Both pools follow a release.
    cluster.release("big")
    cluster.release("r0")
    cluster.release("r1")
    again = cluster.place(Profile("vllm", 8), replica_id="big2")
    assert isinstance(again, Placement) and again.shards[0].node_id == "a"
    one = cluster.place(Profile("vllm", 1))
    assert isinstance(one, Placement) and one.shards[0].node_id == "b"


def test_a_refusal_says_what_was_true_when_it_was_made() -> None:
    cluster = Cluster([eight("a")], [Allocation("r", "r-s0", "a", ("a-g0", "a-g1"))])
    refused = cluster.place(Profile("vllm", 8))
    cluster.release("r")
    assert isinstance(cluster.place(Profile("vllm", 3), replica_id="s"), Placement)
    assert isinstance(refused, Unplaceable)
    assert refused.reasons == ("a: 6 of 8 GPUs free, needs 8",)


def test_equal_refusals_compare_equal_however_built() -> None:
    built = Cluster([dataclasses.replace(eight("a"), draining=True)], []).place(Profile("vllm", 1))
    assert built == Unplaceable(("a: draining",))
    assert hash(built) == hash(Unplaceable(("a: draining",)))


def test_a_mixed_node_counts_for_a_multi_node_replica_only_with_its_large_gpus_free() -> None:
    # Four nodes of 24 and 80 GiB GPUs (two of each) on one fabric; on m0 and m1 both 80 GiB
    # GPUs are held: they have 2 GPUs free, but none large enough.
    views = [
        dataclasses.replace(
            eight(f"m{i}", ("ib-a",)),
            gpus=tuple(GpuView(f"m{i}-g{g}", (24 if g % 2 == 0 else 80) * GIB) for g in range(4)),
        )
        for i in range(4)
    ]
    allocations = [
        Allocation(f"r{i}", f"r{i}-s0", f"m{i}", (f"m{i}-g1", f"m{i}-g3")) for i in (0, 1)
    ]
    large = Profile("vllm", 2, nodes=3, gpu_memory_mib=40 * GIB)
    result = Cluster(views, allocations).place(large)
    assert isinstance(result, Unplaceable)
    assert result.reasons == (
        "m0: 0 of 2 GPUs with 40 GiB free, needs 2",
        "m1: 0 of 2 GPUs with 40 GiB free, needs 2",
        "fabric ib-a: 2 of 4 nodes free, needs 3",
    )
    two = Cluster(views, allocations).place(dataclasses.replace(large, nodes=2))
    assert isinstance(two, Placement)
    assert [(s.node_id, s.gpus) for s in two.shards] == [
        ("m2", ("m2-g1", "m2-g3")),
        ("m3", ("m3-g1", "m3-g3")),
    ]


def test_nodes_alike_but_for_a_degraded_reason_are_told_apart() -> None:
    docker = DEGRADED[0]
    full = [Allocation("r", "r-s0", "b", tuple(f"b-g{g}" for g in range(6)))]
    # b would win binpack (fewest free), but dockerd is away there.
    views = [eight("a"), dataclasses.replace(eight("b"), degraded=(docker,)), eight("c")]
    placed = Cluster(views, full).place(Profile("vllm", 1))
    assert isinstance(placed, Placement) and placed.shards[0].node_id == "a"
    # The degraded node first in id order does not keep the healthy one off.
    views = [dataclasses.replace(eight("a"), degraded=(docker,)), eight("b")]
    placed = Cluster(views, full).place(Profile("vllm", 1))
    assert isinstance(placed, Placement) and placed.shards[0].node_id == "b"
