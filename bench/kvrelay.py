#!/usr/bin/env python3
"""Benchmark: what relaying the agents' KV events to a standby costs (llmgw.server.ha.kvrelay).

In this process, over loopback HTTP as between two instances: a leader's router with 8
replicas and its relay on a real aiohttp server, and a standby's router following it. The
leader places ``--batches`` KvEvents of ``--keys`` stored block keys each (the agent's batches:
at most one per shard every 50 ms, of the blocks a prefill stored; 4,096-token prompts at 16
tokens a block make 256 keys), as fast as it can, and the standby applies them; reported:
batches and keys per second end to end (the leader's placing, the framing, the standby's
parsing and indexing, all on this one core), the leader's own extra time per batch (framing
and queueing, against placing without a subscriber), and the bytes per batch and per key
on the wire.

    .venv/bin/python bench/kvrelay.py [--batches 20000] [--keys 256]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from aiohttp import web

from llmgw.proto import control_pb2 as pb
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.ha.kvrelay import KvFollower, KvRelay, frame

SHARDS = 8


def _router() -> Router:
    router = Router()
    for i in range(SHARDS):
        router.set_ready(Endpoint("m", f"r{i}", f"s{i}", f"n{i}", f"n{i}:1"))
    return router


def _batches(count: int, keys: int) -> list[tuple[str, pb.KvEvents]]:
    rng = random.Random(1)
    out = []
    for b in range(count):
        shard = b % SHARDS
        stored = [rng.getrandbits(64) or 1 for _ in range(keys)]
        out.append((f"n{shard}", pb.KvEvents(shard_id=f"s{shard}", block_size=16, stored=stored)))
    return out


async def main(batches: int, keys: int) -> None:
    work = _batches(batches, keys)
    # The leader's placing alone, no standby subscribed.
    alone = _router()
    began = time.perf_counter()
    for node, msg in work:
        alone.kv_events(node, msg)
    placing = time.perf_counter() - began

    leader = _router()
    relay = KvRelay(leader, lambda: "t")
    app = web.Application()
    relay.add_routes(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    standby = _router()
    follower = KvFollower(standby, lambda: f"http://127.0.0.1:{port}", token=lambda: "t")
    task = asyncio.create_task(follower.run())
    while not relay.subscribers:  # noqa: ASYNC110 - a bench's poll of the relay's own state
        await asyncio.sleep(0.01)
    began = time.perf_counter()
    leader_time = 0.0
    step = 64  # batches placed per turn of the loop (the stream's messages arrive so)
    for at in range(0, len(work), step):
        t0 = time.perf_counter()
        for node, msg in work[at : at + step]:
            leader.kv_events(node, msg)
        leader_time += time.perf_counter() - t0
        await asyncio.sleep(0)
        while relay.subscribers and sum(len(s.frames) for s in relay.subscribers) > 512:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
    while follower.applied < batches:
        await asyncio.sleep(0.001)
        if time.perf_counter() - began > 300:
            raise SystemExit(f"the standby applied {follower.applied} of {batches}")
    total = time.perf_counter() - began
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    relay.close()
    await runner.cleanup()

    size = sum(len(frame(pb.KvRelayed(node_id=n, model="m", events=m))) for n, m in work) / len(
        work
    )
    agent_size = sum(len(m.SerializeToString()) for _, m in work) / len(work)
    assert len(standby.prefixes.events["m"]) == len(leader.prefixes.events["m"])
    print(f"KV events relay, {batches} batches of {keys} keys, {SHARDS} replicas, loopback HTTP")
    print(
        f"  end to end (leader places, relays; standby parses, indexes): "
        f"{batches / total:,.0f} batches/s = {batches * keys / total:,.0f} keys/s"
    )
    print(
        f"  leader: placing alone {placing / batches * 1e6:.1f} us/batch; with the relay "
        f"{leader_time / batches * 1e6:.1f} us/batch "
        f"(+{(leader_time - placing) / batches * 1e6:.1f} us for one standby)"
    )
    print(
        f"  wire: {size:.0f} bytes/batch ({size / keys:.2f} bytes/key; the agent's own "
        f"message {agent_size:.0f} bytes)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--keys", type=int, default=256)
    args = parser.parse_args()
    asyncio.run(main(args.batches, args.keys))
