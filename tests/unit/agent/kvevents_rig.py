"""What the tests of the agent's KV-event feed share: vLLM-shaped event batches, a real ZeroMQ
publisher and sender, a runtime that launches nothing, and a kv-events shard order."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from llmgw.agent.runtimes import Handle, Launch, Runtime
from llmgw.agent.runtimes.base import ShardRecord
from llmgw.agent.shards import ShardSpec
from llmgw.engines.kvevents import (
    publisher_binds,
)
from llmgw.proto import control_pb2 as pb

WAIT_S = 10.0


TOKENS = list(range(100, 148))  # three blocks of 16


H = [bytes([i]) * 32 for i in range(1, 8)]  # vLLM's SHA-256 block hashes


def array_batch(*events: list[Any], ts: float = 1.5) -> bytes:
    """``KVEventBatch`` as vLLM up to 0.11 encodes it (``array_like``, tagged by name)."""
    return msgpack.packb([ts, list(events), None], use_bin_type=True)


def stored_array(
    hashes: list[Any], parent: Any, tokens: list[int], medium: Any = "GPU"
) -> list[Any]:
    return ["BlockStored", hashes, parent, tokens, 16, None, medium, None]


class Sender:
    """The stream client's send: what went out, and whether a stream is up."""

    def __init__(self) -> None:
        self.sent: list[pb.KvEvents] = []
        self.up = True
        self._changed = asyncio.Event()

    def __call__(self, msg: pb.AgentMessage) -> bool:
        assert msg.WhichOneof("msg") == "kv_events"
        if not self.up:
            return False
        self.sent.append(msg.kv_events)
        self._changed.set()
        return True

    async def wait(self, count: int) -> list[pb.KvEvents]:
        async def until() -> None:
            while len(self.sent) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), WAIT_S)
        return self.sent


class Publisher:
    """An engine's publisher, binding or dialling ``endpoint`` by vLLM's rule (an XPUB, so
    that the test knows when the agent's subscription has arrived: ZeroMQ drops what is
    published before)."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, topic: str = "r1-s0") -> None:
        self.socket = context.socket(zmq.XPUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        if publisher_binds(endpoint):
            self.socket.bind(endpoint)
        else:
            self.socket.connect(endpoint)
        self.topic = topic.encode()

    async def subscribed(self) -> None:
        assert await asyncio.wait_for(self.socket.recv(), WAIT_S) == b"\x01"

    async def publish(self, seq: int, payload: bytes, topic: bytes | None = None) -> None:
        await self.socket.send_multipart([topic or self.topic, seq.to_bytes(8, "big"), payload])


class IdleRuntime(Runtime):
    """An engine that runs until stopped and serves nothing (the shard stays starting);
    what it was launched with is kept."""

    name = "process"

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self._ended: dict[str, asyncio.Event] = {}

    async def start(self, launch: Launch) -> Handle:
        self.launches.append(launch)
        self._ended[launch.shard_id] = asyncio.Event()
        return Handle(launch.shard_id, os.getpid(), launch.port)

    async def wait(self, handle: Handle) -> int | None:
        await self._ended.setdefault(handle.shard_id, asyncio.Event()).wait()
        return 0

    async def stop(self, handle: Handle, grace: float) -> None:
        self._ended.setdefault(handle.shard_id, asyncio.Event()).set()

    def alive(self, handle: Handle) -> bool:
        return not self._ended.setdefault(handle.shard_id, asyncio.Event()).is_set()

    async def adopt(self, record: ShardRecord) -> Handle | None:
        return Handle(record.shard_id, record.pid, record.port)


def kv_order(**changes: Any) -> ShardSpec:
    values: dict[str, Any] = {
        "shard_id": "r1-s0",
        "replica_id": "r1",
        "model": "m",
        "engine": "sim",
        "kv_events": True,
        **changes,
    }
    return ShardSpec(**values)
