"""Replicas moved make-before-break, their replacement routable before they stop: off a
draining node (one at a time per node), off a GPU an operator cordoned or that turned
unhealthy (the rest of its node serving on; one on an unhealthy GPU is rebuilt at once), and
onto the profile a model now deploys (one at a time per model).

A disaggregated model's pool replicas on a draining node move together: once one of them is
moving, the next of the same model's pools follows in the next pass (not after it), each
replacement placed by the pairing rule (:mod:`llmgw.server.fleet.pairing`: the replicas
leaving do not count, so a pair that was all on the node goes as a whole where both pools
fit), and none of them stops before every replacement is routable. Until then the old
replicas serve beside the new ones; a replacement that cannot be placed leaves the drain
blocked, saying why, with every old replica still serving.

The scheduler's own steps, kept apart from its reconcile loop: :class:`Moves` is a part of
:class:`~llmgw.server.fleet.scheduler.Scheduler`, whose state (``moves``, ``rolls``, the
blocked reasons) and placement these steps use; ``_Scheduling`` says which.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from llmgw.contracts.disagg import split_pool
from llmgw.errors import NotFound
from llmgw.log import kv
from llmgw.server.fleet.gpuhealth import GpuStates
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Model, Shard, Store
from llmgw.server.store.states import ReplicaState, ShardState

__all__ = ["Moves"]

log = logging.getLogger("llmgw.server.scheduler")


class _Unplaceable(Protocol):
    @property
    def reason(self) -> str: ...


class _Scheduling(Protocol):
    """What the moves use of the scheduler they are part of."""

    store: Store
    router: Router
    moves: dict[str, str]
    move_nodes: dict[str, str]
    move_whys: dict[str, str]
    drain_blocked: dict[str, str]
    rolls: dict[str, str]
    rolling: set[str]
    gpus: GpuStates
    gpu_blocked: dict[str, str]
    gpu_counts: Callable[[Mapping[str, int]], None]

    @property
    def unplaceable(self) -> Mapping[str, _Unplaceable]: ...

    def kick(self) -> None: ...

    def _place_replica(self, model: Model) -> str | None: ...

    def remove_replica(self, replica_id: str, *, why: str, actor: str = "") -> None: ...

    def _move_off_gpu(self, shard: Shard) -> None: ...


class Moves:
    """The scheduler's moves (a part of it: its state lives on the scheduler)."""

    # -- drain: replacement first, one replica at a time ----------------------------------------

    def _drain_step(self: _Scheduling) -> None:
        store = self.store
        draining = store.list_draining_nodes()
        # Finish or abandon moves in progress.
        # Read only while something moves: the usual pass lists no endpoints.
        routable = {ep.replica_id for ep in self.router.endpoints()} if self.moves else set()
        held = _pairs_held(self, routable, {n.id for n in draining}) if self.moves else set()
        for original, replacement in list(self.moves.items()):
            try:
                store.get_replica(original)
            except NotFound:
                # The original went away by itself (undeploy, loss): nothing left to move.
                del self.moves[original]
                self.move_whys.pop(original, None)
                continue
            try:
                store.get_replica(replacement)
            except NotFound:
                del self.moves[original]  # the replacement was lost; try again next pass
                self.move_whys.pop(original, None)
                continue
            if replacement in routable and original not in held:
                del self.moves[original]
                from_node = self.move_nodes.pop(original, "?")
                why = self.move_whys.pop(original, f"moved off {from_node} (drain)")
                self.remove_replica(original, why=why)
                store.add_event("drain_moved", from_node, f"{original} -> {replacement}")
        for node in draining:
            here = [o for o in self.moves if self.move_nodes.get(o) == node.id]
            replicas = sorted(
                {
                    s.replica_id
                    for s in store.list_shards(node_id=node.id)
                    if s.state != ShardState.STOPPING  # retiring: it goes by itself
                }
                - set(here)
            )
            if here:
                # One replica at a time per node; a pair's replicas one after the other.
                parents = {_parent(store, o) for o in here}
                parent = parents.pop() if len(parents) == 1 else None
                replicas = [r for r in replicas if parent and _parent(store, r) == parent]
            elif not replicas:
                self.drain_blocked.pop(node.id, None)
            if not replicas:
                continue
            original = replicas[0]
            model = store.get_model(store.get_replica(original).model)
            placed = self._place_replica(model)
            if placed is None:
                reason = (
                    self.unplaceable[model.name].reason
                    if model.name in self.unplaceable
                    else "no capacity"
                )
                self.drain_blocked[node.id] = f"cannot move {original}: {reason}"
                continue
            self.drain_blocked.pop(node.id, None)
            self.moves[original] = placed
            self.move_nodes[original] = node.id
            store.add_event("drain_moving", node.id, f"{original} -> {placed}")
            log.info(
                "moving a replica off a draining node",
                extra=kv(node=node.id, replica=original, to=placed),
            )

    def _gpu_step(self: _Scheduling) -> None:
        """Work off blocked GPUs (llmgw.server.fleet.gpuhealth), the rest of their node
        serving on: a replica on an unhealthy GPU is rebuilt elsewhere at once (as a failed
        shard on a degraded node is: what runs there cannot be trusted); one on a cordoned
        GPU is moved as a drain moves it, its replacement routable before it stops, one at
        a time per node."""
        store = self.store
        if not self.gpus.loaded:
            self.gpus.load((n.id, n.inventory) for n in store.list_nodes())
        cordons = store.list_gpu_cordons()
        self.gpu_counts(self.gpus.counts(cordons))
        if not self.gpus.unhealthy and not cordons:
            self.gpu_blocked.clear()
            return  # a fleet's usual pass: one small read
        cordoned = {(c.node_id, c.gpu_uuid) for c in cordons}
        moving = set(self.moves) | set(self.moves.values())
        for node_id in sorted(set(self.gpus.unhealthy) | {c.node_id for c in cordons}):
            bad = self.gpus.unhealthy.get(node_id, {})
            gone: set[str] = set()
            shards = store.list_shards(node_id=node_id)
            for shard in shards:
                hit = next((g for g in shard.gpus if g in bad), None)
                if hit is None or shard.replica_id in gone:
                    continue
                gone.add(shard.replica_id)
                for moves in (self.moves, self.move_nodes, self.move_whys):
                    moves.pop(shard.replica_id, None)  # a move it was in is void
                self.remove_replica(
                    shard.replica_id,
                    why=f"{bad[hit][0]} of {node_id} is unhealthy: {bad[hit][1]}; "
                    "rebuilding it elsewhere",
                )
                self.kick()
            if any(self.move_nodes.get(o) == node_id for o in self.moves):
                continue  # one move at a time per node, as a drain
            hit_shard = next(
                (
                    sh
                    for sh in shards
                    if sh.replica_id not in gone | moving
                    and sh.state != ShardState.STOPPING  # retiring: it goes by itself
                    and any((node_id, g) in cordoned for g in sh.gpus)
                ),
                None,
            )
            if hit_shard is None:
                self.gpu_blocked.pop(node_id, None)
            else:
                self._move_off_gpu(hit_shard)

    def _move_off_gpu(self: _Scheduling, shard: Shard) -> None:
        """Start moving ``shard``'s replica off its node's cordoned GPU: a replacement placed
        (never on a blocked GPU) and, once it is routable, the original stopped."""
        store = self.store
        original = shard.replica_id
        model = store.get_model(store.get_replica(original).model)
        placed = self._place_replica(model)
        if placed is None:  # tried again each pass
            why = self.unplaceable.get(model.name)
            reason = why.reason if why is not None else "no capacity"
            pair = split_pool(model.name)
            if pair and f"{pair[0]}'s pools (on {shard.node_id}) " in reason:
                # A pair alone on its node without a fabric stays there; a drain moves it whole.
                reason += (
                    f" (its pair runs on {shard.node_id} alone: free a GPU there, or drain "
                    f"{shard.node_id} to move the pair as a whole)"
                )
            self.gpu_blocked[shard.node_id] = f"cannot move {original} off a cordoned GPU: {reason}"
            return
        self.gpu_blocked.pop(shard.node_id, None)
        self.moves[original] = placed
        self.move_nodes[original] = shard.node_id
        self.move_whys[original] = f"moved off a cordoned GPU of {shard.node_id}"
        store.add_event("gpu_moving", shard.node_id, f"{original} -> {placed} (off a cordoned GPU)")
        log.info(
            "moving a replica off a cordoned GPU",
            extra=kv(node=shard.node_id, replica=original, to=placed),
        )

    # -- profile switch: replacement first, one replica at a time per model -------------------

    def _roll_step(self: _Scheduling) -> None:
        """A model deployed with another profile keeps serving: each replica of an older
        profile is replaced one at a time, the replacement routable before the original
        stops (as in a drain). With no room for one more, a model that has other replicas
        serving gives up one old replica first; one with a single replica waits for room,
        and its unplaceable reason says why."""
        store = self.store
        routable = {ep.replica_id for ep in self.router.endpoints()}
        for original, replacement in list(self.rolls.items()):
            try:
                old = store.get_replica(original)
                store.get_replica(replacement)
            except NotFound:
                del self.rolls[original]  # either went away: the next pass starts over
                continue
            if replacement in routable:
                del self.rolls[original]
                self.remove_replica(
                    original, why=f"replaced by {replacement} (profile {old.profile} retired)"
                )
                store.add_event("profile_replaced", old.model, f"{original} -> {replacement}")
        busy = {store.get_replica(o).model for o in self.rolls}
        moving = set(self.moves) | set(self.moves.values()) | set(self.rolls.values())
        self.rolling = set()
        candidates = store.models_with_stale_replicas() | busy
        for model in store.list_models():
            if model.name not in candidates:
                continue  # every replica of the profile deployed: nothing to roll
            stale = [
                r
                for r in store.list_replicas(model.name)
                if r.profile is not None
                and r.profile != model.profile
                and r.id not in moving
                and r.state != ReplicaState.STOPPING
            ]
            if not stale and model.name not in busy:
                continue
            self.rolling.add(model.name)
            if model.name in busy:
                continue
            # One that serves nothing has no traffic to hand over: it just stops, and the
            # reconcile places its successor with the new profile.
            idle = [r for r in stale if r.id not in routable]
            for replica in idle:
                self.remove_replica(
                    replica.id, why=f"{model.name} now deploys profile {model.profile}"
                )
            if idle:
                continue
            oldest = min(stale, key=lambda r: r.created_at)
            placed = self._place_replica(model)
            if placed is None:
                serving = [r for r in store.list_replicas(model.name) if r.id in routable]
                if len(serving) > 1:
                    self.remove_replica(
                        oldest.id,
                        why=f"making room for profile {model.profile} of {model.name}",
                    )
                continue
            self.rolls[oldest.id] = placed
            store.add_event(
                "profile_replacing",
                model.name,
                f"{oldest.id} ({oldest.profile}) -> {placed} ({model.profile})",
            )
            log.info(
                "replacing a replica of an older profile",
                extra=kv(model=model.name, replica=oldest.id, to=placed),
            )

    def drain_progress(self: _Scheduling, node_id: str) -> dict[str, object]:
        store = self.store
        replicas = sorted({s.replica_id for s in store.list_shards(node_id=node_id)})
        moving = [
            {"replica": o, "replacement": r}
            for o, r in self.moves.items()
            if self.move_nodes.get(o) == node_id
        ]
        return {
            "node": node_id,
            "draining": store.get_node(node_id).draining,
            "replicas_left": replicas,
            "moving": moving,
            "blocked": self.drain_blocked.get(node_id),
        }


