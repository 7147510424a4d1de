#!/usr/bin/env python3
"""Benchmark: cache-aware routing against load-only routing, on 8 sim replicas with realistic
costs; and what the routing decision costs the gateway.

A real ``llmgw server`` with one real agent running 8 sim replicas of a model whose profile
sets ``prefill_us_per_token`` (0.1 ms a token, served one prefill at a time per replica, as a
GPU's compute-bound prefill), 10 ms a generated token, ``kv_blocks`` so that a replica holds
about a quarter of the tenants' system prompts, and ``routing`` one of round-robin,
least-outstanding, prefix-approx and kv-events (the agent forwards the sim's KV events).

The workload: 50 tenants, each with its own 4,096-token system prompt; multi-turn
conversations (each turn adds a user message of 64-128 tokens, and the previous answer, to
the history; a conversation ends after 6 turns); Poisson arrivals at 70% and 90% of the
replicas' capacity without a cache (8 / the mean prefill time of a whole prompt). Each turn
is a streamed chat completion through the official endpoint with ``user`` = the
conversation; its TTFT, end-to-end time, output tokens and cached prompt tokens
(``usage.prompt_tokens_details``) are recorded; the first ``--warmup`` seconds of each phase
are not counted. The policies run interleaved (each load in turn, each policy a fresh
deployment of 8 replicas with cold caches), so the machine's noise falls on all alike.

Then a saturation phase: ``--users`` users each running conversations back to back, so that
each policy serves as much as it can (an open-loop load below capacity is served whole by
any policy that keeps up, so throughput can only differ where one saturates).

Targets: at 90% load, kv-events' p90 TTFT at most 1/5 of least-outstanding's; at saturation,
its output tokens per second at least 1.5x. The gateway CPU per request is the control
plane's process CPU during the phase, less its idle rate measured just before, over the
requests sent.

Then the decision alone, in this process: the index lookup and scoring of a 4,096-token
prompt with 1M blocks indexed over 8 replicas (target p99 <= 100 us), tokenising and hashing
by prompt length, and the index's bytes per block.

It prints figures next to their targets; it is not a pass/fail test. Client, gateway, agent
and engines share this machine's CPUs.

Usage: python bench/routing.py [--duration S] [--warmup S] [--loads 0.7,0.9] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.tenants import cpu_seconds, percentile, say  # noqa: E402
from llmgw.sim.generate import tokenize  # noqa: E402
from tests.integration.harness import (  # noqa: E402
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

POLICIES = ("round-robin", "least-outstanding", "prefix-approx", "kv-events")
REPLICAS = 8
TENANTS = 50
SYSTEM_TOKENS = 4096
TURNS = 6
PREFILL_US = 100.0  # per uncached prompt token
TPS = 100.0  # 10 ms per output token
MAX_TOKENS = 32
KV_BLOCKS = 4096  # 65,536 tokens: about a quarter of the 50 system prompts
MAX_CONCURRENCY = 64
TARGET_TTFT_RATIO = 5.0
TARGET_THROUGHPUT_RATIO = 1.5
TARGET_DECISION_US = 100.0

_VOCAB = (
    "the of and to in is was for that on with as by at from it be this are or an have not "
    "which one all were they but had there when more time some can about out many then them "
    "these so would other into has her two like him see could no make than first been its who "
    "now people my made over did down only way find use may water long little very after words"
).split()


def words(rng: random.Random, n: int) -> str:
    """``n`` of the sim's own words: ``n`` tokens of its tokenizer."""
    return " ".join(rng.choice(_VOCAB) for _ in range(n))


# --------------------------------------------------------------------------- the workload


@dataclass
class Conversation:
    tenant: int
    cid: str
    history: list[dict[str, str]]
    turns: int = 0
    busy: bool = False


@dataclass
class Result:
    started: float
    ttft: float | None
    total: float
    status: int
    output: int = 0
    prompt: int = 0
    cached: int = 0


@dataclass
class Workload:
    seed: int
    systems: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.systems = [
            f"Tenant {t} policy. " + words(rng, SYSTEM_TOKENS - 3) for t in range(TENANTS)
        ]
        self.mean_prompt = SYSTEM_TOKENS + (TURNS + 1) / 2 * (96 + MAX_TOKENS)

    def capacity(self) -> float:
        """Requests per second the replicas serve without a cache: prefill-bound."""
        return REPLICAS / (self.mean_prompt * PREFILL_US / 1e6)


