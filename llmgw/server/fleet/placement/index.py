"""The index placement chooses from: each node's GPUs and what holds them, the usable nodes
grouped into kinds (alike in everything that decides whether a profile may use them), and per
kind of profile a pool of the nodes that may take its shards, by free GPUs, allocations and
fabric, with the others grouped by why not.

A pool is built once per cluster view for each kind of profile (engine, GPUs or none, one
node or several, GPU memory, source), judging each kind of node once and each node's source
once, and is kept by every place and release after. So choosing a node walks the pool's
buckets best-first and usually stops at the first node, and a refusal adds up buckets and
groups rather than asking every node why.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import groupby
from operator import itemgetter

from llmgw.contracts.model_sources import SourceSpec
from llmgw.server.fleet.placement.refusal import PLAIN_SOURCE_PROBLEMS, Headline, size_text
from llmgw.server.fleet.placement.views import NodeView, Profile, degraded_refusal, offered_engines

__all__ = [
    "Kind",
    "NodeState",
    "Pool",
    "Signature",
    "Sizes",
    "kinds_of",
    "signature",
    "unusable_reason",
]

# A node's place in a pool: (free GPUs, allocations, GPUs, GPUs large enough for the pool).
Key = tuple[int, int, int, int]
Buckets = dict[Key, list[str]]
# What a pool is for: (engine, needs GPUs, multi-node, GPU memory, source, host memory).
Signature = tuple[str, bool, bool, int, SourceSpec | None, int]
# GPU sizes as nodes report them, each with its minimum: a few serve every node of a view.
Sizes = dict[tuple[int, ...], tuple[tuple[int, ...], int]]


def signature(profile: Profile) -> Signature:
    memory = profile.gpu_memory_mib if profile.gpus else 0
    return (
        profile.engine,
        profile.gpus > 0,
        profile.nodes > 1,
        memory,
        profile.source,
        profile.host_memory_mib,
    )


def unusable_reason(view: NodeView) -> str:
    """Why the node takes no shard of any profile; "" when it may take some."""
    if not view.approved:
        return view.state if view.state and view.state != "approved" else "not approved"
    if view.lost:
        return "lost"
    if not view.connected:
        return "not connected"
    if view.draining:
        return "draining"
    return ""


class NodeState:
    """One node and what holds its GPUs, for the life of a cluster view."""

    __slots__ = (
        "allocs",
        "blocked",
        "dozing",
        "engines",
        "fabrics",
        "free",
        "held",
        "host_sleepers",
        "host_total",
        "host_used",
        "id",
        "kind",
        "min_mem",
        "order",
        "sizes",
        "view",
    )

    def __init__(self, view: NodeView, shapes: Sizes) -> None:
        self.view = view
        self.id = view.id
        gpus = view.gpus
        self.order = tuple([g.uuid for g in gpus])
        sizes = tuple([g.memory_total_mib for g in gpus])
        # Most nodes have GPUs like many others: one tuple and its minimum for them all
        # (``shapes``, shared by the nodes of a view).
        shared = shapes.get(sizes)
        if shared is None:
            shared = shapes[sizes] = (sizes, min(sizes, default=0))
        self.sizes, self.min_mem = shared
        # How many allocations hold each GPU held; more than one only if the caller's
        # allocations already conflict, and then it stays taken until every one is released.
        self.held: dict[str, int] = {}
        # A cordoned or unhealthy GPU is held for good (one hold no release undoes), and
        # named where a refusal counts the node's free GPUs.
        self.blocked = tuple([g.blocked_text() for g in gpus if g.blocked])
        if self.blocked:
            self.held = {g.uuid: 1 for g in gpus if g.blocked}
        self.free = len(self.order) - len(self.held)
        self.allocs = 0
        fabrics = view.fabrics
        self.fabrics = fabrics if len(fabrics) < 2 else tuple(sorted(set(fabrics)))
        self.engines = offered_engines(view)
        # Its kind's index in the view's kinds (-1: not usable). An index, not the kind, so
        # that a view holds no reference cycle and is freed as soon as it is dropped.
        self.kind = -1
        # Host memory (MiB): the node's (0: unknown), what its sleepers hold, and what its
        # allocations' profiles declare.
        self.host_total = view.host_total_mib
        self.host_sleepers = 0
        self.host_used = 0
        # The GPUs of its asleep replicas: free, but taken back when they wake, so used
        # last (a replica placed on one makes its sleeper's wake a start elsewhere).
        self.dozing: frozenset[str] = frozenset()

    def host_room(self, sleepers_free: bool = False) -> int | None:
        """The host memory (MiB) neither its sleepers (unless ``sleepers_free``) nor its
        allocations hold; None when the node's is unknown."""
        if not self.host_total:
            return None
        held = self.host_used + (0 if sleepers_free else self.host_sleepers)
        return self.host_total - held

    def host_fits(self, need: int, sleepers_free: bool = False) -> bool:
        """Whether ``need`` MiB of host memory is free (always, when unknown or not asked)."""
        if not need:
            return True
        room = self.host_room(sleepers_free)
        return room is None or room >= need

    def host_refusal(self, need: int) -> str:
        """Why ``need`` MiB of host memory is not free here, as a refusal says it."""
        parts = []
        if self.host_sleepers:
            parts.append(f"sleepers hold {size_text(self.host_sleepers)}")
        if self.host_used:
            verb = "and replicas" if parts else "replicas hold"
            parts.append(f"{verb} {size_text(self.host_used)}")
        held = f"{' '.join(parts)} of " if parts else ""
        total = size_text(self.host_total)
        return f"{held}{total} host memory; needs {size_text(need)}"

    def hold(self, gpus: Iterable[str], host_mib: int = 0) -> None:
        """An allocation of ``gpus`` added: :meth:`count` with +1, for the many allocations
        a view starts with."""
        self.allocs += 1
        self.host_used += host_mib
        held = self.held
        order = self.order
        for uuid in gpus:
            if uuid in held:
                held[uuid] += 1
            elif uuid in order:
                held[uuid] = 1
        self.free = len(order) - len(held)

    def count(self, gpus: Iterable[str], sign: int, host_mib: int = 0) -> None:
        """An allocation of ``gpus`` (and ``host_mib`` of host memory) added (+1) or
        released (-1)."""
        self.allocs += sign
        self.host_used += sign * host_mib
        held = self.held
        for uuid in gpus:
            if uuid not in self.order:
                continue  # a GPU the inventory no longer lists
            now = held.get(uuid, 0) + sign
            if now > 0:
                held[uuid] = now
            else:
                held.pop(uuid, None)
            if sign > 0 and now == 1:
                self.free -= 1
            elif sign < 0 and now == 0:
                self.free += 1

    def fit(self, memory_mib: int) -> int:
        """Free GPUs with at least ``memory_mib``."""
        if memory_mib <= self.min_mem:
            return self.free
        held = self.held
        return sum(
            1
            for u, m in zip(self.order, self.sizes, strict=True)
            if m >= memory_mib and u not in held
        )

    def awake_fit(self, memory_mib: int) -> int:
        """Free GPUs with at least ``memory_mib`` that no asleep replica will take back."""
        held, dozing = self.held, self.dozing
        return sum(
            1
            for u, m in zip(self.order, self.sizes, strict=True)
            if m >= memory_mib and u not in held and u not in dozing
        )

    def pick(self, count: int, memory_mib: int) -> tuple[str, ...]:
        held = self.held
        free = [
            (m, u)
            for u, m in zip(self.order, self.sizes, strict=True)
            if m >= memory_mib and u not in held
        ]
        if memory_mib > 0:
            # Best fit: the smallest GPUs that are large enough keep the large ones free.
            free.sort(key=lambda g: g[0])
        if self.dozing:
            dozing = self.dozing
            free.sort(key=lambda g: g[1] in dozing)  # stable: best fit within each
        return tuple(u for _m, u in free[:count])

    def free_gpus(self) -> tuple[str, ...]:
        held = self.held
        return tuple(u for u in self.order if u not in held)


