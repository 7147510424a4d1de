"""Sleeping replicas on the control plane (llmgw.server.fleet.sleeps through the scheduler
and the agents' reports): the orders sent, the replica out of routing while it sleeps and
back once awake, its level and host memory stored, the events with their timings, never a
restart of an asleep shard, and every refusal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.errors import Conflict, NotFound
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.installs import EngineInstalls
from llmgw.server.fleet.reports import AgentReports
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Store

SLEEPY = {"engine": "sim", "gpus": 0, "nodes": 1, "args": [], "params": {}, "sleep": {"level": 1}}
PLAIN = {"engine": "sim", "gpus": 0, "nodes": 1, "args": [], "params": {}}


class Rig:
    def __init__(self, store: Store) -> None:
        self.store = store
        self.router = Router()
        self.live: dict[str, NodeSession] = {}
        self.scheduler = Scheduler(store, self.router, sessions=self.live, lost=set())
        self.reports = AgentReports(
            store,
            self.router,
            self.scheduler,
            installs=EngineInstalls(store, sessions=self.live, epoch=1),
            renew=lambda session, csr: None,
            on_routes_changed=lambda: None,
        )
        store.upsert_node(
            "gpu-1",
            dataplane_addr="127.0.0.1:1",
            agent_version="0.1.0",
            inventory={},
            connected=True,
        )
        store.set_node_state("gpu-1", "approved")
        self.session = NodeSession(
            node_id="gpu-1", dataplane_addr="127.0.0.1:1", epoch=1, engines=frozenset({"sim"})
        )
        self.session.approved = True
        self.live["gpu-1"] = self.session

    def replica(self, model: str, profile: dict[str, Any]) -> tuple[str, str]:
        """A ready replica of ``model`` deployed with ``profile``: (replica id, shard id)."""
        self.store.put_model(
            model, engine="sim", params={}, replicas=1, profiles={"default": profile}
        )
        replica = self.store.add_replica(model)
        shard = self.store.add_shard(replica.id, "gpu-1", rank=0)
        self.report(shard.id, replica.id, pb.SHARD_READY)
        return replica.id, shard.id

    def report(self, shard_id: str, replica_id: str, state: pb.ShardState, **fields: Any) -> None:
        status = pb.ShardStatus(
            shard_id=shard_id, replica_id=replica_id, state=state, port=9, **fields
        )
        self.reports.apply_status(self.session, status)

    def orders(self) -> list[pb.ServerMessage]:
        out = []
        while not self.session.queue.empty():
            msg = self.session.queue.get_nowait()
            assert msg is not None
            out.append(msg)
        return out

    def routed(self, model: str) -> list[str]:
        return [ep.replica_id for ep in self.router.endpoints(model)]

    def events(self, kind: str) -> list[Any]:
        return [e for e in self.store.list_events() if e.kind == kind]


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    store = Store.open(tmp_path / "llmgw.db")
    yield Rig(store)
    store.close()


def test_sleep_takes_the_replica_out_of_routing_and_wake_puts_it_back(rig: Rig) -> None:
    replica, shard = rig.replica("m", SLEEPY)
    assert rig.routed("m") == [replica]
    op = rig.scheduler.sleep_replica(replica, 1, why="idle 5m", actor="alice")
    (order,) = rig.orders()
    assert order.sleep_shard.shard_id == shard and order.sleep_shard.level == 1
    assert order.sleep_shard.meta.op_id == op
    # Out of routing at once, before the engine answers.
    assert rig.routed("m") == []
    assert rig.store.get_replica(replica).state == "falling_asleep"
    rig.report(shard, replica, pb.SHARD_FALLING_ASLEEP, sleep_level=1)
    rig.report(
        shard, replica, pb.SHARD_ASLEEP, sleep_level=1, host_memory_mib=512, transition_ms=80
    )
    assert rig.store.get_replica(replica).state == "asleep"
    stored = rig.store.get_shard(shard)
    assert (stored.state, stored.sleep_level, stored.host_memory_mib) == ("asleep", 1, 512)
    assert rig.routed("m") == []
    (event,) = rig.events("replica_asleep")
    assert (event.subject, event.actor) == (replica, "alice")
    assert "asleep at level 1 in " in event.message
    assert "(engine 0.08s), holding 512 MiB of host memory: idle 5m" in event.message
    # Asleep: the scheduler neither restarts nor rebuilds it.
    rig.scheduler.reconcile()
    assert rig.orders() == []
    assert rig.store.get_shard(shard).state == "asleep"

    rig.scheduler.wake_replica(replica, why="a request came", actor="")
    (order,) = rig.orders()
    assert order.wake_shard.shard_id == shard
    assert rig.store.get_replica(replica).state == "waking"
    rig.report(shard, replica, pb.SHARD_WAKING, sleep_level=1)
    assert rig.routed("m") == []
    rig.report(shard, replica, pb.SHARD_READY, transition_ms=1500)
    assert rig.routed("m") == [replica]
    stored = rig.store.get_shard(shard)
    assert (stored.state, stored.sleep_level, stored.host_memory_mib) == ("ready", 0, 0)
    (event,) = rig.events("replica_awake")
    assert "(engine 1.50s): a request came" in event.message


def test_a_refused_order_is_an_event_with_the_nodes_reason(rig: Rig) -> None:
    replica, shard = rig.replica("m", SLEEPY)
    op = rig.scheduler.sleep_replica(replica, 1, why="idle")
    # The agent could not: it reports the shard ready again, then the order's result.
    rig.report(shard, replica, pb.SHARD_READY)
    rig.reports.handlers()["op_result"](
        rig.session, pb.AgentMessage(op_result=pb.OperationResult(op_id=op, ok=False, error="boom"))
    )
    (event,) = rig.events("replica_sleep_refused")
    assert (event.subject, event.message) == (replica, "boom")
    assert rig.routed("m") == [replica]
    assert rig.store.get_shard(shard).state == "ready"  # not failed: it serves


def test_an_order_refused_before_the_engine_was_touched_leaves_the_replica_as_it_was(
    rig: Rig,
) -> None:
    replica, shard = rig.replica("m", SLEEPY)

    def refuse(op: str) -> None:
        result = pb.OperationResult(op_id=op, ok=False, error="shard is starting, not ready")
        rig.reports.handlers()["op_result"](rig.session, pb.AgentMessage(op_result=result))

    refuse(rig.scheduler.sleep_replica(replica, 1, why="idle"))
    assert rig.store.get_replica(replica).state == "ready"
    assert rig.store.get_shard(shard).state == "ready"
    assert rig.routed("m") == [replica]  # routed again
    rig.scheduler.sleep_replica(replica, 1, why="idle")
    rig.report(shard, replica, pb.SHARD_ASLEEP, sleep_level=1)
    refuse(rig.scheduler.wake_replica(replica, why="a request"))
    assert rig.store.get_replica(replica).state == "asleep"
    assert rig.store.get_shard(shard).state == "asleep"
    assert len(rig.events("replica_wake_refused")) == 1


def test_a_replica_started_for_level_1_may_sleep_at_level_2_where_its_engine_can(
    rig: Rig,
) -> None:
    # The sim (as vLLM) is started with the same flag for both levels: level 2 drops the
    # weights (what the planner falls back to when the node's sleepers hold enough).
    replica, shard = rig.replica("m", SLEEPY)
    op = rig.scheduler.sleep_replica(replica, 2, why="host memory")
    order = rig.orders()[-1]
    assert order.sleep_shard.shard_id == shard and order.sleep_shard.level == 2
    rig.report(shard, replica, pb.SHARD_ASLEEP, sleep_level=2, transition_ms=5)
    assert op and rig.store.get_shard(shard).sleep_level == 2
    (event,) = rig.events("replica_asleep")
    assert "asleep at level 2 in " in event.message and event.message.endswith("host memory")


def test_refusals(rig: Rig) -> None:
    plain, _ = rig.replica("plain", PLAIN)
    sleepy, shard = rig.replica("sleepy", SLEEPY)
    with pytest.raises(NotFound):
        rig.scheduler.sleep_replica("nope", 1, why="x")
    with pytest.raises(Conflict, match="cannot sleep: its profile has no 'sleep'"):
        rig.scheduler.sleep_replica(plain, 1, why="x")
    # SGLang sleeps at its one level: a level-2 order is refused, naming the fix.
    sglang, _ = rig.replica("sglang", {**SLEEPY, "engine": "sglang"})
    with pytest.raises(Conflict, match=r"was started to sleep at level 1 .*give --level 1"):
        rig.scheduler.sleep_replica(sglang, 2, why="x")
    with pytest.raises(Conflict, match="sleep level must be 1 or 2, not 3"):
        rig.scheduler.sleep_replica(sleepy, 3, why="x")
    with pytest.raises(Conflict, match=r"is ready, not asleep|needs no waking"):
        rig.scheduler.wake_replica(sleepy, why="x")
    rig.scheduler.sleep_replica(sleepy, 1, why="x")
    with pytest.raises(Conflict, match="is falling_asleep, not ready"):
        rig.scheduler.sleep_replica(sleepy, 1, why="x")
    rig.report(shard, sleepy, pb.SHARD_ASLEEP, sleep_level=1)
    with pytest.raises(Conflict, match="is asleep already"):
        rig.scheduler.sleep_replica(sleepy, 1, why="x")
    del rig.live["gpu-1"]
    with pytest.raises(Conflict, match=r"node gpu-1 .* is not connected"):
        rig.scheduler.wake_replica(sleepy, why="x")


def test_an_engine_that_dies_asleep_is_failed_and_restarted(rig: Rig) -> None:
    replica, shard = rig.replica("m", SLEEPY)
    rig.scheduler.sleep_replica(replica, 1, why="x")
    rig.report(shard, replica, pb.SHARD_ASLEEP, sleep_level=1)
    rig.report(shard, replica, pb.SHARD_FAILED, reason="engine exited with code 1")
    assert rig.store.get_shard(shard).state == "failed"
    assert rig.events("shard_failed")