async def turn(
    session: aiohttp.ClientSession,
    url: str,
    key: str,
    model: str,
    conv: Conversation,
    rng: random.Random,
    out: list[Result],
) -> None:
    conv.busy = True
    conv.history.append({"role": "user", "content": words(rng, rng.randint(64, 128))})
    body = {
        "model": model,
        "messages": conv.history,
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": conv.cid,
    }
    started = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    result = Result(started, None, 0.0, 0)
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            result.status = resp.status
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - started
                        text.append(piece)
                usage = chunk.get("usage")
                if usage:
                    result.output = usage.get("completion_tokens", 0)
                    result.prompt = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached = details.get("cached_tokens", 0) or 0
    except (TimeoutError, aiohttp.ClientError):
        result.status = result.status or 0
    result.ttft = ttft
    result.total = time.perf_counter() - started
    out.append(result)
    conv.history.append({"role": "assistant", "content": "".join(text)})
    conv.turns += 1
    conv.busy = False


async def drive(
    server: Server,
    key: str,
    model: str,
    rate: float,
    duration: float,
    seed: int,
    workload: Workload,
) -> tuple[list[Result], float, float]:
    """Poisson arrivals at ``rate`` for ``duration`` s: each a turn of an idle conversation of
    a random tenant (70%) or the first turn of a new one. Returns the results, the start time
    and the server's CPU seconds used."""
    rng = random.Random(seed)
    url = server.url + "/v1/chat/completions"
    convs: dict[int, list[Conversation]] = {t: [] for t in range(TENANTS)}
    out: list[Result] = []
    tasks: list[asyncio.Task[None]] = []
    serial = 0
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu0 = cpu_seconds(server.proc.pid)
        start = time.perf_counter()
        due = start
        while True:
            due += rng.expovariate(rate)
            now = time.perf_counter()
            if due - start >= duration:
                break
            if due > now:
                await asyncio.sleep(due - now)
            tenant = rng.randrange(TENANTS)
            idle = [c for c in convs[tenant] if not c.busy and c.turns < TURNS]
            if idle and rng.random() < 0.7:
                conv = rng.choice(idle)
            else:
                serial += 1
                conv = Conversation(
                    tenant,
                    f"t{tenant}-c{serial}",
                    [{"role": "system", "content": workload.systems[tenant]}],
                )
                convs[tenant] = [c for c in convs[tenant] if c.turns < TURNS] + [conv]
            tasks.append(asyncio.create_task(turn(session, url, key, model, conv, rng, out)))
        await asyncio.gather(*tasks)
        cpu = cpu_seconds(server.proc.pid) - cpu0
    return out, start, cpu


async def drive_closed(
    server: Server,
    key: str,
    model: str,
    users: int,
    duration: float,
    seed: int,
    workload: Workload,
) -> tuple[list[Result], float, float]:
    """Saturation: ``users`` users, each running conversations of a random tenant turn
    after turn (the next as soon as the answer is in) for ``duration`` s."""
    url = server.url + "/v1/chat/completions"
    out: list[Result] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        cpu0 = cpu_seconds(server.proc.pid)
        start = time.perf_counter()

        async def user(u: int) -> None:
            rng = random.Random(seed * 1000 + u)
            serial = 0
            while time.perf_counter() - start < duration:
                tenant = rng.randrange(TENANTS)
                serial += 1
                conv = Conversation(
                    tenant,
                    f"u{u}-c{serial}",
                    [{"role": "system", "content": workload.systems[tenant]}],
                )
                while conv.turns < TURNS and time.perf_counter() - start < duration:
                    await turn(session, url, key, model, conv, rng, out)

        await asyncio.gather(*(user(u) for u in range(users)))
        cpu = cpu_seconds(server.proc.pid) - cpu0
    return out, start, cpu


def idle_cpu_rate(server: Server, seconds: float = 5.0) -> float:
    """The control plane's CPU seconds per second with nothing to serve (heartbeats, the
    scheduler, the store), to take off the phases' figure."""
    before = cpu_seconds(server.proc.pid)
    time.sleep(seconds)
    return (cpu_seconds(server.proc.pid) - before) / seconds


def summary(results: list[Result], start: float, warmup: float, cpu: float) -> dict[str, Any]:
    counted = [r for r in results if r.started - start >= warmup]
    ok = [r for r in counted if r.status == 200 and r.ttft is not None]
    if not ok:
        return {"sent": len(counted), "ok": 0}
    ttft = [r.ttft * 1000 for r in ok if r.ttft is not None]
    total = [r.total * 1000 for r in ok]
    span = max(r.started + r.total for r in ok) - min(r.started for r in ok)
    prompt = sum(r.prompt for r in ok)
    return {
        "sent": len(counted),
        "ok": len(ok),
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p90_ms": round(percentile(ttft, 90), 1),
        "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "e2e_p99_ms": round(percentile(total, 99), 1),
        "output_tps": round(sum(r.output for r in ok) / span, 1) if span > 0 else math.nan,
        "hit_rate": round(sum(r.cached for r in ok) / prompt, 3) if prompt else 0.0,
        "gateway_cpu_us": round(cpu / len(results) * 1e6) if results else math.nan,
    }


