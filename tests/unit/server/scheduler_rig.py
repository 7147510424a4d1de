"""The scheduler as its tests drive it: a real store, the sessions and lost nodes a test sets,
and a router that routes what the test says; it notes the replicas the scheduler removes.
The ``cp`` fixture (conftest.py) gives one on a fresh store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Store
from llmgw.server.store.states import ShardState


@dataclass(frozen=True)
class Endpoint:
    replica_id: str
    inflight: int = 0


class FakeRouter:
    """Routable: the replicas a test says are (as the real router learns from the agents),
    with the requests in flight a test says each has."""

    def __init__(self) -> None:
        self.routable: set[str] = set()
        self.inflight: dict[str, int] = {}

    def endpoints(self, model: str | None = None) -> list[Any]:
        return [Endpoint(r, self.inflight.get(r, 0)) for r in sorted(self.routable)]

    def remove_shard(self, shard_id: str) -> None:
        pass  # the replica leaves ``routable`` as a whole (RecordingScheduler)


class RecordingScheduler(Scheduler):
    """The scheduler, noting the replicas it removes."""

    def __init__(self, cp: SchedulerRig) -> None:
        super().__init__(cp.store, cast(Router, cp.router), sessions=cp.sessions, lost=cp.lost)
        self.cp = cp

    def remove_replica(self, replica_id: str, *, why: str, actor: str = "") -> None:
        self.cp.removed.append(replica_id)
        self.cp.router.routable.discard(replica_id)
        super().remove_replica(replica_id, why=why, actor=actor)


class SchedulerRig:
    """What the scheduler is given: the store, the live sessions, the router."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.sessions: dict[str, NodeSession] = {}
        self.lost: set[str] = set()
        self.router = FakeRouter()
        self.removed: list[str] = []

    def scheduler(self) -> Scheduler:
        return RecordingScheduler(self)

    def join(
        self,
        node_id: str,
        inventory: dict[str, Any],
        *,
        dataplane_addr: str,
        engines: frozenset[str],
        session_addr: str | None = None,
    ) -> None:
        """``node_id`` joined, approved and connected: its row with ``inventory``, and a
        session (its data plane at ``session_addr``, else ``dataplane_addr``)."""
        self.store.upsert_node(
            node_id,
            dataplane_addr=dataplane_addr,
            agent_version="0.1.0",
            inventory=inventory,
            connected=True,
        )
        self.store.set_node_state(node_id, "approved")
        self.sessions[node_id] = NodeSession(
            node_id=node_id,
            dataplane_addr=session_addr or dataplane_addr,
            epoch=1,
            engines=engines,
            approved=True,
        )


def set_state(cp: SchedulerRig, replica_id: str, state: str) -> None:
    """A replica and its shards in ``state`` (routed when ready), as its agent would say."""
    for shard in cp.store.list_shards(replica_id=replica_id):
        cp.store.update_shard(shard.id, state=state)
    cp.store.set_replica_state(replica_id, state)
    if state == ShardState.READY:
        cp.router.routable.add(replica_id)
    else:
        cp.router.routable.discard(replica_id)


def orders(cp: SchedulerRig) -> list[tuple[str, Any]]:
    """The orders sent to every node since the last call: (kind, order)."""
    out = []
    for session in cp.sessions.values():
        while not session.queue.empty():
            msg = session.queue.get_nowait()
            if msg is not None:
                kind = msg.WhichOneof("msg")
                out.append((kind, getattr(msg, kind)))
    return out


def order_kinds(cp: SchedulerRig) -> list[str]:
    """The kinds of the sleep, wake and stop orders sent since the last call."""
    return [k for k, _ in orders(cp) if k in ("sleep_shard", "wake_shard", "stop_shard")]
