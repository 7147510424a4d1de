"""llmgw.agent.stream against a control plane that refuses it or is far ahead of it: the
refusal is logged in the control plane's words and retried with backoff, never a crash; an
agent too far behind says so once connected; an order the node refuses is answered with
the reason."""

from __future__ import annotations

import asyncio
import logging
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
from llmgw.agent.shards import ShardManager
from llmgw.agent.stream import Backoff, Credentials, StreamClient
from llmgw.contracts.ports import PortRange
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc

# What a control plane at 0.1.0 says to an agent at 0.2.0 (llmgw.server.stream.version_refusal).
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
        servers=(f"127.0.0.1:{port}",),
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
