"""The host memory of sleeping replicas (issue 39 point 3): what each sleeper holds, what a
replica will hold asleep, what placement counts, and the sleepers retired for room.

vLLM at level 1 keeps a sleeping replica's weights in pinned host memory, and level 2 drops
them; SGLang's release keeps them (its one level); the sim says what it holds. A sleeper
holds what its engine said (``host_memory_mib`` of its asleep shard), else, at level 1, the
size of its weights as its node lists them (:meth:`NodeSources.size_bytes`: real vLLM says
nothing), else nothing known. Placement counts a node's memory as taken by its sleepers
and by the awake replicas whose profile declares ``host_memory``, and checks a profile's
own ``host_memory`` against the rest (:mod:`llmgw.server.fleet.placement`); a profile
without it is placed as before. When only sleepers stand in the way, the lowest-priority
level-1 sleepers of the node chosen (none above the placing model's priority) are retired
for it (:func:`plan_room`), as asleep GPUs are free to placement and taken back on waking.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.contracts.catalog import deployed_profile, profile_sleep_level
from llmgw.contracts.memory import mib_text, parse_memory_mib
from llmgw.contracts.model_sources import NodeSources, SourceSpec
from llmgw.contracts.scaling import ScalingPolicy, policy_of
from llmgw.errors import ConfigError, NotFound
from llmgw.server.fleet.placement import Cluster, Unplaceable
from llmgw.server.fleet.placement import Profile as PlacementProfile
from llmgw.server.store import Model, Replica, Shard, Store
from llmgw.server.store.states import ShardState

__all__ = [
    "HostUse",
    "Sleeper",
    "host_use",
    "plan_room",
    "rank_of",
    "sleepers",
    "sleeping",
    "weights_mib",
]

_MIB = 1 << 20


@dataclass(frozen=True)
class Sleeper:
    """An asleep replica (its rank 0: sleeping replicas run on one node) and what it holds."""

    replica_id: str
    model: str
    node_id: str
    level: int
    mib: int  # host memory held: as its engine said, else (level 1) its weights' size
    rank: int  # its model's priority (:func:`rank_of`)


@dataclass(frozen=True)
class HostUse:
    """What a cluster view counts of host memory: node -> MiB its sleepers hold, and
    replica -> the ``host_memory`` its profile declares (awake replicas only)."""

    sleepers: Mapping[str, int]
    needs: Mapping[str, int]


def sleeping(model: Model) -> tuple[ScalingPolicy | None, int]:
    """A model's scaling policy and the level its deployed profile sleeps at (0: none)."""
    try:
        policy = policy_of(model.scaling)
    except ConfigError:
        return None, 0
    profile = deployed_profile(model.profiles, model.profile, model.engine, model.params)
    return policy, profile_sleep_level(profile)


def rank_of(model: Model | None) -> int:
    """A model's priority rank; a fixed count's above every other (it neither takes nor
    gives)."""
    policy, _level = sleeping(model) if model is not None else (None, 0)
    return policy.rank if policy is not None else 99


def _profile(model: Model, replica: Replica | None = None) -> Mapping[str, Any]:
    name = (replica.profile if replica is not None else "") or model.profile
    return deployed_profile(model.profiles, name, model.engine, model.params)


def weights_mib(inventory: Mapping[str, Any], profile: Mapping[str, Any]) -> int:
    """The size (MiB, rounded up) of ``profile``'s weights as the node of ``inventory``
    lists its sources; 0 when unknown (no source, not listed, an agent that lists none)."""
    source = profile.get("source")
    if isinstance(source, Mapping):
        spec = SourceSpec(str(source.get("url") or ""), str(source.get("sha256") or ""))
    elif isinstance(source, str) and source:
        spec = SourceSpec(source)
    else:
        return 0
    listed = NodeSources.from_inventory(inventory)
    return math.ceil(listed.size_bytes(spec) / _MIB) if listed is not None else 0


