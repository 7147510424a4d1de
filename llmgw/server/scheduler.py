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
        for model in store.list_models():
            replicas = store.list_replicas(model.name)
            missing = model.replicas - len(replicas)
            if missing > 0:
                for _ in range(missing):
                    if not self._place(model):
                        break
            elif missing < 0:
                # Stop the least useful first: not ready before ready, newest first.
                order = sorted(replicas, key=lambda r: (r.state == "ready", -r.created_at))
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
            elif model.engine not in session.engines:
                why.append(f"{node.id}: engine {model.engine} not available")
            else:
                ok.append(node.id)
        ok.sort(key=lambda n: (load.get(n, 0), n))
        return ok, why

    def _place(self, model: Model) -> bool:
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
            return False
        self.unplaceable.pop(model.name, None)
        store = self.cp.store
        with store.transaction():
            replica = store.add_replica(model.name)
            shard = store.add_shard(replica.id, nodes[0], rank=0)
            store.set_replica_state(replica.id, "starting")
        store.add_event("replica_placed", replica.id, f"{model.name} on {nodes[0]}")
        log.info("placing a replica", extra=kv(model=model.name, replica=replica.id, node=nodes[0]))
        self._send_start(shard)
        return True

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
