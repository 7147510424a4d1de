"""Where replicas go: a pure placement engine (no store, no I/O) that the reconcile loop asks,
once per pass, for the nodes and GPUs of each replica it is missing.

Filter, then score. A node takes a shard when it is approved, connected, not draining, not
lost, offers the engine (and does not hold it back: a desired build not yet installed and
checked there, see :func:`offered_engines`), has the profile's source under its models_root
or may fetch it (:mod:`llmgw.contracts.model_sources`), is not in ``avoid``, is not degraded
for it (:func:`degraded_refusal`) and has enough free GPUs; the shards of a multi-node
replica go to distinct nodes that share one healthy fabric. ``binpack`` fills nodes up
(fewest free GPUs that still fit, and for multi-node the fabric with the fewest spare nodes);
``spread`` prefers the emptiest nodes and fabrics.

GPUs are exclusive: an allocation holds its GPUs whole, and ``gpu_memory_mib`` is a fit check
against each GPU's size, not a share of it. vLLM and SGLang claim a fixed fraction of the
whole GPU when they start (vLLM 0.9 by default), so two engines on one GPU fail unless each is
told its share, which nothing passes them today. A profile with ``gpus == 0`` (the sim engine,
CPU engines) holds no GPU and any number of them may share a node.
"""

from __future__ import annotations

import heapq
import itertools
from bisect import bisect_left, insort
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass

from llmgw.contracts.inventory import DegradedCode, DegradedReason
from llmgw.contracts.model_sources import NodeSources, SourceSpec

__all__ = [
    "STRATEGIES",
    "Allocation",
    "Cluster",
    "GpuView",
    "NodeView",
    "Placement",
    "Profile",
    "ShardPlacement",
    "Unplaceable",
    "degraded_refusal",
    "offered_engines",
]

STRATEGIES = ("binpack", "spread")

# A node's place in the indexes: (free GPUs, allocations on it).
_Key = tuple[int, int]
_Buckets = dict[_Key, list[str]]


@dataclass(frozen=True)
class GpuView:
    uuid: str
    memory_total_mib: int


@dataclass(frozen=True)
class NodeView:
    """One node as placement sees it; built from the store's row and its inventory."""

    id: str
    approved: bool
    connected: bool
    draining: bool
    lost: bool
    engines: frozenset[str]
    gpus: tuple[GpuView, ...]
    fabrics: tuple[str, ...]  # healthy fabrics only; () when the node is on none
    mgmt_addr: str = ""
    # The node's approval state as operators see it (pending, revoked), for reasons.
    state: str = ""
    # Engines held back from this node, each with why: a desired build not yet installed
    # and checked there (llmgw.server.installs).
    held_engines: tuple[tuple[str, str], ...] = ()
    # The model sources it reported; None when its agent reports none (not filtered).
    sources: NodeSources | None = None
    # Why the node is degraded, as its agent reported (llmgw.contracts.inventory).
    degraded: tuple[DegradedReason, ...] = ()


def offered_engines(view: NodeView) -> frozenset[str]:
    """The engines a node may be given replicas of: those it offers, less those held back."""
    if not view.held_engines:
        return view.engines
    return view.engines - {engine for engine, _why in view.held_engines}


@dataclass(frozen=True)
class Profile:
    """What one replica needs: ``nodes`` shards of ``gpus`` GPUs each running ``engine``;
    ``gpu_memory_mib`` > 0 admits only GPUs at least that large (ignored when ``gpus == 0``)."""

    engine: str
    gpus: int
    nodes: int = 1
    gpu_memory_mib: int = 0
    # The weights every shard's node must have under its models_root, or may fetch.
    source: SourceSpec | None = None

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"a profile needs 0 or more GPUs per shard, not {self.gpus}")
        if self.nodes < 1:
            raise ValueError(f"a profile needs 1 or more nodes per replica, not {self.nodes}")
        if self.gpu_memory_mib < 0:
            raise ValueError(f"gpu_memory_mib must be 0 or more, not {self.gpu_memory_mib}")


@dataclass(frozen=True)
class Allocation:
    """One shard already placed: the GPUs it holds on its node."""

    replica_id: str
    shard_id: str
    node_id: str
    gpus: tuple[str, ...]
    gpu_memory_mib: int = 0