def sleepers(store: Store, node_id: str | None = None) -> list[Sleeper]:
    """The asleep replicas (of ``node_id``, or all), each with the host memory it holds."""
    shards = [
        s for s in store.list_shards(node_id=node_id, states=(ShardState.ASLEEP,)) if s.rank == 0
    ]
    if not shards:
        return []
    models = {m.name: m for m in store.list_models()}
    replicas = {r.id: r for r in store.list_replicas()}
    inventories: dict[str, Mapping[str, Any]] = {}
    out = []
    for shard in shards:
        replica = replicas.get(shard.replica_id)
        model = models.get(replica.model) if replica is not None else None
        if replica is None or model is None:
            continue
        out.append(_sleeper(store, shard, replica, model, inventories))
    return out


def _sleeper(
    store: Store,
    shard: Shard,
    replica: Replica,
    model: Model,
    inventories: dict[str, Mapping[str, Any]],
) -> Sleeper:
    profile = _profile(model, replica)
    level = shard.sleep_level or profile_sleep_level(profile)
    mib = shard.host_memory_mib
    if not mib and level == 1:
        inventory = inventories.get(shard.node_id)
        if inventory is None:
            try:
                inventory = store.get_node(shard.node_id).inventory
            except NotFound:
                inventory = {}
            inventories[shard.node_id] = inventory
        mib = weights_mib(inventory, profile)
    return Sleeper(replica.id, model.name, shard.node_id, level, mib, rank_of(model))


def host_use(store: Store) -> HostUse:
    """What placement counts of host memory now; nothing at all (not even a read of the
    sleepers) while no deployed profile declares ``host_memory``: only such a profile is
    checked against it."""
    models = {m.name: m for m in store.list_models()}
    declared = {name: _declared(m) for name, m in models.items()}
    if not any(declared.values()):
        return HostUse({}, {})
    held: dict[str, int] = {}
    for sleeper in sleepers(store):
        held[sleeper.node_id] = held.get(sleeper.node_id, 0) + sleeper.mib
    needs = {}
    for replica in store.list_replicas():
        model = models.get(replica.model)
        mib = _declared(model, replica) if model is not None else 0
        if mib:
            needs[replica.id] = mib  # an asleep one's shard is no allocation: not counted
    return HostUse(held, needs)


def _declared(model: Model, replica: Replica | None = None) -> int:
    """The ``host_memory`` (MiB) a replica's stored profile declares; 0: none (or one this
    llmgw cannot read, which the scheduler's own parse refuses, saying why)."""
    value = _profile(model, replica).get("host_memory")
    if value is None:
        return 0
    try:
        return parse_memory_mib(value)
    except ConfigError:
        return 0


def plan_room(
    store: Store,
    cluster: Cluster,
    wanted: PlacementProfile,
    strategy: str,
    model: Model,
    avoid: frozenset[str] = frozenset(),
) -> list[Sleeper] | None:
    """The level-1 sleepers to retire so that a replica of ``wanted`` is placed off
    ``avoid`` (for a pool: the nodes its pair may not use): lowest priority first, none of a
    higher priority than ``model``'s nor of ``model`` itself (woken rather), only as many as
    needed. None when retiring them would not make room, or when no sleeper stands in the
    way."""
    need = wanted.host_memory_mib
    if not need or not cluster.sleepers_hold():
        return None
    trial = cluster.place(wanted, strategy=strategy, sleepers_free=True, avoid=avoid)
    if isinstance(trial, Unplaceable):
        return None
    cluster.release(trial.replica_id)
    mine = rank_of(model)
    plan: list[Sleeper] = []
    for shard in trial.shards:
        short = cluster.host_short(shard.node_id, need)
        if short <= 0:
            continue
        candidates = sorted(
            (
                s
                for s in sleepers(store, shard.node_id)
                if s.level == 1 and s.mib and s.rank <= mine and s.model != model.name
            ),
            key=lambda s: (s.rank, -s.mib, s.replica_id),
        )
        freed = 0
        for sleeper in candidates:
            if freed >= short:
                break
            plan.append(sleeper)
            freed += sleeper.mib
        if freed < short:
            return None
    return plan or None


def retire_why(sleeper: Sleeper, model: Model, wanted: PlacementProfile) -> str:
    """Why ``sleeper`` is retired for a replica of ``model``."""
    return (
        f"retired asleep for a replica of {model.name}: it held {mib_text(sleeper.mib)} of "
        f"{sleeper.node_id}'s host memory, which needs {mib_text(wanted.host_memory_mib)}"
    )
