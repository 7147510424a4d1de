"""The cluster view a reconcile pass places into: the nodes and what they hold, each placement
recorded so that the next one in the pass sees it, and the answer of each request (where its
shards go, or why no node can take it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import islice
from operator import attrgetter

from llmgw.server.fleet.placement.index import (
    Kind,
    NodeState,
    Pool,
    Signature,
    Sizes,
    kinds_of,
    signature,
    unusable_reason,
)
from llmgw.server.fleet.placement.refusal import Unplaceable, plural
from llmgw.server.fleet.placement.views import (
    STRATEGIES,
    Allocation,
    NodeView,
    Placement,
    Profile,
    ShardPlacement,
)

__all__ = ["Cluster"]


class Cluster:
    """A mutable view of the nodes and what they hold, for one reconcile pass.

    Build it from the nodes and the allocations already placed; each successful
    :meth:`place` is recorded, so the next one in the same pass sees it. The nodes a profile
    may use are indexed on its first request (:class:`~llmgw.server.fleet.placement.index.Pool`),
    so a placement walks them best-first and usually stops at the first one, and a refusal
    is told per group of nodes (:class:`~llmgw.server.fleet.placement.refusal.Unplaceable`).

    ``sleepers``: node -> the host memory (MiB) its sleeping replicas hold, which a
    profile's ``host_memory`` is checked against (with the allocations' own). ``dozing``:
    node -> the GPUs of its asleep replicas: free, but used last (on the node, and nodes
    with room elsewhere first), since a sleeper whose GPUs are taken cannot wake there.
    """

    def __init__(
        self,
        nodes: Iterable[NodeView],
        allocations: Iterable[Allocation],
        sleepers: Mapping[str, int] | None = None,
        dozing: Mapping[str, Iterable[str]] | None = None,
    ) -> None:
        self._nodes: dict[str, NodeState] = {}
        # Nodes that take nothing: reason -> their ids, in id order.
        self._unusable: dict[str, list[str]] = {}
        usable: list[NodeState] = []
        fabric_nodes: dict[str, int] = {}
        shapes: Sizes = {}
        for view in sorted(nodes, key=attrgetter("id")):
            if view.id in self._nodes:
                raise ValueError(f"node {view.id} is listed twice")
            node = self._nodes[view.id] = NodeState(view, shapes)
            for fabric in node.fabrics:
                fabric_nodes[fabric] = fabric_nodes.get(fabric, 0) + 1
            why = unusable_reason(view)
            if why:
                self._unusable.setdefault(why, []).append(view.id)
            else:
                usable.append(node)
        self._fabric_nodes = fabric_nodes
        # Every allocation, and the replicas they are of; the allocations by replica only
        # once a release needs them (a list per replica was a good part of a large view's cost).
        self._allocations = list(allocations)
        self._replica_ids = {alloc.replica_id for alloc in self._allocations}
        self._by_replica: dict[str, list[Allocation]] | None = None
        self._seq = 0
        find = self._nodes.get
        for alloc in self._allocations:
            holder = find(alloc.node_id)
            if holder is not None:
                holder.hold(alloc.gpus, alloc.host_memory_mib)
        for node_id, mib in (sleepers or {}).items():
            if node_id in self._nodes:
                self._nodes[node_id].host_sleepers = mib
        for node_id, gpus in (dozing or {}).items():
            if node_id in self._nodes:
                self._nodes[node_id].dozing = frozenset(gpus)
        self._kinds: list[Kind] = kinds_of(usable)
        self._pools: dict[Signature, Pool] = {}

    # -- public --------------------------------------------------------------------------------

    def free_gpus(self, node_id: str) -> tuple[str, ...]:
        """The node's GPUs that no allocation holds, in inventory order."""
        node = self._nodes.get(node_id)
        if node is None:
            raise KeyError(f"no node {node_id} in this cluster view")
        return node.free_gpus()

    def sleepers_hold(self) -> bool:
        """Whether any node's sleepers hold host memory (as this view was given it)."""
        return any(node.host_sleepers for node in self._nodes.values())

    def host_short(self, node_id: str, need_mib: int) -> int:
        """How much (MiB) the node lacks of ``need_mib`` host memory, counting what its
        sleepers hold; 0 when it has it (or its memory is unknown)."""
        room = self._nodes[node_id].host_room()
        return 0 if room is None else max(0, need_mib - room)

    def sleeper_gone(self, node_id: str, mib: int) -> None:
        """A sleeper of the node holding ``mib`` was retired: its host memory is free."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.host_sleepers = max(0, node.host_sleepers - mib)

    def node_ids(self) -> list[str]:
        """Every node of the view, in id order."""
        return list(self._nodes)

    def fabrics_of(self, node_id: str) -> tuple[str, ...]:
        """The healthy fabrics the node is on (none for a node not in the view)."""
        node = self._nodes.get(node_id)
        return tuple(node.fabrics) if node is not None else ()

    def eligible(self, profile: Profile) -> list[str]:
        """The nodes (in id order) that may take a shard of ``profile``, their free GPUs
        aside: usable, offering its engine, with GPUs large enough, its source there or
        fetchable, not degraded for it. The pool :meth:`place` chooses from, all of it."""
        pool = self._pool(profile)
        return [
            node.id
            for kind in self._kinds
            if kind.index in pool.shapes
            for node in kind.members
            if pool.shape(node) is not None
        ]

    def release(self, replica_id: str) -> None:
        """Forget every shard of the replica and free its GPUs; unknown ids are a no-op."""
        if replica_id not in self._replica_ids:
            return
        self._replica_ids.discard(replica_id)
        if self._by_replica is None:
            self._by_replica = {}
            for alloc in self._allocations:
                self._by_replica.setdefault(alloc.replica_id, []).append(alloc)
            self._allocations = []
        for alloc in self._by_replica.pop(replica_id, ()):
            node = self._nodes.get(alloc.node_id)
            if node is not None:
                self._count(node, alloc.gpus, -1, alloc.host_memory_mib)

    def place(
        self,
        profile: Profile,
        *,
        strategy: str = "binpack",
        avoid: frozenset[str] = frozenset(),
        replica_id: str | None = None,
        sleepers_free: bool = False,
    ) -> Placement | Unplaceable:
        """Choose nodes and GPUs for one replica of ``profile`` and record them under
        ``replica_id`` (a provisional id when None), or say why no node can take it.
        ``sleepers_free``: the host memory sleepers hold counts as free (the trial of
        whether retiring some would make room)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
        if replica_id is not None and replica_id in self._replica_ids:
            raise ValueError(f"replica {replica_id} is already placed; release it first")
        pool = self._pool(profile)
        fits: dict[str, int] = {}
        if profile.nodes == 1:
            walk = pool.walk(
                pool.buckets, profile.gpus, strategy, avoid, self._nodes, sleepers_free
            )
            first = next(walk, None)
            fabric = None
            chosen = [first] if first is not None else []
        else:
            fabric, chosen = self._multi(pool, profile, strategy, avoid, fits, sleepers_free)
        if not chosen:
            return self._refusal(pool, profile, avoid, fits)
        if replica_id is None:
            replica_id = self._provisional_id()
        memory = pool.memory
        shards = tuple(
            ShardPlacement(node.id, rank, node.pick(profile.gpus, memory), fabric)
            for rank, node in enumerate(chosen)
        )
        self._replica_ids.add(replica_id)
        allocs = (
            self._allocations
            if self._by_replica is None
            else self._by_replica.setdefault(replica_id, [])
        )
        for shard, node in zip(shards, chosen, strict=True):
            alloc = Allocation(
                replica_id,
                f"{replica_id}-s{shard.rank}",
                shard.node_id,
                shard.gpus,
                memory,
                profile.host_memory_mib,
            )
            allocs.append(alloc)
            self._count(node, alloc.gpus, +1, alloc.host_memory_mib)
        return Placement(shards, replica_id)

    # -- choosing ------------------------------------------------------------------------------

    def _pool(self, profile: Profile) -> Pool:
        sig = signature(profile)
        pool = self._pools.get(sig)
        if pool is None:
            pool = self._pools[sig] = Pool(profile, self._kinds)
        return pool

    def _multi(
        self,
        pool: Pool,
        profile: Profile,
        strategy: str,
        avoid: frozenset[str],
        fits: dict[str, int],
        sleepers_free: bool = False,
    ) -> tuple[str | None, list[NodeState]]:
        """The fabric and nodes of a multi-node replica (none when no fabric has enough);
        ``fits`` gets how many nodes could take a shard, per fabric."""
        need = profile.gpus
        avoided = [self._nodes[a] for a in avoid if a in self._nodes]
        best: tuple[int, str] | None = None
        for fabric, buckets in pool.by_fabric.items():
            fit = pool.count(buckets, need, self._nodes, sleepers_free)
            for node in avoided:
                if fabric in node.fabrics and pool.takes(node, need, sleepers_free):
                    fit -= 1
            fits[fabric] = fit
            if fit < profile.nodes:
                continue
            spare = fit - profile.nodes
            score = (spare if strategy == "binpack" else -spare, fabric)
            if best is None or score < best:
                best = score
        if best is None:
            return None, []
        fabric = best[1]
        walk = pool.walk(pool.by_fabric[fabric], need, strategy, avoid, self._nodes, sleepers_free)
        return fabric, list(islice(walk, profile.nodes))

    def _provisional_id(self) -> str:
        while True:
            self._seq += 1
            replica_id = f"new-{self._seq}"
            if replica_id not in self._replica_ids:
                return replica_id

    # -- bookkeeping ---------------------------------------------------------------------------

    def _count(self, node: NodeState, gpus: Sequence[str], sign: int, host_mib: int = 0) -> None:
        """An allocation added or released, and the node moved in every pool it is in."""
        kind = node.kind
        homes = (
            [(p, s) for p in self._kinds[kind].pools if (s := p.shape(node))] if kind >= 0 else []
        )
        for pool, shape in homes:
            pool.remove(node, shape)
        node.count(gpus, sign, host_mib)
        for pool, shape in homes:
            pool.insert(node, shape)

    # -- explaining ----------------------------------------------------------------------------

    def _refusal(
        self, pool: Pool, profile: Profile, avoid: frozenset[str], fits: dict[str, int]
    ) -> Unplaceable:
        if not self._nodes:
            return Unplaceable(("no nodes have joined",))
        groups: dict[str, list[Sequence[str]]] = {why: [ids] for why, ids in self._unusable.items()}
        nodes = self._nodes
        avoided = sorted(a for a in avoid if a in nodes and nodes[a].kind >= 0)
        if avoided:
            groups["avoided for this replica"] = [avoided]
        pool.explain(groups, profile.gpus, avoided, nodes)
        lines = []
        if profile.nodes > 1:
            for fabric in sorted(self._fabric_nodes):
                total = self._fabric_nodes[fabric]
                lines.append(
                    f"fabric {fabric}: {fits.get(fabric, 0)} of {plural(total, 'node')} free, "
                    f"needs {profile.nodes}"
                )
        return Unplaceable.grouped(groups, headline=pool.headline, fabrics=lines)
