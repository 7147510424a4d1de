"""Where the scheduler may put a disaggregated model's pool replica: the pairing rule of
:mod:`llmgw.server.fleet.placement.pairs` asked with what the store holds of the model's two
pools (the nodes their replicas run on, each pool's least count), as nodes to avoid or the
reason it cannot be placed. Only a pool's placement reads any of it: the usual pass of a
fleet without disaggregated models never comes here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmgw.contracts.disagg import pool_name, split_pool
from llmgw.contracts.scaling import policy_of
from llmgw.errors import ConfigError, NotFound
from llmgw.server.fleet.placement import Cluster, PoolAsk, pair_home, paired_nodes
from llmgw.server.fleet.placement import Profile as PlacementProfile
from llmgw.server.store import Model, Store

__all__ = ["PoolRoom", "least", "pool_room"]


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
) -> PoolRoom | str | None:
    """Where a replica of ``model`` may go when it is a pool (None: it is not one): the
    nodes to avoid, or why no replica of the pair can be placed. ``ask_of``: what placement
    is asked for a replica of a model, and its strategy (the scheduler's reading of its
    profile)."""
    pair = split_pool(model.name)
    if pair is None:
        return None
    parent, role = pair
    sibling_role = "decode" if role == "prefill" else "prefill"
    try:
        sibling: Model | None = store.get_model(pool_name(parent, sibling_role))
    except NotFound:
        sibling = None
    pools = [model.name] + ([sibling.name] if sibling is not None else [])
    near = sorted(
        {
            shard.node_id
            for name in pools
            for replica in store.list_replicas(name)
            for shard in store.list_shards(replica_id=replica.id)
        }
    )
    everyone = frozenset(cluster.node_ids())
    if near:
        return PoolRoom(everyone - paired_nodes(cluster, near), tuple(near))
    if sibling is None:
        return PoolRoom(frozenset())
    try:
        sibling_wanted, sibling_strategy = ask_of(sibling)
    except ConfigError as exc:
        return f"the {sibling_role} pool's profile cannot be read: {exc}"
    home = pair_home(
        cluster,
        parent,
        PoolAsk(role, wanted, least(model), strategy),
        PoolAsk(sibling_role, sibling_wanted, least(sibling), sibling_strategy),
    )
    if isinstance(home, str):
        return home
    return PoolRoom(everyone - home)
