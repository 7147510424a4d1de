"""Where the scheduler may put a disaggregated model's pool replica: the pairing rule of
:mod:`llmgw.server.fleet.placement.pairs` asked with what the store holds of the model's two
pools (the nodes their replicas run on, each pool's least count), as nodes to avoid or the
reason it cannot be placed. Only a pool's placement reads any of it: the usual pass of a
fleet without disaggregated models never comes here.

Every trial of placement asks it the same way (one rule): a replica placed, a drain's or a
cordon's replacement, preemption's trial (the victim counted gone), the sleepers retired for
room, and the console's reasons per node (:mod:`llmgw.server.fleet.trials`). The replicas
that are leaving do not hold the pair where it is: those retiring (stopping), those on a
draining node and those a trial counts gone. So a drain of the one node that hosts both
pools moves the pair as a whole: with none of its replicas staying, the first replacement
goes where both pools have room for all they run
(:func:`~llmgw.server.fleet.placement.pairs.pair_home`), and each next one beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass

from llmgw.contracts.disagg import pool_name, split_pool
from llmgw.contracts.scaling import policy_of
from llmgw.errors import ConfigError, NotFound
from llmgw.server.fleet.placement import Cluster, PoolAsk, pair_home, paired_nodes
from llmgw.server.fleet.placement import Profile as PlacementProfile
from llmgw.server.store import Model, Store
from llmgw.server.store.states import ReplicaState

__all__ = ["PoolRoom", "least", "named_part", "pool_room"]


@dataclass(frozen=True)
class PoolRoom:
    """The nodes a pool replica may not go on, and those the model's pools run on already
    (none: it is the first of its pair)."""

    avoid: frozenset[str]
    near: tuple[str, ...] = ()

    def refusal(self, model: str, summary: str) -> str:
        """Why no node of the pairing had room, the placement's own reason after it."""
        if not self.near:
            return summary
        parent = (split_pool(model) or (model, ""))[0]
        return (
            f"no node that shares a fabric with the replicas of {parent}'s pools (on "
            f"{', '.join(self.near)}) has room: {summary}"
        )

    def node_line(self, model: str) -> str:
        """Why a node in :attr:`avoid` takes no replica of the pool ``model``."""
        parent = (split_pool(model) or (model, ""))[0]
        if self.near:
            near = ", ".join(self.near)
            return f"shares no fabric with the replicas of {parent}'s pools (on {near})"
        return f"not where both pools of {parent} have room together"


def named_part(reason: str, node_id: str) -> str | None:
    """The part of a pair's refusal (:func:`pool_room`'s text) that names ``node_id``, as
    "NODE: ..." up to its end; None when it names none."""
    prefix = f"{node_id}: "
    at = reason.find(f"({prefix}")
    if at < 0:
        at = reason.find(f"; {prefix}")
    if at < 0:
        return None
    rest = reason[at + 2 + len(prefix) :]
    end = min((i for i in (rest.find(";"), rest.find(")")) if i >= 0), default=len(rest))
    return rest[:end]


def least(model: Model) -> int:
    """The replicas a pool runs at the least (its policy's min, else its count); at least
    one, since a pair is placed for both pools to serve."""
    try:
        policy = policy_of(model.scaling)
    except ConfigError:
        policy = None
    return max(1, policy.min if policy is not None else model.replicas)


def pool_room(
    store: Store,
    cluster: Cluster,
    model: Model,
    wanted: PlacementProfile,
    strategy: str,
    ask_of: Callable[[Model], tuple[PlacementProfile, str]],
    without: Set[str] = frozenset(),
) -> PoolRoom | str | None:
    """Where a replica of ``model`` may go when it is a pool (None: it is not one): the
    nodes to avoid, or why no replica of the pair can be placed. ``ask_of``: what placement
    is asked for a replica of a model, and its strategy (the scheduler's reading of its
    profile); ``without``: replicas the caller's trial counts gone."""
    pair = split_pool(model.name)
    if pair is None:
        return None
    parent, role = pair
    sibling_role = "decode" if role == "prefill" else "prefill"
    try:
        sibling: Model | None = store.get_model(pool_name(parent, sibling_role))
    except NotFound:
        sibling = None
    pools = [model] + ([sibling] if sibling is not None else [])
    draining = {node.id for node in store.list_draining_nodes()}
    running: dict[str, int] = {}
    staying: set[str] = set()
    for pool in pools:
        for replica in store.list_replicas(pool.name):
            if replica.state == ReplicaState.STOPPING or replica.id in without:
                continue
            running[pool.name] = running.get(pool.name, 0) + 1
            nodes = {s.node_id for s in store.list_shards(replica_id=replica.id)}
            if not nodes & draining:
                staying |= nodes
    near = sorted(staying)
    everyone = frozenset(cluster.node_ids())
    if near:
        return PoolRoom(everyone - paired_nodes(cluster, near), tuple(near))
    if sibling is None:
        return PoolRoom(frozenset())
    try:
        sibling_wanted, sibling_strategy = ask_of(sibling)
    except ConfigError as exc:
        return f"the {sibling_role} pool's profile cannot be read: {exc}"
    # A pair that is leaving (its node drains) goes where all it runs fits, not just its min.
    home = pair_home(
        cluster,
        parent,
        PoolAsk(role, wanted, max(least(model), running.get(model.name, 0)), strategy),
        PoolAsk(
            sibling_role,
            sibling_wanted,
            max(least(sibling), running.get(sibling.name, 0)),
            sibling_strategy,
        ),
    )
    if isinstance(home, str):
        return home
    return PoolRoom(everyone - home)
