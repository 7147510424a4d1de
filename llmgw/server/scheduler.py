"""The reconcile loop: bring the replicas of each model to the desired count and keep them up.

Placement here is the single-node kind: a replica is one shard on one connected, approved
node that offers the model's engine, choosing the node with the fewest shards (so two
replicas land on two nodes when there are two). A failed shard is started again on its
node after a backoff that doubles with each consecutive failure (1 s up to 30 s).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.errors import NotFound
from llmgw.log import kv
from llmgw.server.store import Model, Shard

if TYPE_CHECKING:
    from llmgw.server.app import ControlPlane

__all__ = ["Scheduler", "restart_delay"]

log = logging.getLogger("llmgw.server.scheduler")


def restart_delay(failures: int) -> float:
    return float(min(30, 2 ** max(0, failures - 1)))


@dataclass
class Unplaceable:
    model: str
    reason: str
    since: float


class Scheduler:
    def __init__(self, cp: ControlPlane, interval: float = 1.0) -> None:
        self.cp = cp
        self.interval = interval
        self._kick = asyncio.Event()
        # Consecutive failures per shard, reset when it becomes ready.
        self.failures: dict[str, int] = {}
        self.failed_at: dict[str, float] = {}
        self.unplaceable: dict[str, Unplaceable] = {}
        # Drains: original replica -> its replacement, and the node it is moving off.
        self.moves: dict[str, str] = {}
        self.move_nodes: dict[str, str] = {}
        self.drain_blocked: dict[str, str] = {}

    def kick(self) -> None:
        self._kick.set()

    async def run(self) -> None:
        while True:
            try:
                self.reconcile()
            except Exception:
                log.exception("reconcile failed; trying again")
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.interval)
            except TimeoutError:
                pass
            self._kick.clear()

    # -- one pass ------------------------------------------------------------------------------

    def reconcile(self) -> None:
        store = self.cp.store
        self._drain_step()
        moving = set(self.moves) | set(self.moves.values())
        for model in store.list_models():
            replicas = store.list_replicas(model.name)
            # A replica being moved and its replacement count as one until the move is done.
            in_moves = sum(1 for r in replicas if r.id in self.moves.values())
            missing = model.replicas - (len(replicas) - in_moves)
            if missing > 0:
                for _ in range(missing):
                    if not self._place(model):
                        break
            elif missing < 0:
                # Stop the least useful first: not ready before ready, newest first.
                candidates = [r for r in replicas if r.id not in moving]
                order = sorted(candidates, key=lambda r: (r.state == "ready", -r.created_at))
                for replica in order[:-missing]:
                    self.cp.remove_replica(
                        replica.id, why=f"scaled {model.name} to {model.replicas}"
                    )
            if missing <= 0:
                self.unplaceable.pop(model.name, None)
        now = time.monotonic()
        for shard in store.list_shards():
            session = self.cp.sessions.get(shard.node_id)
            if session is None:
                continue
            if shard.state == "failed":
                failures = self.failures.get(shard.id, 1)
                failed_at = self.failed_at.setdefault(shard.id, now)
                if now - failed_at >= restart_delay(failures):
                    self._restart(shard)
            elif shard.state == "pending":
                self._send_start(shard)

    def _candidates(self, model: Model) -> tuple[list[str], list[str]]:
        """Node ids that can take a shard of ``model``, and why each other node cannot."""
        ok: list[str] = []
        why: list[str] = []
        load: dict[str, int] = {}
        for shard in self.cp.store.list_shards():
            load[shard.node_id] = load.get(shard.node_id, 0) + 1
        for node in self.cp.store.list_nodes():
            session = self.cp.sessions.get(node.id)
            if node.state != "approved":
                why.append(f"{node.id}: {node.state}")
            elif session is None:
                why.append(f"{node.id}: not connected")
            elif node.draining:
                why.append(f"{node.id}: draining")
            elif node.id in self.cp.lost:
                why.append(f"{node.id}: lost")
            elif model.engine not in session.engines:
                why.append(f"{node.id}: engine {model.engine} not available")
            else:
                ok.append(node.id)
        ok.sort(key=lambda n: (load.get(n, 0), n))
        return ok, why

    def _place(self, model: Model) -> bool:
        return self._place_replica(model) is not None

    def _place_replica(self, model: Model) -> str | None:
        nodes, why = self._candidates(model)
        if not nodes:
            reason = "; ".join(why) if why else "no nodes have joined"
            previous = self.unplaceable.get(model.name)
            if previous is None or previous.reason != reason:
                self.unplaceable[model.name] = Unplaceable(model.name, reason, time.time())
                self.cp.store.add_event(
                    "unplaceable", model.name, f"cannot place a replica: {reason}"
                )
                log.warning("cannot place a replica", extra=kv(model=model.name, reason=reason))
            return None
        self.unplaceable.pop(model.name, None)
        store = self.cp.store
        with store.transaction():
            replica = store.add_replica(model.name)
            shard = store.add_shard(replica.id, nodes[0], rank=0)
            store.set_replica_state(replica.id, "starting")
        store.add_event("replica_placed", replica.id, f"{model.name} on {nodes[0]}")
        log.info("placing a replica", extra=kv(model=model.name, replica=replica.id, node=nodes[0]))
        self._send_start(shard)
        return replica.id

    # -- drain: replacement first, one replica at a time ----------------------------------------

    def _drain_step(self) -> None:
        store = self.cp.store
        draining = [n for n in store.list_nodes() if n.draining]
        # Finish or abandon moves in progress.
        for original, replacement in list(self.moves.items()):
            try:
                store.get_replica(original)
            except NotFound:
                # The original went away by itself (undeploy, loss): nothing left to move.
                del self.moves[original]
                continue
            try:
                store.get_replica(replacement)
            except NotFound:
                del self.moves[original]  # the replacement was lost; try again next pass
                continue
            if any(ep.replica_id == replacement for ep in self.cp.router.endpoints()):
                del self.moves[original]
                from_node = self.move_nodes.pop(original, "?")
                self.cp.remove_replica(original, why=f"moved off {from_node} (drain)")
                store.add_event("drain_moved", from_node, f"{original} -> {replacement}")
        for node in draining:
            if any(self.move_nodes.get(o) == node.id for o in self.moves):
                continue  # one replica at a time per node
            replicas = sorted({s.replica_id for s in store.list_shards(node_id=node.id)})
            if not replicas:
                self.drain_blocked.pop(node.id, None)
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

    def drain_progress(self, node_id: str) -> dict[str, object]:
        store = self.cp.store
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

    def _send_start(self, shard: Shard) -> None:
        store = self.cp.store
        session = self.cp.sessions.get(shard.node_id)
        if session is None:
            return
        replica = store.get_replica(shard.replica_id)
        model = store.get_model(replica.model)
        params = {k: str(v) for k, v in model.params.items() if k != "extra_args"}
        extra = [str(a) for a in model.params.get("extra_args", [])]
        op_id = session.start_shard(
            shard_id=shard.id,
            replica_id=replica.id,
            model=model.name,
            engine=model.engine,
            rank=shard.rank,
            params=params,
            extra_args=extra,
        )
        store.update_shard(shard.id, state="starting", op_id=op_id, reason="", exit_code=None)

    def _restart(self, shard: Shard) -> None:
        failures = self.failures.get(shard.id, 1)
        log.info(
            "restarting a failed shard",
            extra=kv(shard=shard.id, node=shard.node_id, failures=failures),
        )
        self.cp.store.add_event(
            "shard_restart", shard.id, f"restart {shard.restarts + 1} on {shard.node_id}"
        )
        self.cp.store.update_shard(shard.id, restarts=shard.restarts + 1)
        self.failed_at.pop(shard.id, None)
        self._send_start(shard)

    # -- feedback from agents ------------------------------------------------------------------

    def shard_failed(self, shard_id: str) -> None:
        self.failures[shard_id] = self.failures.get(shard_id, 0) + 1
        self.failed_at[shard_id] = time.monotonic()
        self.kick()

    def shard_ready(self, shard_id: str) -> None:
        self.failures.pop(shard_id, None)
        self.failed_at.pop(shard_id, None)

    def forget(self, shard_id: str) -> None:
        self.failures.pop(shard_id, None)
        self.failed_at.pop(shard_id, None)
