"""SleepShard and WakeShard on the node: real ``sim`` engines put to sleep and woken, their
states reported and recorded, adopted asleep by the next agent, and the refusals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import ShardManager, ShardSpec, ShardState
from llmgw.agent.stream import shard_status
from llmgw.errors import ShardError
from llmgw.proto import control_pb2 as pb
from tests.unit.agent.test_shards import WAIT_S, Recorder, records, run_with_manager

pytestmark = pytest.mark.timeout(60)

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
    from llmgw.agent.shards import Shard
    from llmgw.agent.sleeping import put_to_sleep, wake

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            llama = Shard(ShardSpec("l", "r", "m", "llamacpp"), state=ShardState.READY)
            with pytest.raises(ShardError, match="engine llamacpp cannot sleep"):
                await put_to_sleep(llama, 1, session, lambda s: None, ShardState)
            worker = Shard(ShardSpec("w", "r", "m", "sim", rank=1, nodes=2))
            with pytest.raises(ShardError, match="only rank 0's engine sleeps"):
                await put_to_sleep(worker, 1, session, lambda s: None, ShardState)
            starting = Shard(ShardSpec("s", "r", "m", "sim"))
            with pytest.raises(ShardError, match="shard s is starting, not ready"):
                await put_to_sleep(starting, 1, session, lambda s: None, ShardState)
            with pytest.raises(ShardError, match="shard s is starting, not asleep"):
                await wake(starting, session, lambda s: None, ShardState, 5.0)

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
    from collections.abc import AsyncIterator
    from typing import Any

    from llmgw.proto import control_pb2_grpc as pb_grpc
    from tests.unit.agent.test_stream import _client, _serve

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
