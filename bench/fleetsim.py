#!/usr/bin/env python3
"""The simulated agents of bench/fleet.py: many real clients of the real protocol in one
process.

Each simulated agent enrols as a node does (its own ECDSA key, a CSR, ``POST /enroll`` with
its one-time join token over TLS checked against the cluster CA), then keeps its own mTLS
gRPC Connect stream (grpc.aio): a Hello with an 8-GPU inventory on one of two fabrics,
heartbeats at the interval the Welcome gives, ShardStatus for the shards it is ordered to
run (a StartShard is "run" in-process: STARTING, the order's result, READY a moment later),
EXITED for a StopShard, and a reconnect with the agent's own full-jitter backoff when the
stream ends. It measures what an agent sees: each heartbeat's round trip to its
HeartbeatAck.

It is driven by bench/fleet.py over stdin/stdout, one JSON object per line:

- in:  ``{"cmd": "stats"}`` (answered with counters and the heartbeat round trips since the
  last stats), ``{"cmd": "kill", "node": ID}`` (the agent's channel dropped at once and not
  dialled again: a machine that died), ``{"cmd": "quit"}``;
- out: ``{"event": "enrolled", ...}`` once every node has its certificate, then the answers.

Usage (by bench/fleet.py): python bench/fleetsim.py --nodes FILE --grpc HOST:PORT
--enroll HOST:PORT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402

from llmgw import __version__, pki  # noqa: E402
from llmgw.proto import control_pb2 as pb  # noqa: E402
from llmgw.proto import control_pb2_grpc as pb_grpc  # noqa: E402

GPUS = 8
GPU_MIB = 80 * 1024
READY_AFTER_S = 0.2  # a sim shard's start, as the real sim engine takes about this
ENROL_CONCURRENCY = 16
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.5, 30.0  # llmgw.agent.stream.Backoff


def inventory(node_id: str, index: int, fabric: str) -> pb.Inventory:
    return pb.Inventory(
        hostname=node_id,
        arch="x86_64",
        cpus=64,
        memory_total_bytes=1 << 40,
        memory_available_bytes=1 << 39,
        gpus=[
            pb.Gpu(
                index=g,
                uuid=f"GPU-{index:05d}-{g}",
                name="NVIDIA H100 80GB HBM3",
                memory_total_mib=GPU_MIB,
                memory_used_mib=0,
            )
            for g in range(GPUS)
        ],
        engines=["sim"],
        driver_version="550.54.15",
        gpu_source="nvml",
        disk_total_bytes=4 << 40,
        disk_free_bytes=2 << 40,
        engine_details=[pb.EngineInfo(name="sim", path="builtin", version=__version__, ok=True)],
        ib_adapters=[
            pb.IbAdapter(
                name=f"mlx5_{h}",
                ports=[pb.IbPort(port=1, state="4: ACTIVE", link_layer="InfiniBand")],
            )
            for h in range(2)
        ],
        fabrics=[pb.Fabric(name=fabric, hcas=["mlx5_0", "mlx5_1"], healthy=True)],
    )


@dataclass
class Shard:
    shard_id: str
    replica_id: str
    model: str
    state: int = pb.SHARD_STARTING

    def status(self) -> pb.ShardStatus:
        return pb.ShardStatus(
            shard_id=self.shard_id,
            replica_id=self.replica_id,
            state=self.state,  # type: ignore[arg-type]
            port=1 if self.state == pb.SHARD_READY else 0,
            pid=1,
            model=self.model,
        )


@dataclass
class Counters:
    streams: int = 0  # streams that got a Welcome
    ended_by_server: int = 0  # streams that ended without our asking
    refused: int = 0
    starts: int = 0  # StartShard orders received
    stops: int = 0
    rtts_ms: list[float] = field(default_factory=list)


class SimAgent:
    def __init__(self, node: dict[str, Any], grpc_addr: str, counters: Counters) -> None:
        self.node_id: str = node["node_id"]
        self.index: int = node["index"]
        self.fabric: str = node["fabric"]
        self.grpc_addr = grpc_addr
        self.counters = counters
        self.creds: grpc.ChannelCredentials | None = None
        self.shards: dict[str, Shard] = {}
        self.max_epoch = 0
        self.connected = False
        self.approved = False
        self.killed = False
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    async def enrol(self, http: aiohttp.ClientSession, url: str, token: str, ctx: Any) -> None:
        key = pki.new_private_key()
        csr = pki.make_csr(key, self.node_id).public_bytes(serialization.Encoding.PEM)
        body = {"token": token, "node_id": self.node_id, "csr": csr.decode()}
        for attempt in range(10):
            async with http.post(
                url, json=body, ssl=ctx, server_hostname=pki.CONTROL_PLANE_NAME
            ) as resp:
                answer = await resp.json()
                if resp.status == 200:
                    break
                if resp.status < 500 and resp.status != 429:
                    raise RuntimeError(f"{self.node_id}: enrolment refused: {answer}")
            await asyncio.sleep(0.2 * (attempt + 1))
        else:
            raise RuntimeError(f"{self.node_id}: enrolment kept failing: {answer}")
        self.creds = grpc.ssl_channel_credentials(
            root_certificates=answer["ca"].encode(),
            private_key=pki.key_pem(key),
            certificate_chain=answer["certificate"].encode(),
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self.run())

    async def run(self) -> None:
        attempt = 0
        while not self.killed:
            welcomed = await self.session()
            if self.killed:
                return
            if welcomed:
                attempt = 0
            delay = random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))
            attempt = min(attempt + 1, 16)
            await asyncio.sleep(max(delay, 0.05))

    async def session(self) -> bool:
        assert self.creds is not None
        options = [
            ("grpc.ssl_target_name_override", pki.CONTROL_PLANE_NAME),
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        welcomed = False
        queue: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        beats: asyncio.Task[None] | None = None
        sent: dict[int, float] = {}

        async def outgoing() -> Any:
            while True:
                msg = await queue.get()
                if msg is None:
                    return
                yield msg

        channel = grpc.aio.secure_channel(self.grpc_addr, self.creds, options=options)
        self._channel = channel
        try:
            call = pb_grpc.ControlPlaneStub(channel).Connect(outgoing())
            queue.put_nowait(pb.AgentMessage(hello=self.hello()))
            async for msg in call:
                kind = msg.WhichOneof("msg")
                if kind == "welcome":
                    welcomed = True
                    self.connected = True
                    self.counters.streams += 1
                    self.max_epoch = max(self.max_epoch, msg.welcome.epoch)
                    self.approved = msg.welcome.node_state == "approved"
                    interval = msg.welcome.heartbeat_interval_s or 5.0
                    beats = asyncio.create_task(self.heartbeats(queue, interval, sent))
                elif kind == "heartbeat_ack":
                    t = sent.pop(msg.heartbeat_ack.seq, None)
                    if t is not None:
                        self.counters.rtts_ms.append((time.perf_counter() - t) * 1000)
                elif kind == "node_state":
                    self.approved = msg.node_state.state == "approved"
                elif kind == "start_shard":
                    self.counters.starts += 1
                    order = msg.start_shard
                    self.max_epoch = max(self.max_epoch, order.meta.epoch)
                    shard = Shard(order.shard_id, order.replica_id, order.model)
                    self.shards[shard.shard_id] = shard
                    queue.put_nowait(pb.AgentMessage(shard_status=shard.status()))
                    queue.put_nowait(
                        pb.AgentMessage(
                            op_result=pb.OperationResult(
                                op_id=order.meta.op_id, ok=True, epoch=order.meta.epoch
                            )
                        )
                    )
                    asyncio.get_running_loop().call_later(READY_AFTER_S, self._ready, queue, shard)
                elif kind == "stop_shard":
                    self.counters.stops += 1
                    order = msg.stop_shard
                    shard = self.shards.pop(order.shard_id, None) or Shard(order.shard_id, "", "")
                    shard.state = pb.SHARD_EXITED
                    queue.put_nowait(pb.AgentMessage(shard_status=shard.status()))
                    queue.put_nowait(
                        pb.AgentMessage(
                            op_result=pb.OperationResult(
                                op_id=order.meta.op_id, ok=True, epoch=order.meta.epoch
                            )
                        )
                    )
                elif kind == "refuse":
                    self.counters.refused += 1
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.counters.refused += 1
        except asyncio.CancelledError:
            if not self.killed:
                raise
        finally:
            self.connected = False
            queue.put_nowait(None)
            if beats is not None:
                beats.cancel()
            if welcomed and not self.killed:
                self.counters.ended_by_server += 1
            with contextlib.suppress(Exception):
                await channel.close(grace=None)
            self._channel = None
        return welcomed

    def _ready(self, queue: asyncio.Queue[pb.AgentMessage | None], shard: Shard) -> None:
        if self.shards.get(shard.shard_id) is shard and shard.state == pb.SHARD_STARTING:
            shard.state = pb.SHARD_READY
            queue.put_nowait(pb.AgentMessage(shard_status=shard.status()))

    async def heartbeats(
        self, queue: asyncio.Queue[pb.AgentMessage | None], interval: float, sent: dict[int, float]
    ) -> None:
        # Agents connect at different moments, so their heartbeats spread over the interval.
        await asyncio.sleep(random.uniform(0, interval))
        seq = 0
        while True:
            seq += 1
            sent[seq] = time.perf_counter()
            if len(sent) > 16:  # unanswered ones are not kept forever
                sent.pop(min(sent))
            queue.put_nowait(pb.AgentMessage(heartbeat=pb.Heartbeat(seq=seq, inflight=0)))
            await asyncio.sleep(interval)

    def hello(self) -> pb.Hello:
        return pb.Hello(
            node_id=self.node_id,
            agent_version=__version__,
            inventory=inventory(self.node_id, self.index, self.fabric),
            shards=[s.status() for s in self.shards.values()],
            max_epoch=self.max_epoch,
            dataplane_addr="127.0.0.1:9",  # never dialled: the bench sends these no requests
        )

    async def kill(self) -> None:
        self.killed = True
        if self._channel is not None:
            await self._channel.close(grace=None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def enrol_all(
    agents: list[SimAgent], tokens: dict[str, str], enroll: str
) -> tuple[int, list[str]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"https://{enroll}/enroll/ca", ssl=False) as resp:
            ca_pem = await resp.text()
        ctx = ssl.create_default_context(cadata=ca_pem)
        sem = asyncio.Semaphore(ENROL_CONCURRENCY)
        failed: list[str] = []

        async def one(agent: SimAgent) -> None:
            async with sem:
                try:
                    await agent.enrol(http, f"https://{enroll}/enroll", tokens[agent.node_id], ctx)
                except Exception as exc:
                    failed.append(f"{agent.node_id}: {exc}"[:300])

        await asyncio.gather(*(one(a) for a in agents))
    return len(agents) - len(failed), failed


def emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main_async(args: argparse.Namespace, nodes: list[dict[str, Any]]) -> None:
    counters = Counters()
    agents = [SimAgent(n, args.grpc, counters) for n in nodes]
    by_id = {a.node_id: a for a in agents}
    t0 = time.monotonic()
    enrolled, failed = await enrol_all(
        agents, {n["node_id"]: n["token"] for n in nodes}, args.enroll
    )
    emit({"event": "enrolled", "count": enrolled, "failed": failed[:5], "s": time.monotonic() - t0})
    for agent in agents:
        if agent.creds is not None:
            agent.start()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        cmd = json.loads(line)
        if cmd["cmd"] == "stats":
            rtts, counters.rtts_ms = counters.rtts_ms, []
            emit(
                {
                    "event": "stats",
                    "connected": sum(a.connected for a in agents),
                    "approved": sum(a.connected and a.approved for a in agents),
                    "shards": sum(len(a.shards) for a in agents),
                    "streams": counters.streams,
                    "ended_by_server": counters.ended_by_server,
                    "refused": counters.refused,
                    "starts": counters.starts,
                    "stops": counters.stops,
                    "rtts_ms": [round(r, 3) for r in rtts],
                }
            )
        elif cmd["cmd"] == "kill":
            await by_id[cmd["node"]].kill()
            emit({"event": "killed", "node": cmd["node"]})
        elif cmd["cmd"] == "quit":
            break
    for agent in agents:
        agent.killed = True
    await asyncio.gather(*(a.kill() for a in agents), return_exceptions=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--nodes", required=True, help="JSON file: [{node_id, index, fabric, token}]"
    )
    parser.add_argument("--grpc", required=True, help="host:port of the control plane's stream")
    parser.add_argument("--enroll", required=True, help="host:port of its enrolment endpoint")
    args = parser.parse_args()
    asyncio.run(main_async(args, json.loads(Path(args.nodes).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
