"""Where a disaggregated model's pool replicas may go (pure: a cluster view in, node ids or a
reason out): on nodes that share one healthy fabric with every node either pool of the model
already runs on, or all on one node (the KV cache then moves over loopback or NVLink: a
one-machine cluster without InfiniBand still works; a node without a fabric can host both
pools only while everything of them is on it).

The first replica of a pair goes only where its sibling pool's replicas can go too: a
fabric (or else a single node) with room for both pools' least counts, tried on the view and
given back; with none the answer says so, naming what is short where.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from llmgw.server.fleet.placement.cluster import Cluster
from llmgw.server.fleet.placement.refusal import Unplaceable
from llmgw.server.fleet.placement.views import Profile

__all__ = ["PoolAsk", "pair_home", "paired_nodes"]

_SHOWN = 3  # single nodes named in a refusal


@dataclass(frozen=True)
class PoolAsk:
    """One pool as the pairing rule asks for it: its role, what one replica needs, how
    many it runs at the least and its placement strategy."""

    role: str
    profile: Profile
    count: int
    strategy: str = "binpack"

    def describe(self) -> str:
        return f"{self.count} {self.role} x {self.profile.gpus} GPU"


def paired_nodes(cluster: Cluster, placed: Collection[str]) -> frozenset[str]:
    """The nodes a pool replica may go on while the model's pools run on ``placed`` (not
    empty): those on a healthy fabric every node of ``placed`` is on, and the one node of
    ``placed`` when there is just one."""
    common: set[str] | None = None
    for node_id in placed:
        fabrics = set(cluster.fabrics_of(node_id))
        common = fabrics if common is None else common & fabrics
    allowed: set[str] = set()
    if common:
        allowed = {n for n in cluster.node_ids() if common.intersection(cluster.fabrics_of(n))}
    if len(set(placed)) == 1:
        allowed |= set(placed)
    return frozenset(allowed)


def pair_home(
    cluster: Cluster, model: str, first: PoolAsk, second: PoolAsk
) -> frozenset[str] | str:
    """The nodes the first replica of ``model``'s pools may go on: the members of the first
    fabric (in name order) with room for both pools' counts, else the first single node with
    it; a reason naming what is short on each when there is none. Nothing stays recorded."""
    everyone = frozenset(cluster.node_ids())
    if not everyone:
        return f"no fabric with room for both pools of {model}: no nodes have joined"
    members: dict[str, set[str]] = {}
    for node_id in everyone:
        for fabric in cluster.fabrics_of(node_id):
            members.setdefault(fabric, set()).add(node_id)
    short: list[str] = []
    for fabric in sorted(members):
        group = frozenset(members[fabric])
        got = _trial(cluster, first, second, everyone - group)
        if got == (first.count, second.count):
            return group
        short.append(f"fabric {fabric}: {_room(got, first, second)}")
    if not members:
        short.append("no node reports a healthy fabric")
    singles = sorted(set(cluster.eligible(first.profile)) & set(cluster.eligible(second.profile)))
    alone: list[str] = []
    for node_id in singles:
        got = _trial(cluster, first, second, everyone - {node_id})
        if got == (first.count, second.count):
            return frozenset({node_id})
        alone.append(f"{node_id}: {_room(got, first, second)}")
    if alone:
        more = f"; and {len(alone) - _SHOWN} more" if len(alone) > _SHOWN else ""
        short.append("no node alone has room for both (" + "; ".join(alone[:_SHOWN]) + more + ")")
    else:
        short.append(f"no node takes both the {first.role} and the {second.role} pool")
        for ask in (first, second):
            trial = cluster.place(ask.profile, strategy=ask.strategy)
            if isinstance(trial, Unplaceable):
                short.append(f"{ask.role}: {trial.summary(limit=3)}")
            else:
                cluster.release(trial.replica_id)
    return (
        f"no fabric with room for both pools of {model} ({first.describe()}, "
        f"{second.describe()}): " + "; ".join(short)
    )


def _trial(
    cluster: Cluster, first: PoolAsk, second: PoolAsk, avoid: frozenset[str]
) -> tuple[int, int]:
    """How many of each pool's count the view places off ``avoid`` (first's, then second's
    beside them); every trial placement given back."""
    placed: list[str] = []
    counts = []
    try:
        for ask in (first, second):
            got = 0
            for _ in range(ask.count):
                result = cluster.place(ask.profile, strategy=ask.strategy, avoid=avoid)
                if isinstance(result, Unplaceable):
                    break
                placed.append(result.replica_id)
                got += 1
            counts.append(got)
    finally:
        for replica_id in placed:
            cluster.release(replica_id)
    return counts[0], counts[1]


def _room(got: tuple[int, int], first: PoolAsk, second: PoolAsk) -> str:
    return (
        f"room for {got[0]} of {first.count} {first.role}, {got[1]} of {second.count} {second.role}"
    )
