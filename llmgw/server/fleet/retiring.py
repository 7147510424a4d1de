"""Replicas retired make-before-break: a scale-down's replica finishes the requests it has
before it stops, so that no request fails.

A retired replica leaves routing at once (this instance's router; the other instances as
its shard rows leave the ready state) and its rows stay, in state ``stopping``, holding
their GPUs. Its agent is told to stop it once the requests in flight on it ended, at most
:data:`DRAIN_TIMEOUT` (``StopShard.drain_s``): meanwhile the agent answers any new request
for it as not taken, and the gateway tries another replica. The rows go when the agent
says the shard exited; a node that went away meanwhile, or an agent that never says so
within the drain and a grace, has them removed by the scheduler's pass. A new leader takes
over the retirements it finds stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from llmgw.errors import NotFound
from llmgw.log import kv
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Shard, Store
from llmgw.server.store.states import ReplicaState, ShardState

__all__ = ["DRAIN_TIMEOUT", "Retirements"]

log = logging.getLogger("llmgw.server.scheduler")

DRAIN_TIMEOUT = 120.0
"""Seconds a retired replica's requests in flight may take to end before it stops."""
STOP_GRACE = 10.0
"""Seconds the engine gets to exit after SIGTERM."""
GIVE_UP_AFTER = DRAIN_TIMEOUT + STOP_GRACE + 30.0
"""Seconds after which a retirement no agent confirmed is removed all the same."""


class Retirements:
    """The replicas being retired: id -> (since, why), monotonic."""

    def __init__(
        self,
        store: Store,
        router: Router,
        sessions: Mapping[str, NodeSession],
        *,
        remove: Callable[[str, str], None],
        on_routes_changed: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.router = router
        self.sessions = sessions
        self.remove = remove  # (replica id, why): stop and delete at once
        self.on_routes_changed = on_routes_changed
        self.clock = clock
        self.pending: dict[str, tuple[float, str]] = {}
        self._adopted = False

    def retire(self, replica_id: str, *, why: str) -> None:
        store = self.store
        shards = store.list_shards(replica_id=replica_id)
        with store.transaction():
            for shard in shards:
                store.update_shard(shard.id, state=ShardState.STOPPING)
            store.set_replica_state(replica_id, ReplicaState.STOPPING)
        for shard in shards:
            self.router.remove_shard(shard.id)
            self.order_stop(shard)
        self.pending[replica_id] = (self.clock(), why)
        store.add_event("replica_retiring", replica_id, f"{why}; draining its requests")
        log.info("retiring a replica", extra=kv(replica=replica_id, why=why))
        self.on_routes_changed()

    def order_stop(self, shard: Shard) -> None:
        session = self.sessions.get(shard.node_id)
        if session is not None:
            session.stop_shard(shard.id, grace=STOP_GRACE, drain=DRAIN_TIMEOUT)

    def shard_ended(self, shard: Shard) -> None:
        """The agent says a stopping shard exited (or failed): it is gone; its replica with
        its last shard."""
        store = self.store
        try:
            store.delete_shard(shard.id)
        except NotFound:
            return
        if store.list_shards(replica_id=shard.replica_id):
            return
        _, why = self.pending.pop(shard.replica_id, (0.0, "retired"))
        try:
            store.delete_replica(shard.replica_id)
        except NotFound:
            return
        store.add_event("replica_removed", shard.replica_id, f"{why}; its requests ended")
        self.on_routes_changed()

    def step(self) -> None:
        """Each pass: adopt what a previous leader retired, and remove what no agent will
        confirm (its node gone, or the drain and a grace over)."""
        if not self._adopted:
            self._adopted = True
            for replica in self.store.list_replicas():
                if replica.state == ReplicaState.STOPPING and replica.id not in self.pending:
                    self.pending[replica.id] = (self.clock(), "retired by the previous leader")
                    for shard in self.store.list_shards(replica_id=replica.id):
                        self.order_stop(shard)
        now = self.clock()
        for replica_id, (since, why) in list(self.pending.items()):
            try:
                shards = self.store.list_shards(replica_id=replica_id)
                self.store.get_replica(replica_id)
            except NotFound:
                del self.pending[replica_id]
                continue
            away = all(sh.node_id not in self.sessions for sh in shards)
            if away or now - since > GIVE_UP_AFTER:
                del self.pending[replica_id]
                self.remove(
                    replica_id,
                    f"{why}; its node is away" if away else f"{why}; no agent said it stopped",
                )
