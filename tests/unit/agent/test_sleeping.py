"""SleepShard and WakeShard on the node: real ``sim`` engines put to sleep and woken, their
states reported and recorded, adopted asleep by the next agent, and the refusals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import grpc
import pytest

from llmgw import pki
from llmgw.agent.oplog import OperationLog
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.servers import KnownServers
from llmgw.agent.shards import Shard, ShardManager, ShardSpec, ShardState
from llmgw.agent.stream import Backoff, Credentials, StreamClient, shard_status
from llmgw.errors import ShardError
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc

WAIT_S = 30.0

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """The on_status callback: every state a shard was reported in, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self._changed = asyncio.Event()

    def __call__(self, shard: Shard) -> None:
        self.events.append((shard.shard_id, shard.state))
        self._changed.set()

    def states(self, shard_id: str) -> list[str]:
        return [state for sid, state in self.events if sid == shard_id]

    async def wait_for(self, shard_id: str, state: str) -> None:
        async def scan() -> None:
            while (shard_id, state) not in self.events:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(scan(), WAIT_S)


def run_with_manager(
    state_dir: Path, body: Callable[[ShardManager, Recorder], Awaitable[None]]
) -> None:
    async def main() -> None:
        recorder = Recorder()
        manager = ShardManager(state_dir, ProcessRuntime(), recorder, startup_timeout=WAIT_S)
        await manager.open()
        try:
            await body(manager, recorder)
        finally:
            await manager.stop_all(grace=5.0)
            await manager.close()

    asyncio.run(main())


def records(state_dir: Path) -> dict[str, Any]:
    return dict(json.loads((state_dir / "shards.json").read_text()))


SLEEPY = ("--enable-sleep-mode",)


def sleepy(shard_id: str = "s1", **kw: object) -> ShardSpec:
    return ShardSpec(
        shard_id=shard_id,
        replica_id="r1",
        model="sim-model",
        engine="sim",
        params={"wake_seconds": "0.3", "sleep_host_mib": "256", "sleep_seconds": "0.05"},
        extra_args=SLEEPY,
        **kw,  # type: ignore[arg-type]
    )


async def chat(port: int) -> int:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp,
    ):
        return resp.status


def test_sleep_and_wake_report_each_state_with_timings(tmp_path: Path) -> None:
    async def body(manager: ShardManager, rec: Recorder) -> None:
        shard = await manager.start(sleepy())
        await rec.wait_for("s1", ShardState.READY)
        mark = len(rec.events)
        await manager.sleep("s1", 1)
        assert rec.states("s1")[-2:] == [ShardState.FALLING_ASLEEP, ShardState.ASLEEP]
        assert shard.sleep_level == 1 and shard.host_memory_mib == 256
        assert manager.ready_port("s1") is None  # the data plane forwards nothing to it
        assert await chat(shard.port) == 503
        assert records(tmp_path)["s1"]["state"] == "asleep"
        assert records(tmp_path)["s1"]["sleep_level"] == 1
        status = shard_status(shard)
        assert status.state == pb.SHARD_ASLEEP
        assert (status.sleep_level, status.host_memory_mib) == (1, 256)
        # Asleep again at the same level: nothing to do, nothing reported.
        await manager.sleep("s1", 1)
        assert len(rec.events) == mark + 2
        began = time.monotonic()
        await manager.wake("s1")
        assert time.monotonic() - began >= 0.3  # the sim's wake cost
        assert rec.states("s1")[-2:] == [ShardState.WAKING, ShardState.READY]
        assert shard.transition_ms >= 300
        assert shard_status(shard).transition_ms == shard.transition_ms
        assert (shard.sleep_level, shard.host_memory_mib) == (0, 0)
        assert manager.ready_port("s1") == shard.port
        assert await chat(shard.port) == 200
        await manager.wake("s1")  # awake already: a no-op
        assert rec.states("s1")[-1] == ShardState.READY

    run_with_manager(tmp_path, body)


def test_a_level_2_wake_reloads_the_weights(tmp_path: Path) -> None:
    async def body(manager: ShardManager, rec: Recorder) -> None:
        order = sleepy()
        order = ShardSpec(**{**order.__dict__, "params": {"wake_seconds_level2": "0.4"}})
        shard = await manager.start(order)
        await rec.wait_for("s1", ShardState.READY)
        await manager.sleep("s1", 2)
        assert shard.host_memory_mib == 0  # level 2 keeps no weights
        await manager.wake("s1")
        assert shard.transition_ms >= 400
        assert await chat(shard.port) == 200

    run_with_manager(tmp_path, body)


def test_refusals_name_the_reason(tmp_path: Path) -> None:
    async def body(manager: ShardManager, rec: Recorder) -> None:
        with pytest.raises(ShardError, match="shard nope is not running on this node"):
            await manager.sleep("nope", 1)
        plain = ShardSpec(shard_id="p", replica_id="r", model="m", engine="sim")
        await manager.start(plain)
        await manager.start(sleepy("s1"))
        await rec.wait_for("s1", ShardState.READY)
        with pytest.raises(ShardError, match="engine sim sleeps at level 1 or 2, not 3"):
            await manager.sleep("s1", 3)
        await rec.wait_for("p", ShardState.READY)
        # A sim started without the sleep flag has no sleep routes: the engine's answer says so
        # and the shard stays ready.
        with pytest.raises(ShardError, match="POST /sleep answered 404"):
            await manager.sleep("p", 1)
        assert manager.get("p").state == ShardState.READY  # type: ignore[union-attr]

    run_with_manager(tmp_path, body)


