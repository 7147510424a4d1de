"""llmgw.agent.stream against a control plane that refuses it or is far ahead of it: the
refusal is logged in the control plane's words and retried with backoff, never a crash; an
agent too far behind says so once connected; an order the node refuses is answered with
the reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from llmgw import pki
from llmgw.agent import stream
from llmgw.agent.oplog import OperationLog
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.servers import KnownServers
from llmgw.agent.shards import ShardManager
from llmgw.agent.stream import Backoff, Credentials, StreamClient
from llmgw.contracts.ports import PortRange
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc

# What a control plane at 0.1.0 says to an agent at 0.2.0 (llmgw.server.fleet.stream.version_refusal).
REFUSAL = (
    "this agent is llmgw 0.2.0, newer than the control plane's llmgw 0.1.0; upgrade the "
    "control plane to 0.2.0 or later first (control plane first, then agents), or reinstall "
    "this node with the control plane's bundle; the agent keeps retrying meanwhile"
)
RECONNECTING = "control plane stream ended; reconnecting"
BEHIND = "this agent is more than 2 minor releases behind the control plane; upgrade it"


@dataclass
class ControlPlane(pb_grpc.ControlPlaneServicer):
    """Refuses every stream as a control plane of an older release does, or welcomes it as
    one of ``version``."""

    refuse: bool
    version: str = ""
    hellos: list[pb.Hello] = field(default_factory=list)

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.ServerMessage]:
        first = await request_iterator.__anext__()
        self.hellos.append(first.hello)
        if self.refuse:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, REFUSAL)
        yield pb.ServerMessage(
            welcome=pb.Welcome(
                cluster_id="c", epoch=1, node_state="approved", server_version=self.version
            )
        )
        await asyncio.sleep(0.2)


async def _serve(pki_dir: Path, servicer: ControlPlane) -> tuple[grpc.aio.Server, int]:
    _ca, ident, _ = pki.ensure_server_identity(pki_dir, hosts=["127.0.0.1"])
    server = grpc.aio.server()
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials(
        [(ident.key.read_bytes(), ident.cert.read_bytes())],
        root_certificates=ident.ca.read_bytes(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    await server.start()
    return server, port


def _client(pki_dir: Path, tmp_path: Path, port: int) -> StreamClient:
    ca = pki.load_ca(pki_dir)
    ident = pki.issue_node_cert(ca, "gpu-1", tmp_path / "agent")
    client = StreamClient(
        node_id="gpu-1",
        servers=KnownServers((f"127.0.0.1:{port}",), tmp_path / "agent"),
        credentials=lambda: Credentials(
            cert=ident.cert.read_bytes(), key=ident.key.read_bytes(), ca=ident.ca.read_bytes()
        ),
        shards=cast(Any, SimpleNamespace(snapshot=list)),
        oplog=OperationLog(tmp_path / "agent" / "oplog.json"),
        inventory=pb.Inventory,
        dataplane_addr=lambda server: "127.0.0.1:9443",
    )
    client.backoff = Backoff(base=0.05, cap=0.2)
    return client


def _lines(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == message]


def _run_until(
    tmp_path: Path, servicer: ControlPlane, caplog: pytest.LogCaptureFixture, message: str, n: int
) -> StreamClient:
    pki_dir = tmp_path / "pki"

    async def main() -> StreamClient:
        server, port = await _serve(pki_dir, servicer)
        client = _client(pki_dir, tmp_path, port)
        task = asyncio.create_task(client.run())
        try:
            for _ in range(400):
                if len(_lines(caplog, message)) >= n:
                    break
                await asyncio.sleep(0.025)
            assert not task.done(), task  # still running: a refusal is never the agent's end
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)
        return client

    with caplog.at_level(logging.INFO, logger="llmgw.agent.stream"):
        return asyncio.run(main())


def test_a_refusal_is_logged_in_the_control_planes_words_and_retried_with_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    servicer = ControlPlane(refuse=True)
    client = _run_until(tmp_path, servicer, caplog, RECONNECTING, 3)
    lines = _lines(caplog, RECONNECTING)
    assert len(lines) >= 3, caplog.text
    server = lines[0].fields["server"]  # type: ignore[attr-defined]
    for line in lines:
        assert line.levelno == logging.WARNING
        assert line.fields["reason"] == f"refused by {server}: {REFUSAL}"  # type: ignore[attr-defined]
        assert line.fields["retry_in"].endswith("s")  # type: ignore[attr-defined]
    # It said Hello each time, and the backoff grew instead of being reset.
    assert len(servicer.hellos) >= 3
    assert client.backoff.attempt >= 3
    assert client.connected_to is None


@pytest.mark.parametrize(("version", "warned"), [("0.4.0", True), ("0.3.2", False), ("", False)])
def test_an_agent_too_far_behind_says_so_once_connected(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    warned: bool,
) -> None:
    monkeypatch.setattr(stream, "__version__", "0.1.5")
    _run_until(tmp_path, ControlPlane(refuse=False, version=version), caplog, RECONNECTING, 1)
    connected = _lines(caplog, "connected to the control plane")
    assert connected and connected[0].fields["version"] == (version or "?")  # type: ignore[attr-defined]
    behind = _lines(caplog, BEHIND)
    assert bool(behind) is warned, caplog.text
    if warned:
        assert behind[0].fields == {  # type: ignore[attr-defined]
            "version": "0.1.5",
            "server_version": version,
            "hint": f"llmgw ctl update gpu-1 --version {version}",
        }


@dataclass
class Orders(pb_grpc.ControlPlaneServicer):
    """Welcomes the agent, sends it ``order``, and keeps what it answers until the order's
    OperationResult."""

    order: pb.StartShard
    answers: list[pb.AgentMessage] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.ServerMessage]:
        await request_iterator.__anext__()  # Hello
        yield pb.ServerMessage(welcome=pb.Welcome(cluster_id="c", epoch=1, node_state="approved"))
        yield pb.ServerMessage(start_shard=self.order)
        async for msg in request_iterator:
            self.answers.append(msg)
            if msg.WhichOneof("msg") == "op_result":
                self.done.set()
                break
        await asyncio.sleep(0.2)


def test_a_start_shard_outside_multinode_ports_is_answered_with_the_reason(
    tmp_path: Path,
) -> None:
    order = pb.StartShard(
        meta=pb.OrderMeta(epoch=1, op_id="op-7"),
        shard_id="r1-s0",
        replica_id="r1",
        model="big",
        engine="sim",
        rank=0,
        nodes=2,
        dist_init_addr="10.0.0.1:29500",
    )
    servicer = Orders(order)
    statuses: list[object] = []
    pki_dir = tmp_path / "pki"

    async def main() -> None:
        server, port = await _serve(pki_dir, servicer)
        client = _client(pki_dir, tmp_path, port)
        client.shards = ShardManager(
            tmp_path / "state",
            ProcessRuntime(),
            statuses.append,
            multinode_ports=PortRange(30000, 30099),
        )
        task = asyncio.create_task(client.run())
        try:
            await asyncio.wait_for(servicer.done.wait(), 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)

    asyncio.run(main())
    (result,) = [m.op_result for m in servicer.answers if m.WhichOneof("msg") == "op_result"]
    assert (result.op_id, result.ok, result.epoch) == ("op-7", False, 1)
    assert result.error.startswith(
        "shard r1-s0: its dist-init address (dist_init_addr) 10.0.0.1:29500 is outside this "
        "node's multinode_ports 30000-30099, the only ports its firewall opens to the "
        "fabric's peers;"
    )
    assert "re-run install-agent.sh so that the firewall follows" in result.error
    assert statuses == []  # nothing started, so no shard status either


# ------------------------------------------------------------ the control planes the leader names


@dataclass
class Scripted(pb_grpc.ControlPlaneServicer):
    """Answers each Hello with ``script`` (a Refuse in it ends the stream as a standby's
    does), then holds the stream open for a while."""

    script: list[pb.ServerMessage]
    hellos: list[pb.Hello] = field(default_factory=list)
    hold: float = 0.3

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.ServerMessage]:
        first = await request_iterator.__anext__()
        self.hellos.append(first.hello)
        for msg in self.script:
            yield msg
            if msg.WhichOneof("msg") == "refuse":
                return
        await asyncio.sleep(self.hold)


def _welcome(epoch: int = 1) -> pb.ServerMessage:
    return pb.ServerMessage(welcome=pb.Welcome(cluster_id="c", epoch=epoch, node_state="approved"))


def _planes(*servers: str, retired: tuple[str, ...] = ()) -> pb.ServerMessage:
    return pb.ServerMessage(
        control_planes=pb.ControlPlanes(servers=list(servers), retired_serials=list(retired))
    )


def _dead_address() -> str:
    """host:port where nothing listens (bound once, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def _agent(pki_dir: Path, tmp_path: Path, seeds: tuple[str, ...]) -> tuple[StreamClient, list[str]]:
    """A client whose KnownServers has ``seeds`` and the state directory tmp_path/agent; and
    the servers it was welcomed by, in order."""
    client = _client(pki_dir, tmp_path, 0)
    client.servers = KnownServers(seeds, tmp_path / "agent")
    welcomed: list[str] = []
    client.on_state = lambda state, server: (
        welcomed.append(server or "") if state == "connected" else None
    )
    return client, welcomed


async def _until(check: Any, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _learnt_file(tmp_path: Path) -> Path:
    return tmp_path / "agent" / "servers.json"


def test_the_leaders_list_is_kept_and_a_restarted_agent_dials_it_when_its_seed_is_gone(
    tmp_path: Path,
) -> None:
    """The first agent knows the leader from agent.yaml and learns it (and a second instance)
    from the leader; the next agent's agent.yaml names only an address where nothing
    listens, and it reaches the leader through what the first one learnt."""
    pki_dir = tmp_path / "pki"
    other = _dead_address()
    servicer = Scripted([])

    async def main() -> tuple[list[str], list[str], tuple[str, ...]]:
        server, port = await _serve(pki_dir, servicer)
        leader = f"127.0.0.1:{port}"
        servicer.script = [_welcome(), _planes(leader, other, retired=("5e3", "c13"))]
        try:
            first, first_welcomed = _agent(pki_dir, tmp_path, (leader,))
            task = asyncio.create_task(first.run())
            await _until(lambda: _learnt_file(tmp_path).exists(), "servers.json")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

            # Restarted, with an agent.yaml that names only a gone instance.
            gone = _dead_address()
            second, second_welcomed = _agent(pki_dir, tmp_path, (gone,))
            assert second.servers.rotation() == (gone, leader, other)
            assert second.servers.is_retired("c13")  # refused from the start
            task = asyncio.create_task(second.run())
            await _until(lambda: second_welcomed, "the second agent's welcome")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return first_welcomed, second_welcomed, second.servers.rotation()
        finally:
            await server.stop(None)

    first_welcomed, second_welcomed, rotation = asyncio.run(main())
    leader = first_welcomed[0]
    assert json.loads(_learnt_file(tmp_path).read_text()) == {
        "servers": [leader, other],
        "retired_serials": ["5e3", "c13"],
    }
    assert second_welcomed[0] == leader
    assert rotation[1:] == (leader, other)  # the seed first, always
    assert len(servicer.hellos) >= 2


def test_a_list_before_the_welcome_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki_dir = tmp_path / "pki"
    servicer = Scripted([_planes("10.9.9.9:7443"), _welcome()])

    async def main() -> StreamClient:
        server, port = await _serve(pki_dir, servicer)
        client, welcomed = _agent(pki_dir, tmp_path, (f"127.0.0.1:{port}",))
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: welcomed and len(servicer.hellos) >= 2, "two sessions")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)
        return client

    with caplog.at_level(logging.WARNING, logger="llmgw.agent.stream"):
        client = asyncio.run(main())
    assert client.servers.learnt == ()
    assert not _learnt_file(tmp_path).exists()
    ignored = _lines(caplog, "ignoring a list of control planes sent before the Welcome")
    assert ignored and ignored[0].fields["entries"] == 1  # type: ignore[attr-defined]