@dataclass(frozen=True)
class ShardPlacement:
    node_id: str
    rank: int
    gpus: tuple[str, ...]
    fabric: str | None  # the replica's fabric; None for a single-node replica


@dataclass(frozen=True)
class Placement:
    """Where a replica's shards go, rank 0 first. ``replica_id`` is the id it is recorded
    under in the cluster (the one given to :meth:`Cluster.place`, or a provisional one)."""

    shards: tuple[ShardPlacement, ...]
    replica_id: str = ""


@dataclass(frozen=True)
class Unplaceable:
    """Why no placement exists: one reason per node that cannot take a shard, and for a
    multi-node profile one per fabric, each starting with the node or fabric it is about."""

    reasons: tuple[str, ...]

    def summary(self, limit: int = 5) -> str:
        """The first ``limit`` reasons on one line, and how many more there are."""
        shown = "; ".join(self.reasons[:limit])
        more = len(self.reasons) - limit
        return f"{shown}; and {more} more" if more > 0 else shown


def degraded_refusal(
    degraded: Iterable[DegradedReason], fabrics: Sequence[str], profile: Profile
) -> str:
    """Why a node degraded for these reasons, on these healthy ``fabrics``, cannot take a
    shard of ``profile``; '' when none of its reasons touches it: it keeps the work it can
    do. dockerd unreachable stops everything (every shard is a container); an engine that
    will not run stops that engine; GPUs without a usable driver stop profiles that need
    GPUs; a fabric down stops multi-node replicas when the node has no healthy fabric left
    (the others are placed over a healthy one). A code this control plane does not know
    blocks nothing."""
    for reason in degraded:
        code = reason.code
        if (
            code == DegradedCode.DOCKER
            or (code == DegradedCode.ENGINE and reason.engine == profile.engine)
            or (code == DegradedCode.GPUS and profile.gpus > 0)
            or (code == DegradedCode.FABRIC and profile.nodes > 1 and not fabrics)
        ):
            return f"degraded: {reason.message}"
    return ""


def _size(mib: int) -> str:
    return f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class _Node:
    __slots__ = (
        "allocs",
        "engines",
        "fabrics",
        "free",
        "holders",
        "mem",
        "min_mem",
        "order",
        "usable",
        "view",
    )

    def __init__(self, view: NodeView) -> None:
        self.view = view
        self.order = tuple(g.uuid for g in view.gpus)
        self.mem = {g.uuid: g.memory_total_mib for g in view.gpus}
        self.min_mem = min(self.mem.values(), default=0)
        # How many allocations hold each GPU; more than one only if the caller's allocations
        # already conflict, and then the GPU stays taken until every one is released.
        self.holders = dict.fromkeys(self.order, 0)
        self.free = len(self.holders)
        self.allocs = 0
        self.fabrics = tuple(sorted(set(view.fabrics)))
        self.engines = offered_engines(view)
        # The filters that do not depend on the profile; fixed for the pass.
        self.usable = view.approved and view.connected and not view.draining and not view.lost

    @property
    def key(self) -> _Key:
        return (self.free, self.allocs)

    def fit(self, memory_mib: int) -> int:
        """Free GPUs with at least ``memory_mib``."""
        if memory_mib <= self.min_mem:
            return self.free
        return sum(1 for u in self.order if not self.holders[u] and self.mem[u] >= memory_mib)

    def pick(self, count: int, memory_mib: int) -> tuple[str, ...]:
        free = [u for u in self.order if not self.holders[u] and self.mem[u] >= memory_mib]
        if memory_mib > 0:
            # Best fit: the smallest GPUs that are large enough keep the large ones free.
            free.sort(key=lambda u: self.mem[u])
        return tuple(free[:count])