class Kind:
    """Usable nodes alike in what they offer and hold back, why they are degraded, whether
    they are on a fabric and the sizes of their GPUs: whether a profile may use one of them,
    its source and free GPUs aside, holds for them all."""

    __slots__ = ("index", "members", "pools", "view")

    def __init__(self, index: int, first: NodeState) -> None:
        self.index = index
        self.view = first.view
        self.members: list[NodeState] = []  # in id order
        self.pools: list[Pool] = []  # the pools it belongs to

    def refusal(self, profile: Profile) -> str:
        """Why its nodes may take no shard of ``profile`` whatever their source and GPUs;
        "" when they may."""
        view = self.view
        engine = profile.engine
        held = next((why for name, why in view.held_engines if name == engine), "")
        if held:
            return held
        refusal = degraded_refusal(view.degraded, view.fabrics, profile) if view.degraded else ""
        if refusal:
            return refusal
        if engine not in view.engines:
            installed = ", ".join(sorted(view.engines)) or "none"
            return f"engine {engine} not offered (installed: {installed})"
        if profile.nodes > 1 and not view.fabrics:
            return "no fabric (multi-node replicas need one)"
        return ""


def kinds_of(nodes: Iterable[NodeState]) -> list[Kind]:
    """The usable ``nodes`` (in id order) by kind; each node's ``kind`` set."""
    kinds: dict[object, Kind] = {}
    for node in nodes:
        view = node.view
        key = (view.engines, view.held_engines, view.degraded, not view.fabrics, node.sizes)
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = Kind(len(kinds), node)
        kind.members.append(node)
        node.kind = kind.index
    return list(kinds.values())