def test_a_bad_list_is_ignored_and_the_stream_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A list with one bad entry, too long or empty changes nothing and does not end the
    stream: the good list after them, on the same stream, is taken."""
    pki_dir = tmp_path / "pki"
    servicer = Scripted([], hold=30.0)

    async def main() -> StreamClient:
        server, port = await _serve(pki_dir, servicer)
        leader = f"127.0.0.1:{port}"
        servicer.script = [
            _welcome(),
            _planes(leader, "10.0.0.2:7443"),
            _planes(leader, "10.0.0.3"),  # no port: refused whole
            _planes(*[f"10.0.1.{i}:7443" for i in range(65)]),  # too many
            _planes(),  # empty
            _planes(leader, "10.0.0.4:7443"),
        ]
        client, _ = _agent(pki_dir, tmp_path, (leader,))
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: client.servers.learnt[-1:] == ("10.0.0.4:7443",), "the last list")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)
        return client

    with caplog.at_level(logging.INFO):
        client = asyncio.run(main())
    leader = client.servers.seeds[0]
    assert len(servicer.hellos) == 1  # one stream throughout
    refused = _lines(
        caplog,
        "ignoring the control plane's list of control planes; still dialling the ones known before",
    )
    assert [r.fields["entries"] for r in refused] == [2, 65, 0]  # type: ignore[attr-defined]
    learnt = _lines(caplog, "learnt the control planes from the leader")
    assert [r.fields["servers"] for r in learnt] == [  # type: ignore[attr-defined]
        f"{leader},10.0.0.2:7443",
        f"{leader},10.0.0.4:7443",
    ]
    assert json.loads(_learnt_file(tmp_path).read_text()) == {"servers": [leader, "10.0.0.4:7443"]}
    assert client.servers.rotation() == (leader, "10.0.0.4:7443")  # 10.0.0.2 retired


def test_a_standbys_refusal_still_sends_the_agent_to_the_leader_it_names(
    tmp_path: Path,
) -> None:
    """agent.yaml names the standby only; its Refuse names the leader, which the agent dials
    next (as before) and whose list it keeps; the standby's refusal teaches it nothing."""
    pki_dir = tmp_path / "pki"
    leader_cp = Scripted([])
    standby = Scripted([])

    async def main() -> tuple[StreamClient, list[str], str, str]:
        leader_server, leader_port = await _serve(pki_dir, leader_cp)
        standby_server, standby_port = await _serve(pki_dir, standby)
        leader, standby_addr = f"127.0.0.1:{leader_port}", f"127.0.0.1:{standby_port}"
        leader_cp.script = [_welcome(), _planes(standby_addr, leader)]
        standby.script = [
            pb.ServerMessage(refuse=pb.Refuse(leader=leader, message="this is a standby")),
        ]
        client, welcomed = _agent(pki_dir, tmp_path, (standby_addr,))
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: _learnt_file(tmp_path).exists(), "servers.json")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await leader_server.stop(None)
            await standby_server.stop(None)
        return client, welcomed, leader, standby_addr

    client, welcomed, leader, standby_addr = asyncio.run(main())
    assert len(standby.hellos) >= 1 and len(leader_cp.hellos) >= 1
    assert welcomed[0] == leader
    assert client.servers.rotation() == (standby_addr, leader)
    assert json.loads(_learnt_file(tmp_path).read_text()) == {"servers": [standby_addr, leader]}


