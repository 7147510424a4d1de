"""The reconcile loop: bring the replicas of each model to the desired count and keep them up.

Each pass builds a :class:`~llmgw.server.fleet.placement.Cluster` view from the store (nodes,
their GPUs and healthy fabrics, what is already allocated) and asks it where each missing
replica goes (bin-pack by default, ``spread`` per profile; a multi-node replica on one
fabric). A failed shard of a single-node replica is started again on its node after a
backoff that doubles with each consecutive failure (1 s up to 30 s); a failed shard of a
multi-node replica takes the whole replica down, and it is rebuilt.

Multi-node replicas meet at one address per replica (``dist_init_addr``). Where the workers
dial rank 0 (sim, vLLM, SGLang) all shards start at once and rank 0 gathers them. Where rank
0 dials its workers (llama.cpp's RPC), StartShard also carries each worker's endpoint (rank
0: ``worker_addrs``, a worker: ``listen_addr``), and rank 0 is ordered only once every
worker is ready. Either way the replica's one port is the lowest inside the
``multinode_ports`` of all its nodes (the range each node's firewall opens to its fabric's
peers) that no replica uses on any of them (:mod:`llmgw.server.fleet.rendezvous`); with none, the
replica is not placed and its unplaceable reason names the nodes, their ranges and the fix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from llmgw.contracts.catalog import STORED, adhoc_profile, parse_profile
from llmgw.contracts.catalog import Profile as CatalogProfile
from llmgw.contracts.inventory import degraded_reasons
from llmgw.contracts.model_sources import NodeSources
from llmgw.errors import ConfigError, Fenced, NotFound, StoreUnavailable
from llmgw.log import kv
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.gpuhealth import GpuStates, blocked_gpus
from llmgw.server.fleet.hostmem import host_use, plan_room, retire_why
from llmgw.server.fleet.meeting import (
    NoPortError,
    awaits_workers,
    dist_init_addr,
    endpoints,
    host_of,
)
from llmgw.server.fleet.moves import Moves
from llmgw.server.fleet.placement import Allocation, Cluster, GpuView, NodeView, degraded_refusal
from llmgw.server.fleet.placement import Profile as PlacementProfile
from llmgw.server.fleet.placement import Unplaceable as PlacementUnplaceable
from llmgw.server.fleet.retiring import Retirements
from llmgw.server.fleet.sleeps import Sleeps
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Model, Node, Shard, Store
from llmgw.server.store.states import NodeState, ReplicaState, ShardState

__all__ = ["Scheduler", "restart_delay"]

log = logging.getLogger("llmgw.server.scheduler")


PACE = 3.0
MAX_PACE = 1.0  # seconds
PASS_BUDGET = 0.2  # seconds of placements in one pass (the first always goes ahead)
CARRY_VIEW_FOR = 2.0  # seconds a view is carried into the pass that goes on with its work


def restart_delay(failures: int) -> float:
    return float(min(30, 2 ** max(0, failures - 1)))


@dataclass
class Unplaceable:
    model: str
    reason: str
    since: float


def _wanted(profile: CatalogProfile) -> PlacementProfile:
    """What placement is asked for a replica of ``profile``."""
    return PlacementProfile(
        engine=profile.engine,
        gpus=profile.gpus,
        nodes=profile.nodes,
        gpu_memory_mib=profile.gpu_memory_mib or 0,
        source=profile.source_spec,
        host_memory_mib=profile.host_memory_mib or 0,
    )


class _NoRoom(Exception):
    def __init__(self, why: PlacementUnplaceable) -> None:
        super().__init__(why.summary())
        self.why = why


class Scheduler(Moves):
    def __init__(
        self,
        store: Store,
        router: Router,
        *,
        sessions: Mapping[str, NodeSession],
        lost: Set[str],
        on_routes_changed: Callable[[], None] = lambda: None,
        engine_holds: Callable[[Sequence[Node]], Mapping[str, tuple[tuple[str, str], ...]]]
        | None = None,
        on_unplaceable: Callable[[str], None] = lambda _model: None,
        interval: float = 5.0,
        gpu_counts: Callable[[Mapping[str, int]], None] = lambda counts: None,
        metrics: Metrics | None = None,
    ) -> None:
        self.store = store
        # Told of each model a pass could not place (the planner: room from a lower
        # priority, else the requests waiting for one answered with why).
        self.on_unplaceable = on_unplaceable
        # Told each pass how many GPUs are healthy, unhealthy, cordoned (the /metrics gauge).
        self.gpu_counts = gpu_counts
        self.router = router
        # The live streams (node id -> session) and the nodes lost, as llmgw.server.fleet.sessions
        # keeps them; read only here.
        self.sessions = sessions
        self.lost = lost
        self.on_routes_changed = on_routes_changed
        # Per node, the engines it may not be given yet and why (llmgw.server.fleet.installs).
        self.engine_holds = engine_holds
        self.interval = interval
        # When scheduling paused because the database was away (None: it is not paused).
        self.paused_since: float | None = None
        self._kick = asyncio.Event()
        # Consecutive failures per shard, reset when it becomes ready.
        self.failures: dict[str, int] = {}
        self.failed_at: dict[str, float] = {}
        self.unplaceable: dict[str, Unplaceable] = {}
        # Drains: original replica -> its replacement, and the node it is moving off.
        self.moves: dict[str, str] = {}
        self.move_nodes: dict[str, str] = {}
        self.drain_blocked: dict[str, str] = {}
        # Replicas a scale-down retires: drained, then stopped (llmgw.server.fleet.retiring).
        self.retirements = Retirements(
            store,
            router,
            sessions,
            remove=lambda replica_id, why: self.remove_replica(replica_id, why=why),
            on_routes_changed=on_routes_changed,
        )
        # Profile switches: a replica of an older profile -> its replacement.
        self.rolls: dict[str, str] = {}
        # Models with replicas of an older profile still running (their unplaceable reason,
        # if any, stays shown while they wait for room).
        self.rolling: set[str] = set()
        # Unhealthy GPUs per node (llmgw.server.fleet.gpuhealth), told of each inventory;
        # and why each move off a cordoned GPU (rather than a drain) was made.
        self.gpus = GpuStates()
        self.move_whys: dict[str, str] = {}
        # node id -> why a replica on its cordoned GPU cannot move (no room elsewhere).
        self.gpu_blocked: dict[str, str] = {}
        self._pass_cluster: Cluster | None = None
        self._pass_started = 0.0
        self._placed_in_pass = 0
        self._view_made: tuple[float, tuple[frozenset[str], frozenset[str]]] = (
            0.0,
            (frozenset(), frozenset()),
        )
        # The last pass stopped placing when its time was up: the next one follows at once.
        self.unfinished = False
        # When the next failed shard is due a restart (monotonic), as the last pass saw.
        self._due: float | None = None
        # node id -> its NodeView and what it was made of (the stored inventory, the same
        # object while it is unchanged: llmgw.server.store.nodes), reused while none changed.
        self._views: dict[str, tuple[dict[str, Any], tuple[Any, ...], NodeView]] = {}
        # Sleep and wake orders in flight (llmgw.server.fleet.sleeps).
        self.sleeps = Sleeps(store, router, sessions, on_routes_changed, metrics=metrics)

    def kick(self) -> None:
        self._kick.set()

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.reconcile()
                if self.paused_since is not None:
                    log.warning("the database answers again; scheduling resumes")
                    self.paused_since = None
            except StoreUnavailable as exc:
                if self.paused_since is None:
                    self.paused_since = time.time()
                    log.warning("scheduling paused: the database is away", extra=kv(error=str(exc)))
            except Fenced:
                pass  # another instance leads: this one steps down (llmgw.server.ha.roles)
            except Exception:
                log.exception("reconcile failed; trying again")
            took = time.monotonic() - started
            # Woken by a kick (every change that can need work kicks), at the next shard
            # restart due, or every interval as a safety net; each second while paused.
            timeout = self.interval if self.paused_since is None else min(self.interval, 1.0)
            if self._due is not None:
                timeout = min(timeout, max(0.0, self._due - time.monotonic()))
            if self.unfinished:
                timeout = 0.0  # placements left over by a pass that used its budget
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=timeout)
            except TimeoutError:
                pass
            # A burst of kicks (a fleet joining: one per approval) makes one pass, not one
            # each: after a pass of d seconds the next waits PACE * d more (at most
            # MAX_PACE), so that reconciling takes a bounded share of the event loop.
            await asyncio.sleep(min(PACE * took, MAX_PACE))
            self._kick.clear()

    # -- one pass ------------------------------------------------------------------------------

    def reconcile(self) -> None:
        # A pass that goes on where the last one ran out of time keeps its view (at a
        # fleet's size building it is most of a pass, on PostgreSQL more than its budget)
        # while it is fresh and no node came, went or was lost meanwhile.
        carried = self._pass_cluster if self._carry_view() else None
        self._pass_cluster = None
        self._due = None
        self._pass_started = time.monotonic()
        self._placed_in_pass = 0
        self.unfinished = False
        self._drain_step()
        self.retirements.step()
        self._gpu_step()
        # Built again after the drain's removals, and only if this pass places a replica.
        self._pass_cluster = carried if not self.moves else None
        self._roll_step()
        self._scale_models()
        self._tend_shards()

    def _scale_models(self) -> None:
        """Each model to as many replicas as it wants: the missing placed (within the pass's
        budget), the extra stopped."""
        store = self.store
        replacements = set(self.moves.values()) | set(self.rolls.values())
        moving = set(self.moves) | set(self.rolls) | replacements
        counts = store.count_replicas()
        for model in store.list_models():
            if (
                counts.get(model.name, 0) == model.replicas
                and not moving
                and model.name not in self.rolling
            ):
                # As many as wanted and nothing moving: a fleet's usual pass reads no more.
                self._placeable(model.name)
                continue
            # Those a scale-down retires are going: they count no more.
            replicas = [
                r for r in store.list_replicas(model.name) if r.state != ReplicaState.STOPPING
            ]
            # A replica being moved and its replacement count as one until the move is done.
            in_moves = sum(1 for r in replicas if r.id in replacements)
            missing = model.replicas - (len(replicas) - in_moves)
            if missing > 0:
                self._place_missing(model, missing)
            elif missing < 0:
                # Stop the least useful first: not ready before ready, newest first.
                candidates = [r for r in replicas if r.id not in moving]
                order = sorted(
                    candidates, key=lambda r: (r.state == ReplicaState.READY, -r.created_at)
                )
                why = f"scaled {model.name} to {model.replicas}"
                for replica in order[:-missing]:
                    if model.scaling:
                        # By demand: drained first, so that no request fails.
                        self.retirements.retire(replica.id, why=why)
                    else:
                        self.remove_replica(replica.id, why=why)
            if missing <= 0 and model.name not in self.rolling:
                self._placeable(model.name)

    def _place_missing(self, model: Model, missing: int) -> None:
        """Place up to ``missing`` replicas of ``model``, until one cannot be placed or the
        pass's time is up (the rest in the next pass)."""
        for _ in range(missing):
            if not self._placed_in_pass:
                self._pass_started = time.monotonic()  # the view built: placing starts
            elif time.monotonic() - self._pass_started > PASS_BUDGET:
                # The rest in the next pass: the event loop (the gateway's requests,
                # the agents' heartbeats) is not held for a thousand placements.
                self.unfinished = True
                return
            self._placed_in_pass += 1
            try:
                placed = self._place_replica(model)
            except ConfigError as exc:
                # A stored profile this llmgw cannot read: say so, keep the others going.
                self._note_unplaceable(model.name, f"profile {model.profile}: {exc}")
                return
            if placed is None:
                return

    def _tend_shards(self) -> None:
        """Work on the shards that need it: a failed one restarted (after its delay) or its
        replica rebuilt, a pending one started."""
        now = time.monotonic()
        # Only a failed shard (a restart, a rebuild) or a pending one (its start) needs work.
        for shard in self.store.list_shards(states=(ShardState.FAILED, ShardState.PENDING)):
            session = self.sessions.get(shard.node_id)
            if session is None or not session.approved:
                # A pending node gets no orders, and what it says of shards is not heard
                # (llmgw.server.fleet.intake): a shard of its (from before a purge and a fresh
                # join) waits here until an operator approves it.
                continue
            if shard.state == ShardState.FAILED and self._multi_node(shard):
                # A worker or rank 0 of a multi-node replica failed: the others cannot go on
                # alone (rank 0 exits when a worker dies); rebuild the whole replica.
                self.remove_replica(shard.replica_id, why=f"shard {shard.id} failed; rebuilding")
                self.kick()
                continue
            degraded = self._degraded_for(shard) if shard.state == ShardState.FAILED else ""
            if degraded:
                # Restarting it where it cannot run would fail for ever: rebuild it where it can.
                self.remove_replica(
                    shard.replica_id,
                    why=f"shard {shard.id} failed on {shard.node_id}, which is {degraded}; "
                    "rebuilding it elsewhere",
                )
                self.kick()
                continue
            if shard.state == ShardState.FAILED:
                failures = self.failures.get(shard.id, 1)
                failed_at = self.failed_at.setdefault(shard.id, now)
                due = failed_at + restart_delay(failures)
                if now >= due:
                    self._restart(shard)
                elif self._due is None or due < self._due:
                    self._due = due
            elif shard.state == ShardState.PENDING:
                self._send_start(shard)

    def _cluster(self) -> Cluster:
        """What the placement engine sees this pass."""
        views = self.node_views()
        store = self.store
        host = host_use(store)  # nothing read while no profile declares host_memory
        allocations = []
        dozing: dict[str, list[str]] = {}
        for sh in store.list_shards():
            if sh.state == ShardState.ASLEEP:
                # An asleep replica gave its GPU memory back: its GPUs are free for others
                # until it wakes (llmgw.server.fleet.dozing takes them back first), used
                # last; what it holds of host memory is counted apart (fleet.hostmem).
                dozing.setdefault(sh.node_id, []).extend(sh.gpus)
                continue
            allocations.append(
                Allocation(
                    replica_id=sh.replica_id,
                    shard_id=sh.id,
                    node_id=sh.node_id,
                    gpus=tuple(sh.gpus),
                    host_memory_mib=host.needs.get(sh.replica_id, 0),
                )
            )
        return Cluster(views, allocations, host.sleepers, dozing)

    def placement_profile(self, model: Model) -> PlacementProfile:
        """What placement is asked for a replica of ``model``'s deployed profile;
        ConfigError for a stored profile this llmgw cannot read."""
        return _wanted(self._profile(model))

    def node_views(self) -> list[NodeView]:
        """Every node as placement sees it now (each view reused while what it is made of
        is unchanged)."""
        store = self.store
        views = []
        nodes = store.list_nodes()
        holds = self.engine_holds(nodes) if self.engine_holds is not None else {}
        cordoned: dict[str, frozenset[str]] = {}
        for c in store.list_gpu_cordons():
            cordoned[c.node_id] = cordoned.get(c.node_id, frozenset()) | {c.gpu_uuid}
        cache: dict[str, tuple[dict[str, Any], tuple[Any, ...], NodeView]] = {}
        for node in nodes:
            session = self.sessions.get(node.id)
            inputs = (
                node.state,
                node.draining,
                node.dataplane_addr,
                session is not None and not session.draining,
                session.engines if session is not None else frozenset(),
                node.id in self.lost,
                holds.get(node.id, ()),
                cordoned.get(node.id, frozenset()),
            )
            known = self._views.get(node.id)
            if known is not None and known[0] is node.inventory and known[1] == inputs:
                view = known[2]  # nothing it is made of changed: a fleet's usual pass
            else:
                view = self._node_view(
                    node, session, holds.get(node.id, ()), cordoned.get(node.id, frozenset())
                )
                self.gpus.note(node.id, node.inventory)  # an inventory stored by any path
            cache[node.id] = (node.inventory, inputs, view)
            views.append(view)
        self._views = cache
        self.gpus.keep(cache)
        return views

    def _node_view(
        self,
        node: Node,
        session: NodeSession | None,
        held: tuple[tuple[str, str], ...],
        cordoned: frozenset[str] = frozenset(),
    ) -> NodeView:
        inv = node.inventory
        blocked = blocked_gpus(inv, cordoned)
        return NodeView(
            id=node.id,
            approved=node.state == NodeState.APPROVED,
            connected=session is not None and not session.draining,
            draining=node.draining,
            lost=node.id in self.lost,
            engines=session.engines if session is not None else frozenset(),
            gpus=tuple(
                GpuView(
                    uuid=str(g.get("uuid") or g.get("index")),
                    memory_total_mib=int(g.get("memory_total_mib") or 0),
                    index=int(g.get("index") or 0),
                    blocked=blocked.get(str(g.get("uuid") or g.get("index")), ""),
                )
                for g in inv.get("gpus", [])
            ),
            fabrics=tuple(f["name"] for f in inv.get("fabrics", []) if f.get("healthy")),
            mgmt_addr=host_of(node.dataplane_addr or ""),
            state=node.state,
            held_engines=held,
            sources=NodeSources.from_inventory(inv),
            degraded=degraded_reasons(inv),
            host_total_mib=int(inv.get("memory_total_bytes") or 0) >> 20,
        )

    def _view(self) -> Cluster:
        """This pass's cluster view, built when a placement first needs it (a pass with
        nothing to place builds none) and kept up to date by the placements made in it."""
        if self._pass_cluster is None:
            self._pass_cluster = self._cluster()
            self._view_made = (time.monotonic(), self._membership())
        return self._pass_cluster

    def _membership(self) -> tuple[frozenset[str], frozenset[str]]:
        return frozenset(self.sessions), frozenset(self.lost)

    def _carry_view(self) -> bool:
        if not self.unfinished or self._pass_cluster is None:
            return False
        made, membership = self._view_made
        return time.monotonic() - made < CARRY_VIEW_FOR and membership == self._membership()

    def _profile(self, model: Model) -> CatalogProfile:
        stored = model.profiles.get(model.profile) if model.profiles else None
        if stored is None:
            stored = adhoc_profile(model.engine, model.params)
        return parse_profile(stored, model=model.name, profile=model.profile, source=STORED)

    def _place_replica(self, model: Model, *, retry: bool = True) -> str | None:
        store = self.store
        profile = self._profile(model)
        cluster = self._view()
        wanted = _wanted(profile)
        try:
            with store.transaction():
                replica = store.add_replica(model.name)
                result = cluster.place(wanted, strategy=profile.placement, replica_id=replica.id)
                if isinstance(result, PlacementUnplaceable):
                    raise _NoRoom(result)
                shards = []
                for sp in result.shards:
                    shard = store.add_shard(replica.id, sp.node_id, rank=sp.rank)
                    shards.append(store.update_shard(shard.id, gpus=list(sp.gpus)))
                if len(shards) > 1:
                    addr = dist_init_addr(store, [sh.node_id for sh in shards])
                    shards = [store.update_shard(sh.id, dist_init_addr=addr) for sh in shards]
                store.set_replica_state(replica.id, ReplicaState.STARTING)
        except _NoRoom as exc:
            if retry and self._retire_sleepers(model, wanted, profile.placement, cluster):
                return self._place_replica(model, retry=False)
            self._note_unplaceable(model.name, exc.why.summary(limit=8))
            return None
        except NoPortError as exc:
            # The transaction took the replica and its shard rows back; free its GPUs in this
            # pass's view too, so that the next model may have them.
            cluster.release(replica.id)
            self._note_unplaceable(model.name, exc.reason)
            return None
        except Exception:
            cluster.release(replica.id)
            raise
        self._placeable(model.name)
        where = ", ".join(
            f"{sh.node_id}{'[' + ','.join(sh.gpus) + ']' if sh.gpus else ''}" for sh in shards
        )
        store.add_event("replica_placed", replica.id, f"{model.name} ({model.profile}) on {where}")
        log.info("placing a replica", extra=kv(model=model.name, replica=replica.id, on=where))
        for sh in shards:
            self._send_start(sh)
        return replica.id

    def _retire_sleepers(
        self, model: Model, wanted: PlacementProfile, strategy: str, cluster: Cluster
    ) -> bool:
        """Where only sleepers' host memory keeps a replica of ``model`` off, retire the
        lowest-priority ones (:func:`plan_room`), each model's count one less, as a sleeper
        whose GPUs are taken back is; True when some were."""
        plan = plan_room(self.store, cluster, wanted, strategy, model)
        for sleeper in plan or ():
            self.store.set_replicas(
                sleeper.model, max(0, self.store.get_model(sleeper.model).replicas - 1)
            )
            self.remove_replica(sleeper.replica_id, why=retire_why(sleeper, model, wanted))
            cluster.sleeper_gone(sleeper.node_id, sleeper.mib)
        return bool(plan)

    def refusals_on(self, node_id: str) -> list[tuple[str, str]]:
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
            result = cluster.place(_wanted(profile), strategy=profile.placement)
            if not isinstance(result, PlacementUnplaceable):
                cluster.release(result.replica_id)  # the next model asks the same view
                continue
            line = next((r for r in result.reasons if r.startswith(prefix)), None)
            if line is not None:
                out.append((name, line[len(prefix) :]))
        return out

    def _placeable(self, model: str) -> None:
        """Nothing of ``model`` waits for room (now)."""
        self.unplaceable.pop(model, None)

    def fits_without(self, model: Model, replica_ids: Set[str]) -> bool:
        """Whether a replica of ``model`` would be placed were ``replica_ids`` gone: asked of
        a view of its own, nothing recorded (preemption's trial)."""
        try:
            profile = self._profile(model)
        except ConfigError:
            return False
        cluster = self._cluster()
        for replica_id in replica_ids:
            cluster.release(replica_id)
        result = cluster.place(_wanted(profile), strategy=profile.placement)
        return not isinstance(result, PlacementUnplaceable)

    def _note_unplaceable(self, model: str, reason: str) -> None:
        self.on_unplaceable(model)
        previous = self.unplaceable.get(model)
        if previous is None or previous.reason != reason:
            self.unplaceable[model] = Unplaceable(model, reason, time.time())
            self.store.add_event("unplaceable", model, f"cannot place a replica: {reason}")
            log.warning("cannot place a replica", extra=kv(model=model, reason=reason))

    def _degraded_for(self, shard: Shard) -> str:
        """Why the shard's node, as its agent last reported, cannot run the shard's model
        (``degraded: ...``); '' when nothing it reported stands in the way."""
        store = self.store
        try:
            inventory = store.get_node(shard.node_id).inventory
            reasons = degraded_reasons(inventory)
            if not reasons:
                return ""
            profile = self._profile(store.get_model(store.get_replica(shard.replica_id).model))
        except (NotFound, ConfigError):
            return ""
        healthy = tuple(f["name"] for f in inventory.get("fabrics", []) if f.get("healthy"))
        return degraded_refusal(
            reasons, healthy, PlacementProfile(profile.engine, profile.gpus, profile.nodes)
        )

    def _multi_node(self, shard: Shard) -> bool:
        if shard.rank > 0:
            return True
        return len(self.store.list_shards(replica_id=shard.replica_id)) > 1

    def _send_start(self, shard: Shard) -> None:
        store = self.store
        session = self.sessions.get(shard.node_id)
        if session is None:
            return
        replica = store.get_replica(shard.replica_id)
        model = store.get_model(replica.model)
        profile = self._profile(model)
        if awaits_workers(store, shard, profile.engine):
            return  # stays pending; a later pass sends it once every worker is ready
        worker_addrs, listen_addr = endpoints(store, shard, profile.engine)
        op_id = session.start_shard(
            shard_id=shard.id,
            replica_id=replica.id,
            model=model.name,
            engine=profile.engine,
            rank=shard.rank,
            params=dict(profile.params),
            extra_args=list(profile.engine_args),
            gpus=list(shard.gpus),
            nodes=profile.nodes,
            dist_init_addr=shard.dist_init_addr,
            source=profile.source or "",
            source_sha256=profile.source_sha256,
            gpu_memory_mib=profile.gpu_memory_mib or 0,
            sidecars=[
                {
                    "name": sc.name,
                    "argv": list(sc.command),
                    "health_url": sc.health or "",
                    "timeout_s": sc.timeout_s,
                    "ready_after_s": sc.ready_after_s,
                }
                for sc in profile.sidecars
            ],
            profile=model.profile,
            worker_addrs=worker_addrs,
            listen_addr=listen_addr,
            kv_events=profile.routing_policy == "kv-events",
            sandbox=profile.sandbox,
        )
        store.update_shard(
            shard.id, state=ShardState.STARTING, op_id=op_id, reason="", exit_code=None
        )

    def _restart(self, shard: Shard) -> None:
        failures = self.failures.get(shard.id, 1)
        log.info(
            "restarting a failed shard",
            extra=kv(shard=shard.id, node=shard.node_id, failures=failures),
        )
        self.store.add_event(
            "shard_restart", shard.id, f"restart {shard.restarts + 1} on {shard.node_id}"
        )
        self.store.update_shard(shard.id, restarts=shard.restarts + 1)
        self.failed_at.pop(shard.id, None)
        self._send_start(shard)

    # -- feedback from agents ------------------------------------------------------------------

    def remove_replica(self, replica_id: str, *, why: str, actor: str = "") -> None:
        """Stop a replica's shards where they run, forget them and delete the replica; the
        event names ``actor`` when an operator's order (not the control plane) removed it."""
        for shard in self.store.list_shards(replica_id=replica_id):
            self.router.remove_shard(shard.id)
            session = self.sessions.get(shard.node_id)
            if session is not None:
                session.stop_shard(shard.id)
            self.forget(shard.id)
        self.store.delete_replica(replica_id)
        self.store.add_event("replica_removed", replica_id, why, actor)
        self.on_routes_changed()

    def shard_failed(self, shard_id: str) -> None:
        self.failures[shard_id] = self.failures.get(shard_id, 0) + 1
        self.failed_at[shard_id] = time.monotonic()
        self.kick()

    def shard_ready(self, shard_id: str) -> None:
        self.failures.pop(shard_id, None)
        self.failed_at.pop(shard_id, None)
        self.kick()  # it may be the replacement a drain or a profile switch waits for

    # -- sleeping replicas (issue 39): the planner's and the operators' orders ------------------

    def sleep_replica(self, replica_id: str, level: int, *, why: str, actor: str = "") -> str:
        """Put a ready replica to sleep at ``level`` (:meth:`Sleeps.sleep_replica`); its
        shards are then neither restarted nor rebuilt until woken. Returns the op id."""
        return self.sleeps.sleep_replica(replica_id, level, why=why, actor=actor)

    def wake_replica(self, replica_id: str, *, why: str, actor: str = "") -> str:
        """Wake an asleep replica (:meth:`Sleeps.wake_replica`); routable once ready."""
        return self.sleeps.wake_replica(replica_id, why=why, actor=actor)

    def forget(self, shard_id: str) -> None:
        self.failures.pop(shard_id, None)
        self.failed_at.pop(shard_id, None)
