"""bench/routing.py's in-process part: what the routing decision costs the gateway (the index
lookup and scoring of a prompt with 1M blocks indexed, tokenising and hashing by prompt
length, the index's bytes per block)."""

from __future__ import annotations

import random
import time
import tracemalloc
from typing import Any

from bench.tenants import percentile
from llmgw.sim.generate import tokenize


def decision_figures(
    *,
    replicas: int,
    prompt_tokens: int,
    max_concurrency: int,
    vocab: list[str],
    blocks: int = 1_000_000,
    decisions: int = 20_000,
) -> dict[str, Any]:
    """Index lookup + scoring with ``blocks`` indexed over 8 replicas; tokenise + hash by
    prompt length; bytes per indexed block."""
    from llmgw.contracts.kvblocks import block_keys
    from llmgw.proto import control_pb2 as pb
    from llmgw.server.common.metrics import Metrics
    from llmgw.server.gateway.policies import RouteHint, RoutingPolicies
    from llmgw.server.gateway.prefixes import BlockIndex
    from llmgw.server.gateway.routing import Endpoint, Router

    rng = random.Random(5)
    # Bytes per block: an index of 200k keys over 8 replicas, measured by tracemalloc.
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    index = BlockIndex()
    keys = [rng.getrandbits(64) | 1 for _ in range(200_000)]
    for r in range(replicas):
        index.add(f"s{r}", keys[r::replicas])
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_block = grown / len(keys)
    del index, keys

    router = Router(RoutingPolicies(Metrics()))
    eps = [Endpoint("m", f"r{i}", f"s{i}", f"n{i}", "h:1") for i in range(replicas)]
    for ep in eps:
        router.set_ready(ep)
    # 1M blocks: each replica holds prompts of its own (chains of 256 blocks) and half of the
    # hot ones.
    prompts = [list(range(t * 10_000, t * 10_000 + prompt_tokens)) for t in range(64)]
    hot = [block_keys(p) for p in prompts]
    per = blocks // replicas
    for r, ep in enumerate(eps):
        mine = [k for i, chain in enumerate(hot) if i % 2 == r % 2 for k in chain]
        filler = [rng.getrandbits(64) | 1 for _ in range(max(0, per - len(mine)))]
        router.kv_events(
            ep.node_id, pb.KvEvents(shard_id=ep.shard_id, block_size=16, stored=mine + filler)
        )
    indexed = sum(router.prefixes.indexed_blocks().values())
    timings: list[float] = []
    for i in range(decisions):
        prompt = prompts[i % len(prompts)]
        keys = hot[i % len(hot)]
        hint = RouteHint("kv-events", keys, unit=16, tokens=len(prompt), session=f"c{i % 500}")
        began = time.perf_counter()
        ep = router.pick_free("m", max_concurrency, hint=hint)
        timings.append(time.perf_counter() - began)
        assert ep is not None
        hint.settle()
    keys_us: dict[str, float] = {}
    for length in (1024, 4096, 16384):
        text = " ".join(vocab[i % len(vocab)] for i in range(length))
        rounds = max(20, 20_000 // length)
        began = time.perf_counter()
        for _ in range(rounds):
            block_keys(tokenize(text))
        keys_us[str(length)] = round((time.perf_counter() - began) / rounds * 1e6, 1)
    return {
        "indexed_blocks": indexed,
        "choose_p50_us": round(percentile(timings, 50) * 1e6, 1),
        "choose_p99_us": round(percentile(timings, 99) * 1e6, 1),
        "keys_us_by_prompt_tokens": keys_us,
        "bytes_per_block": round(per_block),
    }