class Cluster:
    """A mutable view of the nodes and what they hold, for one reconcile pass.

    Build it from the nodes and the allocations already placed; each successful
    :meth:`place` is recorded, so the next one in the same pass sees it. Usable nodes are
    indexed by (free GPUs, allocations), overall and per fabric, in id order within a
    bucket, so a placement walks nodes best-first and usually stops at the first one.
    """

    def __init__(self, nodes: Iterable[NodeView], allocations: Iterable[Allocation]) -> None:
        self._nodes: dict[str, _Node] = {}
        for view in sorted(nodes, key=lambda v: v.id):
            if view.id in self._nodes:
                raise ValueError(f"node {view.id} is listed twice")
            self._nodes[view.id] = _Node(view)
        self._fabric_nodes: dict[str, int] = {}
        for node in self._nodes.values():
            for fabric in node.fabrics:
                self._fabric_nodes[fabric] = self._fabric_nodes.get(fabric, 0) + 1
        self._replicas: dict[str, list[Allocation]] = {}
        self._seq = 0
        for alloc in allocations:
            self._hold(alloc)
        self._index: _Buckets = {}
        self._by_fabric: dict[str, _Buckets] = {f: {} for f in self._fabric_nodes}
        # Per fabric, what every usable node on it has in common: when a profile's engine and
        # memory are within it, every indexed node with enough free GPUs fits, and counting
        # them is a sum over buckets rather than a walk over nodes.
        self._common: dict[str, tuple[frozenset[str], int]] = {}
        # Fabrics with a degraded node on them: there the fast count does not hold.
        self._degraded_fabrics: set[str] = set()
        for node in self._nodes.values():
            if not node.usable:
                continue
            self._insert(node)
            if node.view.degraded:
                self._degraded_fabrics.update(node.fabrics)
            for fabric in node.fabrics:
                common = self._common.get(fabric)
                if common is None:
                    self._common[fabric] = (node.engines, node.min_mem)
                else:
                    self._common[fabric] = (
                        common[0] & node.engines,
                        min(common[1], node.min_mem),
                    )

    # -- public --------------------------------------------------------------------------------

    def free_gpus(self, node_id: str) -> tuple[str, ...]:
        """The node's GPUs that no allocation holds, in inventory order."""
        node = self._nodes.get(node_id)
        if node is None:
            raise KeyError(f"no node {node_id} in this cluster view")
        return tuple(u for u in node.order if not node.holders[u])

    def release(self, replica_id: str) -> None:
        """Forget every shard of the replica and free its GPUs; unknown ids are a no-op."""
        for alloc in self._replicas.pop(replica_id, ()):
            node = self._nodes.get(alloc.node_id)
            if node is None:
                continue
            self._reindex(node, alloc, -1)

    def place(
        self,
        profile: Profile,
        *,
        strategy: str = "binpack",
        avoid: frozenset[str] = frozenset(),
        replica_id: str | None = None,
    ) -> Placement | Unplaceable:
        """Choose nodes and GPUs for one replica of ``profile`` and record them under
        ``replica_id`` (a provisional id when None), or say why no node can take it."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
        if replica_id is not None and replica_id in self._replicas:
            raise ValueError(f"replica {replica_id} is already placed; release it first")
        memory = profile.gpu_memory_mib if profile.gpus else 0
        if profile.nodes == 1:
            chosen = self._first(self._index, profile, memory, strategy, avoid)
            fabric = None
            nodes = [chosen] if chosen is not None else []
        else:
            fabric, nodes = self._multi(profile, memory, strategy, avoid)
        if not nodes:
            return Unplaceable(self._reasons(profile, memory, avoid))
        if replica_id is None:
            replica_id = self._provisional_id()
        shards = tuple(
            ShardPlacement(node.view.id, rank, node.pick(profile.gpus, memory), fabric)
            for rank, node in enumerate(nodes)
        )
        for shard in shards:
            alloc = Allocation(
                replica_id, f"{replica_id}-s{shard.rank}", shard.node_id, shard.gpus, memory
            )
            self._replicas.setdefault(replica_id, []).append(alloc)
            self._reindex(self._nodes[shard.node_id], alloc, +1)
        return Placement(shards, replica_id)

    # -- choosing ------------------------------------------------------------------------------

    def _fits(self, node: _Node, profile: Profile, memory: int, avoid: frozenset[str]) -> bool:
        return (
            profile.engine in node.engines
            and node.view.id not in avoid
            and (profile.gpus == 0 or node.fit(memory) >= profile.gpus)
            and not _source_problem(node.view, profile)
            and not (
                node.view.degraded
                and degraded_refusal(node.view.degraded, node.view.fabrics, profile)
            )
        )

    def _walk(self, buckets: _Buckets, gpus: int, strategy: str) -> Iterator[str]:
        """Node ids with at least ``gpus`` free GPUs, best first for the strategy."""
        keys = [k for k, ids in buckets.items() if k[0] >= gpus and ids]
        if gpus and strategy == "binpack":
            # Fewest free GPUs first, node id breaking ties (allocations do not count).
            for free in sorted({k[0] for k in keys}):
                lists = [buckets[k] for k in keys if k[0] == free]
                yield from lists[0] if len(lists) == 1 else heapq.merge(*lists)
            return
        if gpus:  # spread: most free GPUs, then fewest allocations
            keys.sort(key=lambda k: (-k[0], k[1]))
        elif strategy == "binpack":
            # Nothing to pack: keep GPU nodes open for GPU work, and spread over the rest.
            keys.sort()
        else:
            keys.sort(key=lambda k: (k[1], -k[0]))
        for k in keys:
            yield from buckets[k]

    def _first(
        self,
        buckets: _Buckets,
        profile: Profile,
        memory: int,
        strategy: str,
        avoid: frozenset[str],
    ) -> _Node | None:
        for node_id in self._walk(buckets, profile.gpus, strategy):
            node = self._nodes[node_id]
            if self._fits(node, profile, memory, avoid):
                return node
        return None

    def _multi(
        self, profile: Profile, memory: int, strategy: str, avoid: frozenset[str]
    ) -> tuple[str | None, list[_Node]]:
        best: tuple[int, str] | None = None
        best_nodes: list[_Node] = []
        avoided = {f for a in avoid if a in self._nodes for f in self._nodes[a].fabrics}
        for fabric, buckets in sorted(self._by_fabric.items()):
            common = self._common.get(fabric)
            if common is None:
                continue  # no usable node on it
            fits = 0
            chosen: list[_Node] = []
            walk = self._walk(buckets, profile.gpus, strategy)
            if (
                profile.engine in common[0]
                and memory <= common[1]
                and fabric not in avoided
                and profile.source is None
                and fabric not in self._degraded_fabrics
            ):
                fits = sum(len(ids) for k, ids in buckets.items() if k[0] >= profile.gpus)
                chosen = [self._nodes[n] for n in itertools.islice(walk, profile.nodes)]
            else:
                for node_id in walk:
                    node = self._nodes[node_id]
                    if self._fits(node, profile, memory, avoid):
                        fits += 1
                        if len(chosen) < profile.nodes:
                            chosen.append(node)
            if fits < profile.nodes:
                continue
            spare = fits - profile.nodes
            score = (spare if strategy == "binpack" else -spare, fabric)
            if best is None or score < best:
                best, best_nodes = score, chosen
        return (best[1], best_nodes) if best is not None else (None, [])

    def _provisional_id(self) -> str:
        while True:
            self._seq += 1
            replica_id = f"new-{self._seq}"
            if replica_id not in self._replicas:
                return replica_id

    # -- bookkeeping ---------------------------------------------------------------------------

    def _hold(self, alloc: Allocation) -> None:
        self._replicas.setdefault(alloc.replica_id, []).append(alloc)
        node = self._nodes.get(alloc.node_id)
        if node is not None:
            _count(node, alloc, +1)

    def _reindex(self, node: _Node, alloc: Allocation, sign: int) -> None:
        if node.usable:
            self._remove(node)
        _count(node, alloc, sign)
        if node.usable:
            self._insert(node)

    def _insert(self, node: _Node) -> None:
        key = node.key
        insort(self._index.setdefault(key, []), node.view.id)
        for fabric in node.fabrics:
            insort(self._by_fabric[fabric].setdefault(key, []), node.view.id)

    def _remove(self, node: _Node) -> None:
        key = node.key
        _drop(self._index[key], node.view.id)
        for fabric in node.fabrics:
            _drop(self._by_fabric[fabric][key], node.view.id)

    # -- explaining ----------------------------------------------------------------------------

    def _reasons(self, profile: Profile, memory: int, avoid: frozenset[str]) -> tuple[str, ...]:
        if not self._nodes:
            return ("no nodes have joined",)
        reasons: list[str] = []
        fits: dict[str, int] = dict.fromkeys(self._fabric_nodes, 0)
        for node in self._nodes.values():
            why = self._why_not(node, profile, memory, avoid)
            if why:
                reasons.append(f"{node.view.id}: {why}")
            else:
                for fabric in node.fabrics:
                    fits[fabric] += 1
        reasons = _source_headline(profile, self._nodes.values(), reasons)
        if profile.nodes > 1:
            for fabric in sorted(fits):
                total = self._fabric_nodes[fabric]
                reasons.append(
                    f"fabric {fabric}: {fits[fabric]} of {_plural(total, 'node')} free, "
                    f"needs {profile.nodes}"
                )
        return tuple(reasons)

    def _why_not(self, node: _Node, profile: Profile, memory: int, avoid: frozenset[str]) -> str:
        view = node.view
        if not view.approved:
            return (
                node.view.state
                if node.view.state and node.view.state != "approved"
                else "not approved"
            )
        if view.lost:
            return "lost"
        if not view.connected:
            return "not connected"
        if view.draining:
            return "draining"
        if view.id in avoid:
            return "avoided for this replica"
        held = _held(view, profile.engine)
        if held:
            return held
        refusal = degraded_refusal(view.degraded, view.fabrics, profile)
        if refusal:
            return refusal
        if profile.engine not in view.engines:
            installed = ", ".join(sorted(view.engines)) or "none"
            return f"engine {profile.engine} not offered (installed: {installed})"
        if profile.nodes > 1 and not node.fabrics:
            return "no fabric (multi-node replicas need one)"
        source = _source_problem(view, profile)
        if source:
            return source
        need = profile.gpus
        if need == 0:
            return ""
        total = len(node.order)
        if total == 0:
            return f"no GPUs, needs {need}"
        large = (
            total if memory <= node.min_mem else sum(1 for m in node.mem.values() if m >= memory)
        )
        free = node.fit(memory)
        if large < total:
            if large < need:
                return f"{large} of {total} GPUs have {_size(memory)}, needs {need}"
            if free < need:
                return f"{free} of {large} GPUs with {_size(memory)} free, needs {need}"
            return ""
        if free < need:
            return f"{free} of {total} GPUs free, needs {need}"
        return ""


def _held(view: NodeView, engine: str) -> str:
    """Why ``engine`` is held back from the node ("" when it is not)."""
    return next((why for held, why in view.held_engines if held == engine), "")


def _source_problem(view: NodeView, profile: Profile) -> str:
    """Why the node cannot serve the profile's source; "" when it can, when the profile has
    none, or when the node reports no sources (an agent that predates the check)."""
    if profile.source is None or view.sources is None:
        return ""
    return view.sources.problem(profile.source)


def _source_headline(profile: Profile, nodes: Collection[_Node], reasons: list[str]) -> list[str]:
    """When every node that got as far as the source check failed it, one line first says
    so and names them; it stands for their plain "no source" and "may not fetch" lines,
    while any other reason (a path outside models_root, a listing that failed) stays."""
    source = profile.source
    if source is None:
        return reasons
    checked: list[str] = []
    plain: set[str] = set()
    for node in nodes:
        view = node.view
        if view.sources is None or not node.usable or profile.engine not in node.engines:
            continue
        if profile.nodes > 1 and not node.fabrics:
            continue
        problem = _source_problem(view, profile)
        if not problem:
            return reasons  # a node has it: the nodes' own reasons say the rest
        checked.append(view.id)
        if problem.startswith(("no source ", "may not fetch ")):
            plain.add(f"{view.id}: {problem}")
    if not checked:
        return reasons
    if source.fetched:
        what = f"no node may fetch source {source.text}"
        fix = "list its place in a node's install_sources (agent.yaml), or give an https:// URL"
    else:
        what = f"no node has source {source.text} under models_root"
        fix = "copy the weights under a node's models_root, or fix the profile's source"
    headline = f"{what}; nodes checked: {', '.join(checked)} ({fix})"
    return [headline, *(r for r in reasons if r not in plain)]


def _count(node: _Node, alloc: Allocation, sign: int) -> None:
    node.allocs += sign
    for uuid in alloc.gpus:
        held = node.holders.get(uuid)
        if held is None:
            continue  # a GPU the inventory no longer lists
        if sign > 0 and held == 0:
            node.free -= 1
        elif sign < 0 and held == 1:
            node.free += 1
        node.holders[uuid] = held + sign


def _drop(ids: list[str], node_id: str) -> None:
    del ids[bisect_left(ids, node_id)]