def test_a_deposed_leaders_list_is_never_taken(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A control plane whose Welcome carries an epoch below the agent's fence is refused
    before anything it says next is read: its list of control planes teaches nothing."""
    pki_dir = tmp_path / "pki"
    servicer = Scripted([_welcome(epoch=3), _planes("10.9.9.9:7443")])

    async def main() -> StreamClient:
        server, port = await _serve(pki_dir, servicer)
        client, welcomed = _agent(pki_dir, tmp_path, (f"127.0.0.1:{port}",))
        client.oplog.observe_epoch(5)  # a successor's epoch, accepted before
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: len(servicer.hellos) >= 2, "two tries")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)
        assert welcomed == []
        return client

    with caplog.at_level(logging.INFO, logger="llmgw.agent"):
        client = asyncio.run(main())
    assert client.servers.learnt == ()
    assert not _learnt_file(tmp_path).exists()
    assert not _lines(caplog, "learnt the control planes from the leader")
    reasons = [r.fields["reason"] for r in _lines(caplog, RECONNECTING)]  # type: ignore[attr-defined]
    assert reasons and all("lower than 5 already accepted" in r for r in reasons), reasons


@dataclass
class Listening(pb_grpc.ControlPlaneServicer):
    """Welcomes the stream with a short heartbeat interval and answers each heartbeat, as a
    control plane does, keeping what they carried."""

    heartbeats: list[pb.Heartbeat] = field(default_factory=list)

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.ServerMessage]:
        await request_iterator.__anext__()
        yield pb.ServerMessage(
            welcome=pb.Welcome(
                cluster_id="c", epoch=1, node_state="approved", heartbeat_interval_s=0.05
            )
        )
        async for msg in request_iterator:
            if msg.WhichOneof("msg") == "heartbeat":
                self.heartbeats.append(msg.heartbeat)
                yield pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(seq=msg.heartbeat.seq))


def test_each_heartbeat_carries_the_latest_gpu_utilisation(tmp_path: Path) -> None:
    pki_dir = tmp_path / "pki"
    servicer = Listening()
    latest = [pb.GpuUtilization(uuid="GPU-a", percent=37), pb.GpuUtilization(uuid="GPU-b")]

    async def main() -> float:
        server, port = await _serve(pki_dir, servicer)
        client = _client(pki_dir, tmp_path, port)
        client.gpu_utilization = lambda: latest
        task = asyncio.create_task(client.run())
        try:
            for _ in range(400):
                if len(servicer.heartbeats) >= 2:
                    latest[0] = pb.GpuUtilization(uuid="GPU-a", percent=0)
                if any(h.gpu_utilization[0].percent == 0 for h in servicer.heartbeats[2:]):
                    break
                await asyncio.sleep(0.025)
            return client.heartbeat_interval
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)

    assert asyncio.run(main()) == 0.05  # the Welcome's, which the GPU sampler follows
    first = servicer.heartbeats[0]
    assert [(u.uuid, u.HasField("percent")) for u in first.gpu_utilization] == [
        ("GPU-a", True),
        ("GPU-b", False),  # unknown stays unset on the wire, not 0
    ]
    assert first.gpu_utilization[0].percent == 37
    # Read again for each heartbeat: a later one carries the newer figure (0: idle, known).
    later = servicer.heartbeats[-1].gpu_utilization[0]
    assert later.HasField("percent") and later.percent == 0


# ------------------------------------------------------------- a control plane that falls silent


@dataclass
class Answering(pb_grpc.ControlPlaneServicer):
    """Welcomes the stream with a heartbeat interval of ``interval`` and answers the first
    ``answer`` heartbeats, then none (a paused control plane: the connection stays open)."""

    interval: float = 0.5
    answer: int = 0
    hellos: list[pb.Hello] = field(default_factory=list)
    last_word: float = 0.0  # time.monotonic() of the last message it sent

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.ServerMessage]:
        first = await request_iterator.__anext__()
        self.hellos.append(first.hello)
        self.last_word = time.monotonic()
        yield pb.ServerMessage(
            welcome=pb.Welcome(
                cluster_id="c", epoch=1, node_state="approved", heartbeat_interval_s=self.interval
            )
        )
        answered = 0
        async for msg in request_iterator:
            if msg.WhichOneof("msg") == "heartbeat" and answered < self.answer:
                answered += 1
                self.last_word = time.monotonic()
                yield pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(seq=msg.heartbeat.seq))


def test_a_control_plane_that_stops_answering_is_left_after_two_heartbeat_intervals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Answered heartbeats keep the stream; once they go unanswered the stream ends when
    the silence reaches two intervals, not at the first heartbeat after three (up to four
    intervals), which made agents reach a paused leader's successor late."""
    monkeypatch.setattr(stream, "SILENCE_FLOOR", 0.0)
    pki_dir = tmp_path / "pki"
    servicer = Answering(interval=0.5, answer=3)
    ended: list[float] = []

    async def main() -> None:
        server, port = await _serve(pki_dir, servicer)
        client = _client(pki_dir, tmp_path, port)
        client.on_state = lambda state, _server: (
            ended.append(time.monotonic()) if state == "disconnected" else None
        )
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: ended, "the silent stream left", timeout=10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)

    asyncio.run(main())
    assert stream.silence_limit(0.5) == 1.0
    assert stream.silence_limit(5.0) == 10.0  # the default interval: 10 s, not 15-20 s
    silence = ended[0] - servicer.last_word
    assert 1.0 - 0.05 <= silence < 1.4, silence  # at the limit, not at a heartbeat after it


