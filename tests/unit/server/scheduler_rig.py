"""The scheduler as its tests drive it: a real store, the sessions and lost nodes a test sets,
and a router that routes what the test says; it notes the replicas the scheduler removes.
The ``cp`` fixture (conftest.py) gives one on a fresh store."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from llmgw.server.routing import Router
from llmgw.server.scheduler import Scheduler
from llmgw.server.store import Store
from llmgw.server.stream import NodeSession


@dataclass(frozen=True)
class Endpoint:
    replica_id: str


class FakeRouter:
    """Routable: the replicas a test says are (as the real router learns from the agents)."""

    def __init__(self) -> None:
        self.routable: set[str] = set()

    def endpoints(self, model: str | None = None) -> list[Any]:
        return [Endpoint(r) for r in sorted(self.routable)]

    def remove_shard(self, shard_id: str) -> None:
        pass  # the replica leaves ``routable`` as a whole (RecordingScheduler)


class RecordingScheduler(Scheduler):
    """The scheduler, noting the replicas it removes."""

    def __init__(self, cp: SchedulerRig) -> None:
        super().__init__(cp.store, cast(Router, cp.router), sessions=cp.sessions, lost=cp.lost)
        self.cp = cp

    def remove_replica(self, replica_id: str, *, why: str) -> None:
        self.cp.removed.append(replica_id)
        self.cp.router.routable.discard(replica_id)
        super().remove_replica(replica_id, why=why)


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