def test_an_engine_that_cannot_sleep_and_a_shard_not_ready_are_refused(tmp_path: Path) -> None:
    from llmgw.agent.sleeping import put_to_sleep, wake

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            llama = Shard(ShardSpec("l", "r", "m", "llamacpp"), state=ShardState.READY)
            with pytest.raises(ShardError, match="engine llamacpp cannot sleep"):
                await put_to_sleep(llama, 1, session, lambda s: None)
            worker = Shard(ShardSpec("w", "r", "m", "sim", rank=1, nodes=2))
            with pytest.raises(ShardError, match="only rank 0's engine sleeps"):
                await put_to_sleep(worker, 1, session, lambda s: None)
            starting = Shard(ShardSpec("s", "r", "m", "sim"))
            with pytest.raises(ShardError, match="shard s is starting, not ready"):
                await put_to_sleep(starting, 1, session, lambda s: None)
            with pytest.raises(ShardError, match="shard s is starting, not asleep"):
                await wake(starting, session, lambda s: None, 5.0)

    asyncio.run(main())


def test_a_new_agent_adopts_a_sleeping_engine_asleep(tmp_path: Path) -> None:
    async def first() -> int:
        rec = Recorder()
        manager = ShardManager(tmp_path, ProcessRuntime(), rec, startup_timeout=WAIT_S)
        await manager.open()
        shard = await manager.start(sleepy())
        await rec.wait_for("s1", ShardState.READY)
        await manager.sleep("s1", 1)
        await manager.close()  # the engine outlives the agent
        return shard.pid

    async def second() -> None:
        rec = Recorder()
        manager = ShardManager(tmp_path, ProcessRuntime(), rec, startup_timeout=WAIT_S)
        await manager.open()
        try:
            adopted, dead = await manager.adopt_all()
            assert [s.shard_id for s in adopted] == ["s1"] and dead == []
            await rec.wait_for("s1", ShardState.ASLEEP)
            shard = adopted[0]
            assert (shard.sleep_level, shard.host_memory_mib) == (1, 256)
            assert manager.ready_port("s1") is None
            await manager.wake("s1")
            assert manager.ready_port("s1") == shard.port
        finally:
            await manager.stop_all(grace=5.0)
            await manager.close()

    pid = asyncio.run(first())
    try:
        asyncio.run(second())
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


# ------------------------------------------------------------------ the orders on the stream


def test_sleep_and_wake_orders_are_answered_with_the_reason_the_node_refuses(
    tmp_path: Path,
) -> None:
    class Orders(pb_grpc.ControlPlaneServicer):  # type: ignore[misc]
        def __init__(self) -> None:
            self.results: list[pb.OperationResult] = []
            self.done = asyncio.Event()

        async def Connect(
            self, request_iterator: AsyncIterator[pb.AgentMessage], context: Any
        ) -> AsyncIterator[pb.ServerMessage]:
            await request_iterator.__anext__()
            yield pb.ServerMessage(
                welcome=pb.Welcome(cluster_id="c", epoch=1, node_state="approved")
            )
            meta = pb.OrderMeta(epoch=1, op_id="op-s")
            yield pb.ServerMessage(sleep_shard=pb.SleepShard(meta=meta, shard_id="gone", level=1))
            meta = pb.OrderMeta(epoch=1, op_id="op-w")
            yield pb.ServerMessage(wake_shard=pb.WakeShard(meta=meta, shard_id="gone"))
            async for msg in request_iterator:
                if msg.WhichOneof("msg") == "op_result":
                    self.results.append(msg.op_result)
                    if len(self.results) == 2:
                        self.done.set()
                        break
            await asyncio.sleep(0.2)

    servicer = Orders()

    async def main() -> None:
        server, port = await _serve(tmp_path / "pki", servicer)
        client = _client(tmp_path / "pki", tmp_path, port)
        manager = ShardManager(tmp_path / "state", ProcessRuntime(), lambda s: None)
        await manager.open()
        client.shards = manager
        task = asyncio.create_task(client.run())
        try:
            await asyncio.wait_for(servicer.done.wait(), 10)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await server.stop(None)
            await manager.close()

    asyncio.run(main())
    got = sorted((r.op_id, r.ok, r.error) for r in servicer.results)
    assert got == [
        ("op-s", False, "shard gone is not running on this node"),
        ("op-w", False, "shard gone is not running on this node"),
    ]


async def _serve(pki_dir: Path, servicer: pb_grpc.ControlPlaneServicer) -> tuple[Any, int]:
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


@pytest.mark.parametrize(
    ("recorded", "engine_sleeps", "expected"),
    [
        ("ready", True, ShardState.READY),  # no order carried out: not even asked
        ("asleep", True, ShardState.ASLEEP),
        ("falling_asleep", False, ShardState.READY),  # the agent died as the sleep failed
        ("waking", False, ShardState.READY),  # ... or as the wake succeeded
    ],
)
def test_an_adopted_engine_is_asleep_only_when_the_record_and_the_engine_agree(
    recorded: str, engine_sleeps: bool, expected: ShardState
) -> None:
    from llmgw.agent.sleeping import adopted_state
    from llmgw.sim.config import SimConfig
    from tests.unit.sim.running import running

    with running(SimConfig(port=0, sleep_mode=True, sleep_host_mib=64)) as url:
        port = int(url.rsplit(":", 1)[1])

        async def main() -> ShardState:
            async with aiohttp.ClientSession() as session:
                if engine_sleeps:
                    await session.post(f"{url}/sleep", params={"level": "1"})
                shard = Shard(sleepy(), port=port)
                state = await adopted_state(shard, recorded, session)
                if state == ShardState.ASLEEP:
                    assert (shard.sleep_level, shard.host_memory_mib) == (1, 64)
                return state

        assert asyncio.run(main()) == expected