def test_the_floor_keeps_a_short_interval_from_judging_too_soon() -> None:
    assert stream.silence_limit(0.5) == stream.SILENCE_FLOOR == 3.0
    assert stream.silence_limit(1.0) == 3.0
    assert stream.silence_limit(2.0) == 4.0


def test_a_standby_naming_the_leader_that_fell_silent_is_not_followed_back_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The leader falls silent (paused); the standby dialled next still names it (its lease
    has not lapsed): the agent tries the next control plane rather than the paused one (a
    connection timeout's worth of seconds), and reaches the new leader there."""
    monkeypatch.setattr(stream, "SILENCE_FLOOR", 0.0)
    pki_dir = tmp_path / "pki"
    silent = Answering(interval=0.3)
    standby = Scripted([])
    successor = Scripted([_welcome(epoch=2)], hold=5.0)

    async def main() -> tuple[list[str], str]:
        servers = [await _serve(pki_dir, s) for s in (silent, standby, successor)]
        a, b, c = (f"127.0.0.1:{port}" for _server, port in servers)
        standby.script = [pb.ServerMessage(refuse=pb.Refuse(leader=a, message="a standby"))]
        client, welcomed = _agent(pki_dir, tmp_path, (a, b, c))
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: len(welcomed) >= 2, "the successor's welcome")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            for server, _port in servers:
                await server.stop(None)
        return [w.replace(a, "a").replace(c, "c") for w in welcomed], b

    with caplog.at_level(logging.INFO, logger="llmgw.agent.stream"):
        welcomed, b = asyncio.run(main())
    assert welcomed[:2] == ["a", "c"]
    assert len(silent.hellos) == 1 and len(standby.hellos) == 1
    skipped = _lines(
        caplog,
        "control plane is a standby naming the leader that fell silent (its lease not lapsed "
        "yet); trying the others first",
    )
    assert [r.fields["server"] for r in skipped] == [b]  # type: ignore[attr-defined]
    reasons = [r.fields["reason"] for r in _lines(caplog, RECONNECTING)]  # type: ignore[attr-defined]
    assert "sent nothing for" in reasons[0] and "paused or cut-off" in reasons[0]