def _parent(store: Store, replica_id: str) -> str | None:
    """The disaggregated model whose pool ``replica_id`` serves (None: not a pool's, or
    gone)."""
    try:
        pair = split_pool(store.get_replica(replica_id).model)
    except NotFound:
        return None
    return pair[0] if pair is not None else None


def _pairs_held(moves: _Scheduling, routable: set[str], draining: set[str]) -> set[str]:
    """The pool replicas moving off a draining node that may not stop yet: those of a model
    whose pools still have a replica there that is not moving, or one whose replacement is
    not routable (the pair moves as a whole). A move off a cordoned GPU is its own."""
    store = moves.store
    waiting: set[tuple[str, str]] = set()  # (node, model) whose pair is not all moved
    pools: dict[str, tuple[str, str]] = {}
    for original, replacement in moves.moves.items():
        node_id = moves.move_nodes.get(original)
        if node_id not in draining:
            continue
        parent = _parent(store, original)
        if node_id is None or parent is None:
            continue
        pools[original] = (node_id, parent)
        if replacement not in routable:
            waiting.add((node_id, parent))
    for node_id, parent in set(pools.values()):
        for shard in store.list_shards(node_id=node_id):
            if (
                shard.replica_id not in moves.moves
                and shard.state != ShardState.STOPPING
                and _parent(store, shard.replica_id) == parent
            ):
                waiting.add((node_id, parent))
                break
    return {o for o, where in pools.items() if where in waiting}
