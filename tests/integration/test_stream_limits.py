"""A node's stream is bounded (issue 11, point 6): what a pending node may send, size and rate
limits on every message, events capped, renewal only for approved nodes and revoking the
certificate it replaces.

A real control plane; the node enrols for real (the join library against the enrolment
endpoint) and then speaks the Connect stream itself, as a hostile agent would.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import pki
from llmgw.agent.join import join
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.server.fleet.intake import HELLO_RATE
from tests.integration.harness import Server, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MB = 1024 * 1024
# What 30 messages of 3 MB may add to the database (and its WAL) at most: the issue measured
# 92 MB before the limits.
DB_BOUND = 4 * MB
EVENTS_BOUND = 256 * 1024


@dataclass
class RawNode:
    """A node enrolled for real whose stream the test speaks itself."""

    id: str
    server: Server
    state: Path
    fingerprint: str

    @property
    def cert(self) -> bytes:
        return (self.state / "node.crt").read_bytes()

    @property
    def key(self) -> bytes:
        return (self.state / "node.key").read_bytes()

    def hello(self, inventory: pb.Inventory | None = None) -> pb.Hello:
        return pb.Hello(
            node_id=self.id,
            agent_version="0.1.0",
            dataplane_addr="127.0.0.1:1",
            inventory=inventory or pb.Inventory(hostname=self.id, arch="x86_64", cpus=4),
        )

    @asynccontextmanager
    async def stream(
        self,
        hello: pb.Hello | None = None,
        *,
        cert: bytes | None = None,
        key: bytes | None = None,
    ) -> AsyncIterator[grpc.aio.StreamStreamCall[pb.AgentMessage, pb.ServerMessage]]:
        creds = grpc.ssl_channel_credentials(
            root_certificates=(self.state / "ca.crt").read_bytes(),
            private_key=key or self.key,
            certificate_chain=cert or self.cert,
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{self.server.grpc_port}", creds) as ch:
            call = pb_grpc.ControlPlaneStub(ch).Connect()
            await call.write(pb.AgentMessage(hello=hello or self.hello()))
            yield call
            call.cancel()


def enrol(server: Server, tmp: Path, node_id: str) -> RawNode:
    token = server.api("POST", "/api/join-tokens", {"node": node_id})
    state = tmp / node_id / "state"
    result = join(
        node_id=node_id,
        enroll_url=token["enroll_url"],
        ca_hash=token["ca_hash"],
        token=token["token"],
        config_path=tmp / node_id / "agent.yaml",
        state_dir=state,
    )
    assert result.state == "pending"
    return RawNode(node_id, server, state, result.fingerprint)


async def welcomed(call: Any) -> pb.Welcome:
    msg = await asyncio.wait_for(call.read(), 10)
    assert isinstance(msg, pb.ServerMessage) and msg.WhichOneof("msg") == "welcome", msg
    return msg.welcome


async def next_of(call: Any, kind: str, timeout: float = 10.0) -> Any:
    async def read() -> Any:
        while True:
            msg = await call.read()
            assert msg is not grpc.aio.EOF, f"the stream ended before a {kind}"
            if msg.WhichOneof("msg") == kind:
                return getattr(msg, kind)

    return await asyncio.wait_for(read(), timeout)


async def ended_with(call: Any, timeout: float = 10.0) -> grpc.aio.AioRpcError:
    """Read until the server ends the stream; the error it ended with."""

    async def drain() -> None:
        while await call.read() is not grpc.aio.EOF:
            pass

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await asyncio.wait_for(drain(), timeout)
    return caught.value


async def reconnect_flood(
    node: RawNode, msg: pb.AgentMessage | None, *, hello: pb.Hello | None = None, times: int = 30
) -> Counter[str]:
    """Open ``times`` streams in a row, sending ``msg`` on each (it must end the stream);
    count how each went: "cut" (ended after msg), "welcomed" (no msg), "refused" (at the
    Hello, for reconnecting too often)."""
    outcomes: Counter[str] = Counter()
    for _ in range(times):
        async with node.stream(hello) as call:
            try:
                await welcomed(call)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                assert f"node {node.id} opened over {HELLO_RATE[0]:g} streams in a row" in (
                    exc.details() or ""
                )
                outcomes["refused"] += 1
                continue
            if msg is None:
                outcomes["welcomed"] += 1
                continue
            await call.write(msg)
            assert (await ended_with(call)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            outcomes["cut"] += 1
    return outcomes


def db_bytes(server: Server) -> int:
    db = server.state_dir / "llmgw.db"
    return sum(p.stat().st_size for p in (db, db.with_name("llmgw.db-wal")) if p.exists())


def events_body(server: Server) -> bytes:
    req = urllib.request.Request(
        server.url + "/api/events?limit=1000",
        headers={"Authorization": f"Bearer {server.admin_token}"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        return bytes(resp.read())


def sqlite_inventory(server: Server, node_id: str) -> dict[str, Any]:
    with sqlite3.connect(f"file:{server.state_dir / 'llmgw.db'}?mode=ro", uri=True) as db:
        row = db.execute("SELECT inventory FROM nodes WHERE id = ?", (node_id,)).fetchone()
    inventory: dict[str, Any] = json.loads(row[0])
    return inventory


def node_entry(server: Server, node_id: str) -> dict[str, Any]:
    return next(n for n in server.nodes() if n["id"] == node_id)


def approve(server: Server, node: RawNode) -> None:
    server.api("POST", f"/api/nodes/{node.id}/approve", {"fingerprint": node.fingerprint})


def huge_inventory(size: int, node_id: str = "x") -> pb.Inventory:
    return pb.Inventory(hostname=node_id, warnings=["w" * 1000] * (size // 1003))


def csr_for(node_id: str) -> tuple[Any, str]:
    key = pki.new_private_key()
    csr = pki.make_csr(key, node_id)
    return key, csr.public_bytes(serialization.Encoding.PEM).decode()


def assert_events_bounded(server: Server) -> list[dict[str, Any]]:
    body = events_body(server)
    assert len(body) < EVENTS_BOUND, f"/api/events returned {len(body)} bytes"
    events: list[dict[str, Any]] = json.loads(body)
    assert all(len(e["message"]) <= 1000 for e in events)
    return events


# --------------------------------------------------------------------------- pending node


def test_a_pending_node_flooding_3mb_inventories_grows_nothing(
    server: Server, tmp_path: Path
) -> None:
    node = enrol(server, tmp_path, "gpu-p")
    other = enrol(server, tmp_path, "gpu-p2")

    async def attack() -> None:
        async with node.stream() as call:
            await welcomed(call)
        async with other.stream() as call:
            await welcomed(call)
        before = db_bytes(server)
        # 30 inventories of 3 MB, reconnecting for each as a hostile agent would: each ends
        # its stream (over the transport limit), and once the node has reconnected too
        # often its streams are refused at the Hello.
        big = pb.AgentMessage(inventory=huge_inventory(3 * MB))
        outcomes = await reconnect_flood(node, big)
        assert outcomes["cut"] >= 5 and outcomes["refused"] >= 5, outcomes
        # Another pending node: 30 inventories just under the per-kind limit are kept in
        # memory only, never stored...
        async with other.stream() as call:
            await welcomed(call)
            for _ in range(30):
                await call.write(pb.AgentMessage(inventory=huge_inventory(500 * 1024)))
            await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1)))
            await asyncio.sleep(0.5)
            assert node_entry(server, "gpu-p2")["connected"]
        # ...and of 30 Hellos of nearly 1 MB, only a bounded summary is stored.
        hello = other.hello(huge_inventory(900 * 1024, other.id))
        outcomes = await reconnect_flood(other, None, hello=hello)
        assert outcomes["welcomed"] >= 5, outcomes
        grown = db_bytes(server) - before
        assert grown < DB_BOUND, f"the database grew by {grown} bytes"

    asyncio.run(attack())
    assert server.proc.poll() is None
    assert {node_entry(server, n)["state"] for n in ("gpu-p", "gpu-p2")} == {"pending"}
    events = assert_events_bounded(server)
    assert not [e for e in events if e["kind"] == "inventory_changed"]
    # What is stored of it is the summary: a few warnings, cut short.
    stored = sqlite_inventory(server, "gpu-p2")
    assert len(json.dumps(stored)) < 16 * 1024
    assert 1 <= len(stored["warnings"]) and all(len(w) <= 256 for w in stored["warnings"])


def test_a_pending_nodes_inventory_is_stored_once_it_is_approved(
    server: Server, tmp_path: Path
) -> None:
    node = enrol(server, tmp_path, "gpu-q")

    async def scenario() -> None:
        async with node.stream() as call:
            await welcomed(call)
            changed = pb.Inventory(hostname="gpu-q", cpus=96, engines=["sim", "vllm"])
            await call.write(pb.AgentMessage(inventory=changed))
            await asyncio.sleep(0.5)
            # Not stored while pending...
            assert node_entry(server, "gpu-q")["cpus"] == 4
            approve(server, node)
            assert (await next_of(call, "node_state")).state == "approved"
            # ...and stored when approved.
            entry = wait_for(
                lambda: (e := node_entry(server, "gpu-q"))["cpus"] == 96 and e,
                timeout=10,
                what="the held inventory stored",
            )
            assert entry["engines"] == ["sim", "vllm"]

    asyncio.run(scenario())


def test_a_pending_nodes_statuses_are_dropped_and_a_flood_closes_its_stream(
    server: Server, tmp_path: Path
) -> None:
    node = enrol(server, tmp_path, "gpu-r")

    async def scenario() -> None:
        async with node.stream() as call:
            await welcomed(call)
            before = db_bytes(server)
            status = pb.ShardStatus(shard_id="s", state=pb.SHARD_FAILED, reason="r" * 30_000)
            for _ in range(2001):
                await call.write(pb.AgentMessage(shard_status=status))
            error = await ended_with(call)
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "node gpu-r sent over 2000 messages" in (error.details() or "")
            assert db_bytes(server) - before < DB_BOUND

    asyncio.run(scenario())
    events = assert_events_bounded(server)
    closed = [e for e in events if e["kind"] == "stream_closed" and e["subject"] == "gpu-r"]
    assert closed and "dropped" in closed[0]["message"]
    assert not [e for e in events if e["kind"] == "shard_failed"]
    # One log line for the drops, not one per message.
    assert server.log().count("dropped messages from a node") <= 2


# --------------------------------------------------------------------------- approved node


def test_an_approved_node_flooding_inventories_and_statuses_stays_bounded(
    server: Server, tmp_path: Path
) -> None:
    node = enrol(server, tmp_path, "gpu-a")

    async def scenario() -> None:
        async with node.stream() as call:
            await welcomed(call)
            approve(server, node)
            await next_of(call, "node_state")
            before = db_bytes(server)
            for i in range(30):
                inv = huge_inventory(400 * 1024, f"gpu-a-{i}")
                await call.write(pb.AgentMessage(inventory=inv))
            for _ in range(300):
                error = "e" * 60_000
                await call.write(
                    pb.AgentMessage(op_result=pb.OperationResult(op_id="x", error=error))
                )
                await call.write(
                    pb.AgentMessage(
                        update_status=pb.UpdateStatus(op_id="u", state="failed", message=error)
                    )
                )
            # Still served: a heartbeat goes through and the node stays connected.
            await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1)))
            await asyncio.sleep(1.0)
            assert node_entry(server, "gpu-a")["connected"]
        # Statuses of 3 MB, reconnecting for each: cut at the transport, then refused.
        status = pb.ShardStatus(shard_id="s", state=pb.SHARD_FAILED, reason="r" * 3 * MB)
        outcomes = await reconnect_flood(node, pb.AgentMessage(shard_status=status))
        assert outcomes["cut"] >= 5 and outcomes["refused"] >= 5, outcomes
        grown = db_bytes(server) - before
        assert grown < DB_BOUND, f"the database grew by {grown} bytes"

    asyncio.run(scenario())
    assert server.proc.poll() is None
    events = assert_events_bounded(server)
    inventories = [e for e in events if e["kind"] == "inventory_changed"]
    assert 1 <= len(inventories) <= 6, len(inventories)  # the burst, not all 30
    assert "dropped messages from a node" in server.log()


def test_a_revoked_node_retrying_cannot_flush_the_event_log(server: Server, tmp_path: Path) -> None:
    node = enrol(server, tmp_path, "gpu-v")
    server.api("POST", "/api/nodes/gpu-v/revoke")

    async def retry() -> None:
        for _ in range(30):
            async with node.stream() as call:
                error = await ended_with(call)
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "was revoked" in (error.details() or "")

    asyncio.run(retry())
    events = assert_events_bounded(server)
    refused = [e for e in events if e["kind"] == "stream_refused" and e["subject"] == "gpu-v"]
    assert 1 <= len(refused) <= 6, len(refused)
    assert server.log().count("refused a stream") <= 6


# --------------------------------------------------------------------------- renewal


def test_renewal_is_refused_to_a_pending_node(server: Server, tmp_path: Path) -> None:
    node = enrol(server, tmp_path, "gpu-s")
    serial = pki.serial_hex(x509.load_pem_x509_certificate(node.cert))

    async def scenario() -> None:
        async with node.stream() as call:
            await welcomed(call)
            _key, csr = csr_for(node.id)
            await call.write(pb.AgentMessage(cert_request=pb.CertificateRequest(csr_pem=csr)))
            answer = await next_of(call, "renew_certificate")
            assert not answer.certificate_pem
            assert "gpu-s is pending" in answer.error
            assert f"llmgw ctl approve gpu-s --fingerprint {node.fingerprint}" in answer.error

    asyncio.run(scenario())
    assert node_entry(server, "gpu-s")["cert_serial"] == serial
    assert not [e for e in assert_events_bounded(server) if e["kind"] == "cert_renewed"]


def test_a_renewal_revokes_the_certificate_it_replaces(server: Server, tmp_path: Path) -> None:
    node = enrol(server, tmp_path, "gpu-t")
    old_cert, old_key = node.cert, node.key
    old_serial = pki.serial_hex(x509.load_pem_x509_certificate(old_cert))

    async def scenario() -> tuple[bytes, bytes]:
        async with node.stream() as call:
            await welcomed(call)
            approve(server, node)
            await next_of(call, "node_state")
            key, csr = csr_for(node.id)
            await call.write(pb.AgentMessage(cert_request=pb.CertificateRequest(csr_pem=csr)))
            answer = await next_of(call, "renew_certificate")
            assert not answer.error, answer.error
            # The stream the renewal came on stays up.
            await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1)))
            await asyncio.sleep(0.3)
            assert node_entry(server, "gpu-t")["connected"]
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        return answer.certificate_pem.encode(), key_pem

    new_cert, new_key = asyncio.run(scenario())
    new_serial = pki.serial_hex(x509.load_pem_x509_certificate(new_cert))
    assert new_serial != old_serial
    assert node_entry(server, "gpu-t")["cert_serial"] == new_serial

    async def reconnect() -> None:
        # The old certificate is refused on the stream, naming the way back...
        async with node.stream(cert=old_cert, key=old_key) as call:
            error = await ended_with(call)
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"certificate {old_serial} of node gpu-t was replaced by a renewal" in (
            error.details() or ""
        )
        assert "join-command --rekey gpu-t" in (error.details() or "")
        # ...and the renewed one works, the node still approved.
        async with node.stream(cert=new_cert, key=new_key) as call:
            welcome = await welcomed(call)
            assert welcome.node_state == "approved"

    asyncio.run(reconnect())
    renewed = [e for e in assert_events_bounded(server) if e["kind"] == "cert_renewed"]
    assert renewed and f"replaced {old_serial}" in renewed[0]["message"]