class Pool:
    """The usable nodes that may take a shard of one kind of profile, their source and
    free GPUs aside, bucketed by :data:`Key` overall and (multi-node) per fabric, each
    bucket in id order; and the others, grouped by why they may not."""

    def __init__(self, profile: Profile, kinds: Sequence[Kind]) -> None:
        engine, gpus, multi, memory, source, host = signature(profile)
        self.memory = memory
        self.host = host
        self.buckets: Buckets = {}
        self.by_fabric: dict[str, Buckets] = {}
        # Per kind in the pool (by index), its nodes' (GPUs, GPUs large enough).
        self.shapes: dict[int, tuple[int, int]] = {}
        # With a source, the nodes in the pool (of the kinds in it, those that have it).
        self.members: set[str] | None = None if source is None else set()
        # Refused whatever their free GPUs: reason -> node ids; and, with the words of the
        # profile's GPU count, nodes with no GPUs, and nodes with none large enough (by count).
        self.refused: dict[str, list[str]] = {}
        self.gpuless: list[str] = []
        self.small: dict[int, list[str]] = {}
        self.headline: Headline | None = None
        sourced: dict[str, list[str]] = {}
        checked: list[str] = []
        found = False
        for kind in kinds:
            why = kind.refusal(profile)
            members = kind.members
            reached = engine in kind.members[0].engines and not (multi and not kind.view.fabrics)
            if source is not None and reached:
                # Every node that gets as far as the source check is named by the headline,
                # even one a degraded reason keeps off after all.
                kept = []
                for node in members:
                    if node.view.sources is None:
                        kept.append(node)
                        continue
                    checked.append(node.id)
                    problem = node.view.sources.problem(source)
                    if not problem:
                        found = True
                        kept.append(node)
                    elif not why:
                        sourced.setdefault(problem, []).append(node.id)
                members = kept
            if why:
                self.refused.setdefault(why, []).extend(n.id for n in kind.members)
                continue
            if not members:
                continue
            sizes = members[0].sizes
            total = len(sizes)
            large = sum(1 for m in sizes if m >= memory) if gpus else total
            if gpus and total == 0:
                self.gpuless.extend(n.id for n in members)
                continue
            if gpus and large == 0:
                self.small.setdefault(total, []).extend(n.id for n in members)
                continue
            self.shapes[kind.index] = (total, large)
            kind.pools.append(self)
            for node in members:
                if self.members is not None:
                    self.members.add(node.id)
                key = (node.free, node.allocs, total, large)
                self.buckets.setdefault(key, []).append(node.id)
                if multi:
                    for fabric in node.fabrics:
                        self.by_fabric.setdefault(fabric, {}).setdefault(key, []).append(node.id)
        if source is not None and checked and not found:
            self.headline = _headline(source, sorted(checked))
            sourced = {
                p: ids for p, ids in sourced.items() if not p.startswith(PLAIN_SOURCE_PROBLEMS)
            }
        for why, ids in sourced.items():
            self.refused.setdefault(why, []).extend(ids)
        # Several kinds may feed one list: each is in id order again.
        lists: list[list[str]] = [self.gpuless, *self.refused.values(), *self.small.values()]
        lists.extend(self.buckets.values())
        for buckets in self.by_fabric.values():
            lists.extend(buckets.values())
        for ids in lists:
            ids.sort()

    # -- membership ----------------------------------------------------------------------------

    def shape(self, node: NodeState) -> tuple[int, int] | None:
        """The node's (GPUs, GPUs large enough) when it is in the pool, else None."""
        shape = self.shapes.get(node.kind)
        if shape is None or (self.members is not None and node.id not in self.members):
            return None
        return shape

    def insert(self, node: NodeState, shape: tuple[int, int]) -> None:
        key = (node.free, node.allocs, *shape)
        insort(self.buckets.setdefault(key, []), node.id)
        for fabric in node.fabrics:
            by_fabric = self.by_fabric.get(fabric)
            if by_fabric is not None:
                insort(by_fabric.setdefault(key, []), node.id)

    def remove(self, node: NodeState, shape: tuple[int, int]) -> None:
        key = (node.free, node.allocs, *shape)
        _drop(self.buckets, key, node.id)
        for fabric in node.fabrics:
            by_fabric = self.by_fabric.get(fabric)
            if by_fabric is not None:
                _drop(by_fabric, key, node.id)

    def takes(self, node: NodeState, need: int, sleepers_free: bool = False) -> bool:
        """Whether the node is in the pool and has ``need`` free GPUs large enough (and the
        pool's host memory free)."""
        shape = self.shape(node)
        return (
            shape is not None
            and shape[1] >= need
            and node.fit(self.memory) >= need
            and node.host_fits(self.host, sleepers_free)
        )

    # -- choosing ------------------------------------------------------------------------------

    def walk(
        self,
        buckets: Buckets,
        need: int,
        strategy: str,
        avoid: frozenset[str],
        nodes: Mapping[str, NodeState],
        sleepers_free: bool = False,
    ) -> Iterator[NodeState]:
        """The nodes of ``buckets`` with ``need`` free GPUs large enough and the pool's host
        memory free (counting what sleepers hold unless ``sleepers_free``), not in
        ``avoid``, best first for the strategy."""
        keys = [k for k in buckets if k[0] >= need and k[3] >= need]
        rank: Callable[[Key], object]
        if strategy == "binpack":
            # Keys sort as (free GPUs, allocations, ...). With GPUs to pack: fewest free
            # first, node id breaking ties (allocations do not count). With none: keep GPU
            # nodes open for GPU work, and spread over the rest.
            keys.sort()
            rank = _free if need else _free_allocs
        else:  # spread: most free GPUs, then fewest allocations; with none, the reverse
            rank = _spread if need else _spread_none
            keys.sort(key=rank)
        memory, host = self.memory, self.host
        # Nodes that have room only on GPUs their asleep replicas will take back: after
        # every other (a wake that finds its GPUs taken becomes a start elsewhere).
        later: list[NodeState] = []
        for _rank, same in groupby(keys, key=rank):
            lists = [buckets[k] for k in same]
            for node_id in lists[0] if len(lists) == 1 else heapq.merge(*lists):
                if node_id in avoid:
                    continue
                node = nodes[node_id]
                if memory > node.min_mem and node.fit(memory) < need:
                    continue
                if host and not node.host_fits(host, sleepers_free):
                    continue
                if node.dozing and need and node.awake_fit(memory) < need:
                    later.append(node)
                    continue
                yield node
        yield from later

    def count(
        self,
        buckets: Buckets,
        need: int,
        nodes: Mapping[str, NodeState],
        sleepers_free: bool = False,
    ) -> int:
        """How many nodes of ``buckets`` have ``need`` free GPUs large enough (and the
        pool's host memory)."""
        fits = 0
        memory, host = self.memory, self.host
        for (free, _allocs, total, large), ids in buckets.items():
            if free < need or large < need:
                continue
            if host:
                fits += sum(
                    1
                    for node_id in ids
                    if nodes[node_id].fit(memory) >= need
                    and nodes[node_id].host_fits(host, sleepers_free)
                )
            elif large == total:
                fits += len(ids)
            else:
                fits += sum(1 for node_id in ids if nodes[node_id].fit(memory) >= need)
        return fits

    # -- explaining ----------------------------------------------------------------------------

    def explain(
        self,
        groups: dict[str, list[Sequence[str]]],
        need: int,
        avoided: Sequence[str],
        nodes: Mapping[str, NodeState],
    ) -> None:
        """Add to ``groups`` (reason -> sorted runs of node ids) why each node of the pool,
        or refused by it, cannot take a shard needing ``need`` GPUs: all but those that fit
        and those in ``avoided`` (sorted), which the caller explains. Runs are copies where
        the pool's own lists change later."""

        def add(why: str, ids: Sequence[str]) -> None:
            if ids:
                groups.setdefault(why, []).append(ids)

        for why, ids in self.refused.items():
            add(why, _without(ids, avoided))
        if self.host:
            self._explain_host(add, need, set(avoided), nodes)
        if not need:
            return  # every node in the pool has the GPUs (none)
        memory = self.memory
        add(f"no GPUs, needs {need}", _without(self.gpuless, avoided))
        size = size_text(memory) if memory else ""
        for total, ids in self.small.items():
            add(f"0 of {total} GPUs have {size}, needs {need}", _without(ids, avoided))
        skip = set(avoided)
        for (free, _allocs, total, large), ids in self.buckets.items():
            if large == total:
                if free < need:
                    runs = _without(ids, avoided, True)
                    plain = [i for i in runs if not nodes[i].blocked]
                    add(f"{free} of {total} GPUs free, needs {need}", plain)
                    for node_id in runs:
                        if nodes[node_id].blocked:
                            why = ", ".join(nodes[node_id].blocked)
                            add(f"{free} of {total} GPUs free ({why}), needs {need}", [node_id])
            elif large < need:
                add(
                    f"{large} of {total} GPUs have {size}, needs {need}",
                    _without(ids, avoided, True),
                )
            else:
                for node_id in ids:
                    fit = nodes[node_id].fit(memory)
                    if fit < need and node_id not in skip:
                        add(f"{fit} of {large} GPUs with {size} free, needs {need}", [node_id])

    def _explain_host(
        self,
        add: Callable[[str, Sequence[str]], None],
        need: int,
        skip: set[str],
        nodes: Mapping[str, NodeState],
    ) -> None:
        """The nodes of the pool with the GPUs a shard needs but not the host memory."""
        for (free, _allocs, _total, large), ids in self.buckets.items():
            if free < need or large < need:
                continue  # their line says what GPUs they lack
            for node_id in ids:
                node = nodes[node_id]
                if node_id in skip or node.fit(self.memory) < need:
                    continue
                if not node.host_fits(self.host):
                    add(node.host_refusal(self.host), [node_id])


_free = itemgetter(0)
_free_allocs = itemgetter(0, 1)


def _spread(key: Key) -> tuple[int, ...]:
    return (-key[0], key[1])


def _spread_none(key: Key) -> tuple[int, ...]:
    return (key[1], -key[0])


def _headline(source: SourceSpec, checked: list[str]) -> Headline:
    if source.fetched:
        what = f"no node may fetch source {source.text}"
        fix = "list its place in a node's install_sources (agent.yaml), or give an https:// URL"
    else:
        what = f"no node has source {source.text} under models_root"
        fix = "copy the weights under a node's models_root, or fix the profile's source"
    return Headline(what, fix, tuple(checked))


def _without(ids: list[str], drop: Sequence[str], copy: bool = False) -> list[str]:
    """``ids`` (sorted) less those in ``drop``; a new list when ``copy`` or when one goes."""
    out = list(ids) if copy else ids
    for node_id in drop:
        at = bisect_left(out, node_id)
        if at < len(out) and out[at] == node_id:
            if out is ids:
                out = list(ids)
            del out[at]
    return out


def _drop(buckets: Buckets, key: Key, node_id: str) -> None:
    ids = buckets[key]
    del ids[bisect_left(ids, node_id)]
    if not ids:
        del buckets[key]
