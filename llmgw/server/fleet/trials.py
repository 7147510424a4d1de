"""Placement asked without placing anything: why a node takes no replica of each model
waiting for room (the console's node page), and whether a replica would fit were some
replicas gone (preemption's trial). Each asks a cluster view of its own, a disaggregated
model's pool only where its pair may go (:mod:`llmgw.server.fleet.pairing`), as the
scheduler's own placement does.

A part of :class:`~llmgw.server.fleet.scheduler.Scheduler`, as :mod:`.moves` is: ``_Trying``
says what of it these use.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Protocol

from llmgw.contracts.catalog import Profile as CatalogProfile
from llmgw.contracts.disagg import split_pool
from llmgw.errors import ConfigError, NotFound
from llmgw.server.fleet.pairing import PoolRoom, named_part, pool_room
from llmgw.server.fleet.placement import Cluster
from llmgw.server.fleet.placement import Profile as PlacementProfile
from llmgw.server.fleet.placement import Unplaceable as PlacementUnplaceable
from llmgw.server.store import Model, Store

__all__ = ["Trials", "placement_of"]


def placement_of(profile: CatalogProfile) -> PlacementProfile:
    """What placement is asked for a replica of ``profile``."""
    return PlacementProfile(
        engine=profile.engine,
        gpus=profile.gpus,
        nodes=profile.nodes,
        gpu_memory_mib=profile.gpu_memory_mib or 0,
        source=profile.source_spec,
        host_memory_mib=profile.host_memory_mib or 0,
    )


class _Trying(Protocol):
    """What the trials use of the scheduler they are part of."""

    store: Store

    @property
    def unplaceable(self) -> Mapping[str, object]: ...

    def _cluster(self) -> Cluster: ...

    def _profile(self, model: Model) -> CatalogProfile: ...

    def _ask(self, model: Model) -> tuple[PlacementProfile, str]: ...


class Trials:
    """The scheduler's read-only trials of placement (a part of it)."""

    def refusals_on(self: _Trying, node_id: str) -> list[tuple[str, str]]:
        """Why ``node_id`` takes no replica of each model waiting for room (those in
        :attr:`unplaceable`), as placement answers now: (model, the node's own line of the
        refusal), in model order. A model that would fit now is left out (the next pass
        places it), as is one whose refusal has no line for this node (a source headline, a
        fabric's count). Read only: a view of its own, nothing recorded."""
        if not self.unplaceable:
            return []
        cluster = self._cluster()
        prefix = f"{node_id}: "
        out = []
        for name in sorted(self.unplaceable):
            try:
                model = self.store.get_model(name)
                profile = self._profile(model)
            except (NotFound, ConfigError):
                continue  # undeployed since, or a profile the pass refuses on its own
            wanted = placement_of(profile)
            room = pool_room(self.store, cluster, model, wanted, profile.placement, self._ask)
            if isinstance(room, str):  # a pair with no home: the node's part of why
                part = named_part(room, node_id)
                if part is not None:
                    out.append((name, part))
                continue
            room = room or PoolRoom(frozenset())
            if node_id in room.avoid:
                out.append((name, room.node_line(name)))
                continue
            result = cluster.place(wanted, strategy=profile.placement, avoid=room.avoid)
            if not isinstance(result, PlacementUnplaceable):
                cluster.release(result.replica_id)  # the next model asks the same view
                continue
            line = next((r for r in result.reasons if r.startswith(prefix)), None)
            if line is not None:
                out.append((name, line[len(prefix) :]))
        return out

    def fits_without(self: _Trying, model: Model, replica_ids: Set[str]) -> bool:
        """Whether a replica of ``model`` would be placed were ``replica_ids`` gone: asked of
        a view of its own, a pool only where its pair may go, nothing recorded (preemption's
        trial)."""
        try:
            profile = self._profile(model)
        except ConfigError:
            return False
        cluster = self._cluster()
        for replica_id in replica_ids:
            cluster.release(replica_id)
        wanted = placement_of(profile)
        room = pool_room(
            self.store, cluster, model, wanted, profile.placement, self._ask, replica_ids
        )
        if isinstance(room, str):
            return False
        avoid = room.avoid if room is not None else frozenset()
        result = cluster.place(wanted, strategy=profile.placement, avoid=avoid)
        return not isinstance(result, PlacementUnplaceable)

    def unpaired(self: _Trying, model: Model, replica_id: str, node_id: str) -> str:
        """Why ``replica_id`` of the pool ``model`` may not serve on ``node_id`` now that its
        pair runs elsewhere (a sleeper's wake: its pair may have moved, or its node left
        the pair's fabric, while it slept); '' when it may (or ``model`` is no pool)."""
        if split_pool(model.name) is None:
            return ""  # no pool: no view built for an ordinary model's wake
        try:
            profile = self._profile(model)
        except ConfigError:
            return ""
        cluster = self._cluster()
        wanted = placement_of(profile)
        room = pool_room(
            self.store, cluster, model, wanted, profile.placement, self._ask, {replica_id}
        )
        if not isinstance(room, PoolRoom) or not room.near or node_id not in room.avoid:
            return ""  # no pool, or nothing of its pair stays elsewhere: it may wake there
        return room.node_line(model.name)
