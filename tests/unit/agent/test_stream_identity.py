"""The agent's stream talks only to the control plane, whatever the address it dials answers.

A node enrolled under the control plane's host name holds a certificate from the cluster CA
whose SAN is that very name. Here such a certificate (issued directly, as an attacker who holds
one would have it) serves a real gRPC ``Connect`` over real TLS at the address the agent dials,
and offers everything a control plane may send: a Welcome with an epoch that would fence off
the real leader, a certificate renewal, an order. None of it may reach the agent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import pytest

from llmgw import netaddr, pki
from llmgw.agent.oplog import OperationLog
from llmgw.agent.servers import KnownServers
from llmgw.agent.stream import Credentials, StreamClient
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc

CP_HOST = "cp.example"  # the control plane's host name, which the agent dials
EVIL_EPOCH = 999


@dataclass
class Peer:
    """A gRPC ``Connect`` server that says everything a control plane says."""

    identity: pki.Identity
    port: int = 0
    hellos: list[pb.Hello] = field(default_factory=list)

    async def serve(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        pb_grpc.add_ControlPlaneServicer_to_server(_Servicer(self), server)
        creds = grpc.ssl_server_credentials(
            [(self.identity.key.read_bytes(), self.identity.cert.read_bytes())],
            root_certificates=self.identity.ca.read_bytes(),
            require_client_auth=True,
        )
        self.port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        return server


class _Servicer(pb_grpc.ControlPlaneServicer):
    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    async def Connect(
        self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
    ) -> AsyncIterator[pb.ServerMessage]:
        first = await request_iterator.__anext__()
        self.peer.hellos.append(first.hello)
        yield pb.ServerMessage(
            welcome=pb.Welcome(cluster_id="c", epoch=EVIL_EPOCH, node_state="approved")
        )
        yield pb.ServerMessage(
            renew_certificate=pb.RenewCertificate(certificate_pem="x", ca_pem="y")
        )
        yield pb.ServerMessage(
            start_shard=pb.StartShard(
                meta=pb.OrderMeta(epoch=EVIL_EPOCH + 1, op_id="op-1"), shard_id="s-1"
            )
        )
        await asyncio.sleep(0.2)  # let the agent take the orders before the stream ends


@dataclass
class Agent:
    client: StreamClient
    oplog: OperationLog
    renewals: list[pb.RenewCertificate]
    started: list[object]


@pytest.fixture
def ca(tmp_path: Path) -> pki.Authority:
    return pki.init_ca(tmp_path / "ca")


@pytest.fixture
def dns_points_at_the_peer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``CP_HOST:PORT`` reaches 127.0.0.1:PORT with the authority the agent would have used:
    what a node that answers for the control plane's name (DNS, ARP, a stale record) gets."""
    real = grpc.aio.secure_channel

    def secure_channel(target: str, creds: Any, options: Any = None) -> Any:
        host, _, port = target.rpartition(":")
        assert host == CP_HOST, target
        opts = [*(options or []), ("grpc.default_authority", CP_HOST)]
        return real(f"127.0.0.1:{port}", creds, options=opts)

    monkeypatch.setattr(grpc.aio, "secure_channel", secure_channel)
    yield


def make_agent(ca: pki.Authority, tmp_path: Path) -> Agent:
    ident = pki.issue_node_cert(ca, "gpu-1", tmp_path / "agent")
    oplog = OperationLog(tmp_path / "agent" / "oplog.json")
    renewals: list[pb.RenewCertificate] = []
    started: list[object] = []

    async def start(spec: object) -> None:
        started.append(spec)

    shards = SimpleNamespace(snapshot=list, start=start)
    client = StreamClient(
        node_id="gpu-1",
        servers=KnownServers((f"{CP_HOST}:0",), tmp_path / "agent"),
        credentials=lambda: Credentials(
            cert=ident.cert.read_bytes(), key=ident.key.read_bytes(), ca=ident.ca.read_bytes()
        ),
        shards=cast(Any, shards),
        oplog=oplog,
        inventory=pb.Inventory,
        dataplane_addr=lambda server: "127.0.0.1:9443",
        on_renewal_answer=renewals.append,
    )
    return Agent(client, oplog, renewals, started)


async def _one_session(agent: Agent, peer: Peer) -> BaseException | None:
    server = await peer.serve()
    try:
        await asyncio.wait_for(agent.client._session(f"{CP_HOST}:{peer.port}"), 20)
        await asyncio.sleep(0.1)  # orders run as tasks
        return None
    except grpc.aio.AioRpcError as exc:
        return exc
    finally:
        await agent.client.close()
        await server.stop(None)


def test_the_control_plane_is_believed(
    ca: pki.Authority, tmp_path: Path, dns_points_at_the_peer: None
) -> None:
    """The positive control: the real control plane's certificate passes, and its epoch, its
    renewal answer and its order all reach the agent, which is what the refusal below stops."""
    _, server_id, _ = pki.ensure_server_identity(ca.directory, hosts=[CP_HOST])
    agent = make_agent(ca, tmp_path)
    assert asyncio.run(_one_session(agent, Peer(server_id))) is None
    assert OperationLog(agent.oplog.path).max_epoch == EVIL_EPOCH + 1
    assert len(agent.renewals) == 1
    assert len(agent.started) == 1


def test_a_node_certificate_for_the_control_plane_host_is_refused(
    ca: pki.Authority, tmp_path: Path, dns_points_at_the_peer: None
) -> None:
    impostor = pki.issue_node_cert(ca, CP_HOST, tmp_path / "impostor")
    agent = make_agent(ca, tmp_path)
    peer = Peer(impostor)
    error = asyncio.run(_one_session(agent, peer))
    assert isinstance(error, grpc.aio.AioRpcError), error
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    # Nothing got through, not even our Hello, and no epoch was persisted: the handshake
    # failed before a message was read.
    assert peer.hellos == []
    assert agent.oplog.max_epoch == 0
    assert not agent.oplog.path.exists()
    # Renewal has no connection of its own: its answer is a message on this stream, so the
    # stream's check is the renewal's check, and an impostor cannot hand out certificates.
    assert agent.renewals == []
    assert agent.started == []


def test_the_refusal_is_one_clear_line(
    ca: pki.Authority,
    tmp_path: Path,
    dns_points_at_the_peer: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent = make_agent(ca, tmp_path)
    peer = Peer(pki.issue_node_cert(ca, CP_HOST, tmp_path / "impostor"))

    async def main() -> None:
        server = await peer.serve()
        agent.client.servers = KnownServers((f"{CP_HOST}:{peer.port}",), tmp_path / "agent")
        task = asyncio.create_task(agent.client.run())
        try:
            for _ in range(200):
                if _reconnect_lines(caplog):
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)

    with caplog.at_level(logging.WARNING, logger="llmgw.agent.stream"):
        asyncio.run(main())
    lines = _reconnect_lines(caplog)
    assert lines, caplog.text
    reason = lines[0].fields["reason"]  # type: ignore[attr-defined]
    assert reason.startswith(f"{CP_HOST}:{peer.port} is not the control plane: ")
    assert netaddr.CONTROL_PLANE_NAME in reason
    assert reason.endswith("check that the address in agent.yaml is the control plane's")
    assert not agent.oplog.path.exists()


def _reconnect_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.getMessage() == "control plane stream ended; reconnecting"
    ]
