"""The session life cycle (llmgw.server.fleet.sessions) and the agent reports it hands on
(llmgw.server.fleet.reports), wired as the control plane wires them, on a real store and CA: a
stream opens and closes, a node away for the loss timeout is lost and loses its replicas,
a rank-0 shard that turns ready becomes routable."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from cryptography import x509

from llmgw import pki
from llmgw.contracts.control_planes import ControlPlaneList
from llmgw.contracts.inventory import multinode_ports
from llmgw.contracts.ports import PortRange
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.installs import Build, EngineInstalls
from llmgw.server.fleet.nodes import Membership
from llmgw.server.fleet.reports import AgentReports, agent_messages
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.sessions import HEARTBEAT_CHECK_MAX, HEARTBEAT_CHECK_SLACK, Sessions
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Store
from llmgw.server.store.states import NodeState, ShardState


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "llmgw.db")
    yield s
    s.close()


class Wired:
    """The parts a stream reaches, built as ControlPlane._assemble builds them."""

    def __init__(
        self,
        tmp: Path,
        store: Store,
        *,
        loss_timeout: float = 60.0,
    ) -> None:
        self.ca = pki.init_ca(tmp / "ca")
        self.store = store
        self.live: dict[str, NodeSession] = {}
        self.lost: set[str] = set()
        self.router = Router()
        self.metrics = Metrics()
        self.routes_changed = 0
        self.installs = EngineInstalls(store, sessions=self.live, epoch=7)
        self.scheduler = Scheduler(
            store,
            self.router,
            sessions=self.live,
            lost=self.lost,
            on_routes_changed=self.changed,
            engine_holds=self.installs.holds,
        )
        self.membership = Membership(
            store, self.scheduler, self.router, sessions=self.live, ca=self.ca, cert_lifetime=3600
        )
        self.reports = AgentReports(
            store,
            self.router,
            self.scheduler,
            installs=self.installs,
            renew=self.membership.renew,
            on_routes_changed=self.changed,
        )
        self.sessions = Sessions(
            store,
            self.router,
            self.metrics,
            live=self.live,
            lost=self.lost,
            membership=self.membership,
            scheduler=self.scheduler,
            reports=self.reports,
            epoch=7,
            loss_timeout=loss_timeout,
            on_routes_changed=self.changed,
        )
        # The stream's table of handlers, as the leader wires it (no index: events dropped).
        self.kv_events: list[tuple[str, pb.KvEvents]] = []
        self.messages = agent_messages(
            self.reports,
            kv_events=lambda node, events: self.kv_events.append((node, events)),
            updates=cast(Any, None),
        )

    def tell(self, session: NodeSession, msg: pb.AgentMessage) -> None:
        """What the stream does with a message after the Hello."""
        self.messages[msg.WhichOneof("msg") or ""](session, msg)

    def changed(self) -> None:
        self.routes_changed += 1

    def cert(self, tmp: Path, node_id: str) -> x509.Certificate:
        return pki.load_cert(pki.issue_node_cert(self.ca, node_id, tmp / node_id).cert)

    def connect(
        self,
        cert: x509.Certificate,
        node_id: str = "gpu-1",
        *,
        degraded: tuple[pb.DegradedReason, ...] = (),
        multinode_ports: str = "",
    ) -> NodeSession:
        hello = pb.Hello(
            node_id=node_id,
            dataplane_addr="127.0.0.1:9443",
            agent_version="0.1.0",
            inventory=pb.Inventory(
                hostname=node_id,
                cpus=8,
                engines=["sim"],
                degraded=list(degraded),
                multinode_ports=multinode_ports,
            ),
        )
        session = self.sessions.open(hello, "ipv4:127.0.0.1:5000", cert)
        self.sessions.after_hello(session, hello)
        return session


def _spy_writes(store: Store) -> tuple[list[str], Callable[..., object]]:
    """Note every statement but a SELECT the store runs from now on; the list, and the real
    ``execute`` to put back."""
    writes: list[str] = []
    real_execute = store.database.execute

    def execute(sql: str, params: object = ()) -> object:
        if not sql.lstrip().upper().startswith("SELECT"):
            writes.append(sql)
        return real_execute(sql, params)  # type: ignore[arg-type]

    store.database.execute = execute  # type: ignore[method-assign]
    return writes, real_execute


def test_a_new_node_is_pending_and_its_session_carries_the_epoch(
    tmp_path: Path, store: Store
) -> None:
    wired = Wired(tmp_path, store)
    session = wired.connect(wired.cert(tmp_path, "gpu-1"))
    assert wired.live == {"gpu-1": session}
    assert session.epoch == 7 and not session.approved
    assert session.held_inventory is not None  # kept in memory until approval
    assert wired.sessions.node_state("gpu-1") == NodeState.PENDING
    assert wired.sessions.node_state("gpu-2") == NodeState.PENDING  # unknown: pending too
    assert wired.metrics.nodes.values[("connected",)] == 1
    kinds = [e.kind for e in store.list_events()]
    assert "node_pending" in kinds and "node_connected" in kinds


def test_a_node_that_comes_back_changed_says_so_in_the_events(tmp_path: Path, store: Store) -> None:
    wired = Wired(tmp_path, store)
    cert = wired.cert(tmp_path, "gpu-1")
    docker = pb.DegradedReason(code="docker", message="dockerd at unix:///x cannot be reached")

    def health_events() -> list[tuple[str, str]]:
        return [
            (e.kind, e.message)
            for e in reversed(store.list_events(subject="gpu-1"))
            if e.kind in ("node_degraded", "node_healthy")
        ]

    wired.connect(cert, degraded=(docker,))
    assert health_events() == []  # pending: its inventory is held, not yet judged
    wired.membership.approve("gpu-1", store.get_node("gpu-1").fingerprint or "", actor="operator")
    assert health_events() == [("node_degraded", docker.message)]
    wired.connect(cert, degraded=(docker,))  # the same on a reconnect: no news
    assert len(health_events()) == 1
    wired.connect(cert)  # docker fixed while the agent restarted
    assert health_events()[-1] == ("node_healthy", f"no longer degraded (was: {docker.message})")


def test_the_reported_multinode_ports_are_kept_with_the_nodes_inventory(
    tmp_path: Path, store: Store
) -> None:
    wired = Wired(tmp_path, store)
    cert = wired.cert(tmp_path, "gpu-1")
    wired.connect(cert, multinode_ports="40000-40099")
    wired.membership.approve("gpu-1", store.get_node("gpu-1").fingerprint or "", actor="operator")
    inventory = store.get_node("gpu-1").inventory
    assert inventory["multinode_ports"] == "40000-40099"
    assert multinode_ports(inventory) == PortRange(40000, 40099)
    # The agent restarted with the range widened: the stored one follows.
    wired.connect(cert, multinode_ports="40000-40999")
    assert multinode_ports(store.get_node("gpu-1").inventory) == PortRange(40000, 40999)
    # An older agent in its place reports none: the default range.
    wired.connect(cert)
    assert multinode_ports(store.get_node("gpu-1").inventory) == PortRange(29500, 29999)


def test_a_reconnect_replaces_the_old_stream(tmp_path: Path, store: Store) -> None:
    wired = Wired(tmp_path, store)
    cert = wired.cert(tmp_path, "gpu-1")
    old = wired.connect(cert)
    new = wired.connect(cert)
    assert wired.live == {"gpu-1": new}
    assert old.queue.get_nowait() is None  # told to end
    wired.sessions.close(old)  # the old stream's end changes nothing now
    assert wired.live == {"gpu-1": new}


def test_a_node_silent_for_the_loss_timeout_loses_its_replicas(
    tmp_path: Path, store: Store
) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store, loss_timeout=0.05)
        cert = wired.cert(tmp_path, "gpu-1")
        session = wired.connect(cert)
        store.set_node_state("gpu-1", NodeState.APPROVED)
        store.put_model("m", engine="sim", params={}, replicas=1)
        replica = store.add_replica("m")
        store.add_shard(replica.id, "gpu-1")
        session.silent = True  # its heartbeats stopped: lost at once when the stream ends
        wired.sessions.close(session)
        assert wired.live == {}
        await asyncio.sleep(0.01)
        assert wired.lost == {"gpu-1"}
        assert store.get_node("gpu-1").lost
        assert store.list_replicas("m") == []
        kinds = [e.kind for e in store.list_events()]
        assert "node_lost" in kinds and "replica_removed" in kinds
        # Back: no longer lost.
        wired.connect(cert)
        assert wired.lost == set() and not store.get_node("gpu-1").lost
        wired.sessions.close_all()

    asyncio.run(main())


def _drain(*sessions: NodeSession) -> None:
    for session in sessions:
        while not session.queue.empty():
            session.queue.get_nowait()


def test_a_silent_stream_is_cut_just_past_the_loss_timeout_not_a_heartbeat_later(
    tmp_path: Path, store: Store
) -> None:
    wired = Wired(tmp_path, store, loss_timeout=12.0)
    a = wired.connect(wired.cert(tmp_path, "gpu-1"), "gpu-1")
    b = wired.connect(wired.cert(tmp_path, "gpu-2"), "gpu-2")
    _drain(a, b)
    t = 1000.0
    a.last_heartbeat, b.last_heartbeat = t, t + 3.0
    check = wired.sessions.check_heartbeats
    # Nothing due for a while: the next check is a second away, not a heartbeat interval.
    assert check(t + 5.0) == pytest.approx(HEARTBEAT_CHECK_MAX + HEARTBEAT_CHECK_SLACK)
    # A deadline nearer than that: the next check lands just past it.
    assert check(t + 11.6) == pytest.approx(0.4 + HEARTBEAT_CHECK_SLACK)
    assert check(t + 12.0) == pytest.approx(HEARTBEAT_CHECK_SLACK)  # not more than 12 s yet
    assert a.queue.empty() and not a.silent
    # Just past it: cut, lost at once when its stream ends (Sessions.close); b goes on.
    assert check(t + 12.0 + HEARTBEAT_CHECK_SLACK) == pytest.approx(
        HEARTBEAT_CHECK_MAX + HEARTBEAT_CHECK_SLACK
    )
    assert a.silent and a.queue.get_nowait() is None
    assert not b.silent and b.queue.empty()
    # Cut once: while its stream ends, later checks pass it over.
    check(t + 13.0)
    assert a.queue.empty()
    # A heartbeat moves the deadline: b, heard at t + 14, is due at t + 26.
    b.last_heartbeat = t + 14.0
    assert check(t + 25.5) == pytest.approx(0.5 + HEARTBEAT_CHECK_SLACK)
    assert check(t + 26.02) == pytest.approx(HEARTBEAT_CHECK_MAX + HEARTBEAT_CHECK_SLACK)
    assert b.silent and b.queue.get_nowait() is None


def test_a_hung_node_is_lost_within_a_second_of_its_loss_timeout(
    tmp_path: Path, store: Store
) -> None:
    """The watch, run as the control plane runs it: a node silent for the loss timeout is
    lost within a second of it, not a heartbeat interval (5 s at the default) later."""

    async def main() -> None:
        wired = Wired(tmp_path, store, loss_timeout=0.3)
        session = wired.connect(wired.cert(tmp_path, "gpu-1"))
        store.set_node_state("gpu-1", NodeState.APPROVED)
        store.put_model("m", engine="sim", params={}, replicas=0)
        store.add_shard(store.add_replica("m").id, "gpu-1")
        _drain(session)

        async def stream() -> None:  # the stream's writer: ends on None, then closes
            while await session.queue.get() is not None:
                pass
            wired.sessions.close(session)

        writer = asyncio.create_task(stream())
        session.last_heartbeat = start = time.monotonic()
        watch = asyncio.create_task(wired.sessions.watch_heartbeats())
        try:
            while "gpu-1" not in wired.lost and time.monotonic() - start < 5.0:  # noqa: ASYNC110 - bounded poll
                await asyncio.sleep(0.005)
            elapsed = time.monotonic() - start
        finally:
            watch.cancel()
            writer.cancel()
            await asyncio.gather(watch, writer, return_exceptions=True)
            wired.sessions.close_all()
        assert wired.lost == {"gpu-1"}
        assert 0.3 <= elapsed <= 0.3 + HEARTBEAT_CHECK_MAX + 0.5, elapsed
        assert store.get_node("gpu-1").lost

    asyncio.run(main())


def test_a_ready_rank0_shard_becomes_routable_and_a_failed_one_leaves(
    tmp_path: Path, store: Store
) -> None:
    wired = Wired(tmp_path, store)
    session = wired.connect(wired.cert(tmp_path, "gpu-1"))
    store.put_model("m", engine="sim", params={}, replicas=1)
    shard = store.add_shard(store.add_replica("m").id, "gpu-1")
    ready = pb.ShardStatus(shard_id=shard.id, state=pb.SHARD_READY, port=8001)
    wired.tell(session, pb.AgentMessage(shard_status=ready))
    assert [e.shard_id for e in wired.router.endpoints("m")] == [shard.id]
    assert store.get_shard(shard.id).state == ShardState.READY
    assert wired.routes_changed == 1
    exited = pb.ShardStatus(shard_id=shard.id, state=pb.SHARD_EXITED, reason="killed")
    wired.tell(session, pb.AgentMessage(shard_status=exited))
    assert wired.router.endpoints("m") == []
    # An exit nobody ordered is a failure.
    assert store.get_shard(shard.id).state == ShardState.FAILED
    assert "shard_failed" in [e.kind for e in store.list_events()]


def test_a_draining_agent_is_routed_around(tmp_path: Path, store: Store) -> None:
    wired = Wired(tmp_path, store)
    session = wired.connect(wired.cert(tmp_path, "gpu-1"))
    store.put_model("m", engine="sim", params={}, replicas=1)
    shard = store.add_shard(store.add_replica("m").id, "gpu-1")
    ready = pb.ShardStatus(shard_id=shard.id, state=pb.SHARD_READY, port=8001)
    wired.tell(session, pb.AgentMessage(shard_status=ready))
    assert wired.router.endpoints("m") != []
    wired.tell(session, pb.AgentMessage(draining=pb.Draining()))
    assert session.draining and wired.router.endpoints("m") == []
    # A ready report from a draining agent does not make it routable again.
    wired.tell(session, pb.AgentMessage(shard_status=ready))
    assert wired.router.endpoints("m") == []


def test_a_desired_engine_is_ordered_once_approved_and_its_failure_recorded(
    tmp_path: Path, store: Store
) -> None:
    wired = Wired(tmp_path, store)
    session = wired.connect(wired.cert(tmp_path, "gpu-1"))
    while not session.queue.empty():
        session.queue.get_nowait()
    build = Build.checked("", "https://x/y.tar.gz", "0" * 64)
    out = wired.installs.desire(
        engine="vllm", version="0.9", builds=[build], node=None, actor="operator"
    )
    (row,) = out["nodes"]
    assert (row["node"], row["state"]) == ("gpu-1", "waiting")
    assert row["reason"] == "vllm 0.9 is ordered once the node is approved"
    assert session.queue.empty()  # a pending node gets no orders
    fp = store.get_node("gpu-1").fingerprint
    assert fp is not None
    wired.membership.approve("gpu-1", fp, actor="operator")
    while not session.queue.empty():
        session.queue.get_nowait()
    wired.installs.sync()
    order = session.queue.get_nowait()
    assert order is not None and order.WhichOneof("msg") == "install_engine"
    assert order.install_engine.meta.epoch == 7
    result = pb.OperationResult(op_id=order.install_engine.meta.op_id, ok=False, error="disk full")
    wired.tell(session, pb.AgentMessage(op_result=result))
    installed = store.get_node_engine("gpu-1", "vllm")
    assert installed is not None
    assert (installed.state, installed.error) == ("failed", "disk full")
    assert "engine_install_failed" in [e.kind for e in store.list_events()]
    assert wired.scheduler._kick.is_set()  # placement looks again


def test_a_changed_list_of_control_planes_goes_to_every_live_agent(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store)
        sessions = [wired.connect(wired.cert(tmp_path, n), n) for n in ("gpu-1", "gpu-2")]
        for session in sessions:  # what the Hello queued (the reconcile's orders)
            while not session.queue.empty():
                session.queue.get_nowait()
        planes = ControlPlaneList(("cp-1:7443", "cp-3:7443"), ("2a", "3b"))
        assert wired.sessions.broadcast_control_planes(planes) == 2
        for session in sessions:
            msg = session.queue.get_nowait()
            assert msg is not None
            assert list(msg.control_planes.servers) == ["cp-1:7443", "cp-3:7443"]
            assert list(msg.control_planes.retired_serials) == ["2a", "3b"]
        # Empty, or one the agents would refuse (a server, a serial): nobody is sent anything.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llmgw.server.stream"):
            assert wired.sessions.broadcast_control_planes(ControlPlaneList(())) == 0
            bad_server = ControlPlaneList(("cp-1:7443", "cp-2"))
            assert wired.sessions.broadcast_control_planes(bad_server) == 0
            bad_serial = ControlPlaneList(("cp-1:7443",), ("2a", "not-hex"))
            assert wired.sessions.broadcast_control_planes(bad_serial) == 0
        assert all(s.queue.empty() for s in sessions)
        assert [r.getMessage() for r in caplog.records] == 2 * [
            "not sending agents the list of control planes: they would refuse it"
        ]
        # A closed session is no longer told.
        wired.sessions.close(sessions[0])
        assert wired.sessions.broadcast_control_planes(ControlPlaneList(("cp-1:7443",))) == 1
        assert sessions[0].queue.empty() and not sessions[1].queue.empty()
        wired.sessions.close_all()

    asyncio.run(main())


def test_heartbeats_write_nothing_and_last_seen_is_stored_in_one_batch(
    tmp_path: Path, store: Store
) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store)
        clock = [5000.0]
        store.database.clock = lambda: clock[0]
        sessions = {
            n: wired.connect(wired.cert(tmp_path, n), n) for n in ("gpu-1", "gpu-2", "gpu-3")
        }
        stored = {n: store.get_node(n).last_seen for n in sessions}
        writes, real_execute = _spy_writes(store)
        heartbeat = pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1))
        for second in range(1, 4):
            clock[0] = 5000.0 + second
            wired.tell(sessions["gpu-1"], heartbeat)
            wired.tell(sessions["gpu-2"], heartbeat)
        assert writes == []  # heartbeats are answered from memory
        assert sessions["gpu-1"].queue.qsize() == 3  # each one acknowledged
        assert {n: store.get_node(n).last_seen for n in sessions} == stored
        # The flush stores those heard from since the last one, in one statement.
        store.database.execute = real_execute  # type: ignore[method-assign]
        assert wired.sessions.flush_last_seen() == 2
        assert store.get_node("gpu-1").last_seen == 5003.0
        assert store.get_node("gpu-2").last_seen == 5003.0
        assert store.get_node("gpu-3").last_seen == stored["gpu-3"]
        assert wired.sessions.flush_last_seen() == 0  # nothing new heard: nothing written
        clock[0] = 5009.0
        wired.tell(sessions["gpu-3"], heartbeat)
        assert wired.sessions.flush_last_seen() == 1
        assert store.get_node("gpu-3").last_seen == 5009.0
        # A stream that closes stores its own last-seen time at once.
        clock[0] = 5012.0
        wired.tell(sessions["gpu-2"], heartbeat)
        wired.sessions.close(sessions["gpu-2"])
        assert store.get_node("gpu-2").last_seen == 5012.0
        wired.sessions.close_all()

    asyncio.run(main())


def test_gpu_utilisation_is_kept_in_the_session_and_never_written(
    tmp_path: Path, store: Store
) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store)
        session = wired.connect(wired.cert(tmp_path, "gpu-1"))
        writes, real_execute = _spy_writes(store)

        def beat(seq: int, *samples: pb.GpuUtilization) -> None:
            msg = pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq, gpu_utilization=samples))
            wired.tell(session, msg)

        for seq, busy in enumerate((5, 60, 99, 0), 1):  # a busy GPU: every second another
            beat(
                seq, pb.GpuUtilization(uuid="GPU-a", percent=busy), pb.GpuUtilization(uuid="GPU-b")
            )
        assert writes == []  # not one store write for it
        assert session.gpu_utilization == {"GPU-a": 0, "GPU-b": None}
        beat(5)  # the agent has no sample (it could not look): unknown, not the last figure
        assert session.gpu_utilization == {}
        store.database.execute = real_execute  # type: ignore[method-assign]
        assert "utilization" not in json.dumps(store.get_node("gpu-1").inventory)
        wired.sessions.close_all()

    asyncio.run(main())


def test_the_nodes_gauge_counts_without_listing_every_node(tmp_path: Path, store: Store) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store)
        one = wired.connect(wired.cert(tmp_path, "gpu-1"), "gpu-1")
        wired.connect(wired.cert(tmp_path, "gpu-2"), "gpu-2")
        store.upsert_node(
            "gpu-9", dataplane_addr=None, agent_version=None, inventory={}, connected=False
        )
        store.list_nodes = None  # type: ignore[assignment]  # a full listing would fail the test
        wired.sessions.count_nodes()
        assert wired.metrics.nodes.values[("connected",)] == 2
        assert wired.metrics.nodes.values[("disconnected",)] == 1
        wired.sessions.close(one)
        assert wired.metrics.nodes.values[("connected",)] == 1
        assert wired.metrics.nodes.values[("disconnected",)] == 2

    asyncio.run(main())


def test_a_shutdown_loses_no_node_and_stores_the_fleets_disconnect_at_once(
    tmp_path: Path, store: Store
) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store, loss_timeout=0.05)
        sessions = [wired.connect(wired.cert(tmp_path, n), n) for n in ("gpu-1", "gpu-2")]
        for node in ("gpu-1", "gpu-2"):
            store.set_node_state(node, NodeState.APPROVED)
        store.put_model("m", engine="sim", params={}, replicas=1)
        replica = store.add_replica("m")
        store.add_shard(replica.id, "gpu-1")
        before = len(store.list_events())
        wired.sessions.close_all()
        # The streams' handlers end later, each closing its session: nothing more is written.
        for session in sessions:
            wired.sessions.close(session)
        await asyncio.sleep(0.2)  # well past the loss timeout
        assert wired.live == {} and wired.lost == set()
        assert not any(n.connected or n.lost for n in store.list_nodes())
        assert [r.id for r in store.list_replicas("m")] == [replica.id]
        kinds = [e.kind for e in store.list_events()][: len(store.list_events()) - before]
        assert kinds.count("streams_closed") == 1 and "node_disconnected" not in kinds
        assert "node_lost" not in kinds

    asyncio.run(main())


def test_a_flush_in_slices_stores_each_node_once(tmp_path: Path, store: Store) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store)
        clock = [7000.0]
        store.database.clock = lambda: clock[0]
        names = [f"gpu-{i}" for i in range(5)]
        sessions = [wired.connect(wired.cert(tmp_path, n), n) for n in names]
        clock[0] = 7001.0
        for session in sessions:
            wired.tell(session, pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1)))
        assert [wired.sessions.flush_last_seen(limit=2) for _ in range(4)] == [2, 2, 1, 0]
        assert {store.get_node(n).last_seen for n in names} == {7001.0}
        wired.sessions.close_all()

    asyncio.run(main())


def test_a_shard_reported_again_unchanged_writes_nothing_and_stays_routable(
    tmp_path: Path, store: Store
) -> None:
    async def main() -> None:
        wired = Wired(tmp_path, store)
        session = wired.connect(wired.cert(tmp_path, "gpu-1"))
        store.set_node_state("gpu-1", NodeState.APPROVED)
        session.approved = True
        store.put_model("m", engine="sim", params={}, replicas=1)
        replica = store.add_replica("m")
        shard = store.add_shard(replica.id, "gpu-1")
        ready = pb.ShardStatus(shard_id=shard.id, state=pb.SHARD_READY, port=5000, pid=42)
        wired.tell(session, pb.AgentMessage(shard_status=ready))
        assert [e.shard_id for e in wired.router.endpoints("m")] == [shard.id]
        events = len(store.list_events())
        writes, real_execute = _spy_writes(store)
        wired.router.remove_node("gpu-1")  # a restarted control plane: no routes yet
        wired.tell(session, pb.AgentMessage(shard_status=ready))
        assert writes == [] and len(store.list_events()) == events
        assert [e.shard_id for e in wired.router.endpoints("m")] == [shard.id]
        moved = pb.ShardStatus(shard_id=shard.id, state=pb.SHARD_READY, port=5001, pid=43)
        wired.tell(session, pb.AgentMessage(shard_status=moved))
        store.database.execute = real_execute  # type: ignore[method-assign]
        assert writes and store.get_shard(shard.id).port == 5001
        assert len(store.list_events()) == events + 1
        wired.sessions.close_all()

    asyncio.run(main())


def test_kv_events_go_to_the_index_callback_and_its_failure_spares_the_stream(
    tmp_path: Path, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    wired = Wired(tmp_path, store)
    session = wired.connect(wired.cert(tmp_path, "gpu-1"))
    events = pb.KvEvents(shard_id="r1-s0", block_size=16, stored=[5, 6], removed=[7])
    wired.tell(session, pb.AgentMessage(kv_events=events))
    assert wired.kv_events == [("gpu-1", events)]

    def broken(node_id: str, msg: pb.KvEvents) -> None:
        raise RuntimeError("index bug")

    wired.messages = agent_messages(wired.reports, kv_events=broken, updates=cast(Any, None))
    with caplog.at_level(logging.ERROR, logger="llmgw.server.reports"):
        wired.tell(session, pb.AgentMessage(kv_events=events))
    assert "cannot apply KV cache events" in caplog.text
    # The stream's other reports still go on.
    wired.tell(session, pb.AgentMessage(draining=pb.Draining()))
    assert session.draining


def test_every_message_after_the_hello_has_one_handler_in_the_table(
    tmp_path: Path, store: Store
) -> None:
    wired = Wired(tmp_path, store)
    kinds = {f.name for f in pb.AgentMessage.DESCRIPTOR.oneofs_by_name["msg"].fields}
    assert set(wired.messages) == kinds - {"hello"}
    told: list[tuple[str, int]] = []
    updates = SimpleNamespace(on_status=lambda s, status: told.append((s.node_id, status.counter)))
    table = agent_messages(wired.reports, kv_events=lambda *_: None, updates=updates)
    session = wired.connect(wired.cert(tmp_path, "gpu-1"))
    table["update_status"](session, pb.AgentMessage(update_status=pb.UpdateStatus(counter=3)))
    assert told == [("gpu-1", 3)]