class Cluster:
    def __init__(self, tmp: Path) -> None:
        tmp.mkdir(parents=True)
        self.server: Server = start_server_with(
            tmp, queue_timeout=120, max_inflight_body_bytes="1GiB"
        )
        self.agent = start_agent(make_agent(tmp, self.server, "node-a"))
        wait_for(lambda: any(n["connected"] for n in self.server.nodes()), what="the agent")
        self.server.approve_pending(1)
        profile = {
            "engine": "sim",
            "max_concurrency": MAX_CONCURRENCY,
            "params": {
                "prefill_us_per_token": str(PREFILL_US),
                "tps": str(TPS),
                "max_tokens": str(MAX_TOKENS),
                "kv_blocks": str(KV_BLOCKS),
            },
        }
        self.profile = profile
        self.key = str(self.server.api("POST", "/api/keys", {"name": "bench"})["key"])

    def deploy(self, model: str) -> None:
        # Again each time: undeploying a model takes it out of the catalog.
        self.server.api(
            "PUT",
            "/api/catalog",
            {
                "models": {
                    f"chat-{policy}": {"profiles": {"default": {**self.profile, "routing": policy}}}
                    for policy in POLICIES
                }
            },
        )
        self.server.api(
            "POST", "/api/models", {"name": model, "profile": "default", "replicas": REPLICAS}
        )
        wait_for(
            lambda: sum(1 for r in self.server.replicas(model) if r["routable"]) == REPLICAS,
            timeout=120,
            what=f"{REPLICAS} replicas of {model}",
        )

    def undeploy(self, model: str) -> None:
        self.server.api("DELETE", f"/api/models/{model}")
        wait_for(
            lambda: not [r for r in self.server.replicas() if r["model"] == model],
            timeout=60,
            what=f"{model} gone",
        )

    def stop(self) -> None:
        if self.agent.proc is not None:
            stop_process(self.agent.proc)
        stop_process(self.server.proc)