# ---------------------------------------------------------------- why a stream ended, in words


def _unavailable(details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details
    )


@pytest.mark.parametrize("details", ["Socket closed", "recvmsg:Connection reset by peer"])
def test_a_connection_lost_after_its_handshake_blames_the_connection(details: str) -> None:
    reason = stream._describe_rpc_error(_unavailable(details), "cp1:7443", established=True)
    assert reason == (
        f"the connection to cp1:7443 was lost ({details}): the control plane stopped or the "
        "network between failed; looking for the leader among the control planes"
    )
    assert "certificate" not in reason


def test_a_connection_closed_during_the_handshake_still_points_at_the_certificate() -> None:
    reason = stream._describe_rpc_error(
        _unavailable("Socket closed"), "cp1:7443", established=False
    )
    assert "most likely refused this node's certificate" in reason
    assert "tls.cert" in reason


class _Cutter:
    """A TCP relay to 127.0.0.1:*port* whose connections :meth:`cut` resets (RST, as the
    kernel does for a killed process's sockets)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self.server.close()


def test_a_leader_that_goes_away_mid_stream_is_not_blamed_on_the_certificate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A real stream whose connection is reset under it (a killed leader): the reason logged
    says the connection was lost, never the node's certificate."""
    pki_dir = tmp_path / "pki"
    servicer = Scripted([_welcome()], hold=30.0)

    async def main() -> None:
        server, port = await _serve(pki_dir, servicer)
        cutter = _Cutter(port)
        relay = await cutter.start()
        client, welcomed = _agent(pki_dir, tmp_path, (f"127.0.0.1:{relay}",))
        task = asyncio.create_task(client.run())
        try:
            await _until(lambda: welcomed, "the welcome")
            cutter.cut()
            await _until(lambda: _lines(caplog, RECONNECTING), "the stream's end")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)

    with caplog.at_level(logging.INFO, logger="llmgw.agent.stream"):
        asyncio.run(main())
    reason = _lines(caplog, RECONNECTING)[0].fields["reason"]  # type: ignore[attr-defined]
    assert "was lost" in reason and "certificate" not in reason, reason