def fleet_phases(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(seed=11)
    capacity = workload.capacity()
    out: dict[str, Any] = {"capacity_rps": round(capacity, 2), "loads": {}}
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-")) / "cluster")
    phases: list[tuple[str, float]] = [(f"{load:.0%}", load) for load in args.loads]
    if args.users:
        phases.append((f"saturated ({args.users} users)", 0.0))
    try:
        for label, load in phases:
            figures: dict[str, Any] = {}
            for policy in POLICIES:
                model = f"chat-{policy}"
                cluster.deploy(model)
                idle = idle_cpu_rate(cluster.server)
                say(f"{label}: {policy}")
                if load:
                    job = drive(
                        cluster.server,
                        cluster.key,
                        model,
                        load * capacity,
                        args.duration,
                        seed=int(load * 100),
                        workload=workload,
                    )
                else:
                    job = drive_closed(
                        cluster.server,
                        cluster.key,
                        model,
                        args.users,
                        args.duration,
                        seed=7,
                        workload=workload,
                    )
                results, start, cpu = asyncio.run(job)
                busy = cpu - idle * (time.perf_counter() - start)
                figures[policy] = summary(results, start, args.warmup, max(busy, 0.0))
                say(f"  {figures[policy]}")
                cluster.undeploy(model)
            out["loads"][label] = figures
    finally:
        cluster.stop()
    return out


# --------------------------------------------------------------------------- the decision


def decision_figures(blocks: int = 1_000_000, decisions: int = 20_000) -> dict[str, Any]:
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
    for r in range(REPLICAS):
        index.add(f"s{r}", keys[r::REPLICAS])
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    per_block = grown / len(keys)
    del index, keys

    router = Router(RoutingPolicies(Metrics()))
    eps = [Endpoint("m", f"r{i}", f"s{i}", f"n{i}", "h:1") for i in range(REPLICAS)]
    for ep in eps:
        router.set_ready(ep)
    # 1M blocks: each replica holds prompts of its own (chains of 256 blocks) and half of the
    # hot ones.
    prompts = [list(range(t * 10_000, t * 10_000 + SYSTEM_TOKENS)) for t in range(64)]
    hot = [block_keys(p) for p in prompts]
    per = blocks // REPLICAS
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
        ep = router.pick_free("m", MAX_CONCURRENCY, hint=hint)
        timings.append(time.perf_counter() - began)
        assert ep is not None
        hint.settle()
    keys_us: dict[str, float] = {}
    for length in (1024, 4096, 16384):
        text = " ".join(_VOCAB[i % len(_VOCAB)] for i in range(length))
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


# --------------------------------------------------------------------------- output


def render(fig: dict[str, Any]) -> str:
    lines = [
        f"llmgw routing benchmark ({os.cpu_count()} CPUs, Python {platform.python_version()})",
    ]
    fleet = fig.get("fleet")
    if fleet:
        lines.append(
            f"{REPLICAS} sim replicas, prefill {PREFILL_US / 1000:g} ms/token one at a time, "
            f"decode {1000 / TPS:g} ms/token, {TENANTS} tenants x {SYSTEM_TOKENS}-token system "
            f"prompts, {TURNS}-turn conversations; capacity without a cache "
            f"{fleet['capacity_rps']} req/s"
        )
        for load, figures in fleet["loads"].items():
            lines.append(f"at {load} of capacity:")
            lines.append(
                f"  {'policy':<18} {'TTFT p50':>9} {'p90':>9} {'p99':>9} {'e2e p99':>9} "
                f"{'out tok/s':>9} {'hit rate':>8} {'gw CPU':>8}"
            )
            for policy, f in figures.items():
                if not f.get("ok"):
                    lines.append(f"  {policy:<18} no answers ({f.get('sent', 0)} sent)")
                    continue
                lines.append(
                    f"  {policy:<18} {f['ttft_p50_ms']:>7.0f}ms {f['ttft_p90_ms']:>7.0f}ms "
                    f"{f['ttft_p99_ms']:>7.0f}ms {f['e2e_p99_ms']:>7.0f}ms "
                    f"{f['output_tps']:>9.0f} {f['hit_rate']:>8.0%} {f['gateway_cpu_us']:>6}us"
                )
            kv, lo = figures.get("kv-events", {}), figures.get("least-outstanding", {})
            if kv.get("ok") and lo.get("ok") and load.startswith("saturated"):
                tps = kv["output_tps"] / lo["output_tps"] if lo["output_tps"] else math.inf
                lines.append(
                    f"  kv-events vs least-outstanding at saturation: throughput {tps:.2f}x "
                    f"(target >= {TARGET_THROUGHPUT_RATIO:g}x: "
                    f"{'met' if tps >= TARGET_THROUGHPUT_RATIO else 'MISSED'})"
                )
            elif kv.get("ok") and lo.get("ok"):
                ttft = lo["ttft_p90_ms"] / kv["ttft_p90_ms"] if kv["ttft_p90_ms"] else math.inf
                # Below capacity both serve the whole offered load: throughput is compared
                # at saturation.
                lines.append(
                    f"  kv-events vs least-outstanding: p90 TTFT {ttft:.1f}x lower (target >= "
                    f"{TARGET_TTFT_RATIO:g}x: {'met' if ttft >= TARGET_TTFT_RATIO else 'MISSED'})"
                )
    d = fig["decision"]
    lines += [
        f"The decision, in-process, {d['indexed_blocks']:,} blocks indexed over {REPLICAS} "
        "replicas:",
        f"  index lookup + scoring of a {SYSTEM_TOKENS}-token prompt: p50 {d['choose_p50_us']} us,"
        f" p99 {d['choose_p99_us']} us (target p99 <= {TARGET_DECISION_US:g} us: "
        f"{'met' if d['choose_p99_us'] <= TARGET_DECISION_US else 'MISSED'})",
        "  tokenise (sim) + hash, by prompt tokens: "
        + ", ".join(f"{n}: {us} us" for n, us in d["keys_us_by_prompt_tokens"].items()),
        f"  index memory: {d['bytes_per_block']} bytes per block",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds not counted")
    parser.add_argument(
        "--loads",
        type=lambda s: [float(x) for x in s.split(",") if x],
        default=[0.7, 0.9],
        help="shares of capacity, comma-separated",
    )
    parser.add_argument(
        "--users",
        type=int,
        default=96,
        help="users of the saturation phase (0: none); its throughput is the 1.5x target's",
    )
    parser.add_argument("--decision-only", action="store_true", help="skip the fleet phases")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    fig: dict[str, Any] = {}
    if not args.decision_only:
        fig["fleet"] = fleet_phases(args)
    say("the decision alone")
    fig["decision"] = decision_figures()
    print(json.dumps(fig, indent=2) if args.json else render(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
