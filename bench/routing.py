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

The low-reuse workload (``--workloads low-reuse``), the counter-case of KV routing: each
request the one turn of a new conversation whose 4,096-token prompt is its own (no prefix
shared with any other), at the same shares of capacity and at saturation.

``--via standby``: an HA pair on a throwaway PostgreSQL (tests/pg.py), the agent connected to
both; each policy's phase runs through the leader, then (a fresh deployment) through the
standby, which routes by the KV events the leader relays and by rendezvous hashing.

Targets: at 90% load, kv-events' p90 TTFT at most 1/5 of least-outstanding's; at saturation,
its output tokens per second at least 1.5x; at low reuse, the cache-aware policies' TTFT p90
and throughput within 5% of least-outstanding's; through a standby, hit rate and TTFT p90
within 5% of the leader's. The gateway CPU is the entry instance's process CPU during the
phase, less its idle rate measured just before: per request sent, and per content event
relayed (these streams' tokens arrive alone, 10 ms apart, each a wake-up of the gateway, a
TLS read and a write to the client: most of a request's CPU, see the README).

Then the decision alone, in this process: the index lookup and scoring of a 4,096-token
prompt with 1M blocks indexed over 8 replicas (target p99 <= 100 us), tokenising and hashing
by prompt length, and the index's bytes per block.

It prints figures next to their targets; it is not a pass/fail test. Client, gateway, agent
and engines share this machine's CPUs.

Usage: python bench/routing.py [--duration S] [--warmup S] [--loads 0.7,0.9] [--users N]
    [--workloads multi-turn,low-reuse] [--policies a,b] [--via leader|standby] [--json]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.routing_decision import decision_figures  # noqa: E402
from bench.tenants import cpu_seconds, percentile, say  # noqa: E402
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
    chunks: int = 0  # content events received


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

    def capacity(self, unique: bool = False) -> float:
        """Requests per second the replicas serve without a cache: prefill-bound (``unique``:
        the low-reuse workload's one-turn prompts)."""
        prompt = SYSTEM_TOKENS + 96 if unique else self.mean_prompt
        return REPLICAS / (prompt * PREFILL_US / 1e6)

    def conversation(self, tenant: int, cid: str, rng: random.Random | None) -> Conversation:
        """A new conversation of ``tenant``; with ``rng``, the low-reuse workload's: a system
        prompt of its own (unique words, shared with no other request), one turn."""
        if rng is None:
            system = self.systems[tenant]
        else:
            system = f"Request {cid}. " + words(rng, SYSTEM_TOKENS - 3)
        return Conversation(tenant, cid, [{"role": "system", "content": system}])


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
                        result.chunks += 1
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
    unique: bool = False,
) -> tuple[list[Result], float, float]:
    """Poisson arrivals at ``rate`` for ``duration`` s: each a turn of an idle conversation of
    a random tenant (70%) or the first turn of a new one; ``unique`` (low reuse): each the
    one turn of a new conversation with a prompt of its own. Returns the results, the start
    time and the server's CPU seconds used."""
    rng = random.Random(seed)
    # The arrival times and the words each on a stream of their own: every policy gets the
    # same arrivals, however the turns' tasks interleave with them and whichever
    # conversations are idle when a request arrives.
    arrivals = random.Random(seed + 2)
    text_rng = random.Random(seed + 1)
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
            due += arrivals.expovariate(rate)
            now = time.perf_counter()
            if due - start >= duration:
                break
            if due > now:
                await asyncio.sleep(due - now)
            tenant = rng.randrange(TENANTS)
            idle = [c for c in convs[tenant] if not c.busy and c.turns < TURNS]
            if idle and not unique and rng.random() < 0.7:
                conv = rng.choice(idle)
            else:
                serial += 1
                conv = workload.conversation(
                    tenant, f"t{tenant}-c{serial}", text_rng if unique else None
                )
                if not unique:
                    convs[tenant] = [c for c in convs[tenant] if c.turns < TURNS] + [conv]
            tasks.append(asyncio.create_task(turn(session, url, key, model, conv, text_rng, out)))
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
    unique: bool = False,
) -> tuple[list[Result], float, float]:
    """Saturation: ``users`` users, each running conversations of a random tenant turn
    after turn (the next as soon as the answer is in) for ``duration`` s; ``unique``: each
    conversation one turn with a prompt of its own."""
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
                conv = workload.conversation(tenant, f"u{u}-c{serial}", rng if unique else None)
                turns = 1 if unique else TURNS
                while conv.turns < turns and time.perf_counter() - start < duration:
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
        # The instance's CPU over every request of the phase (the warm-up's too), less its
        # idle rate: per request, and per content event it relayed (each token of these
        # streams arrives alone, 10 ms after the last: a wake-up, a TLS read, a write each).
        "gateway_cpu_us": round(cpu / len(results) * 1e6) if results else math.nan,
        "gateway_cpu_us_per_chunk": (
            round(cpu / chunks * 1e6, 1) if (chunks := sum(r.chunks for r in results)) else math.nan
        ),
    }


PROFILE = {
    "engine": "sim",
    "max_concurrency": MAX_CONCURRENCY,
    "params": {
        "prefill_us_per_token": str(PREFILL_US),
        "tps": str(TPS),
        "max_tokens": str(MAX_TOKENS),
        "kv_blocks": str(KV_BLOCKS),
    },
}
SERVER_KEYS: dict[str, Any] = {"queue_timeout": 120, "max_inflight_body_bytes": "1GiB"}


class Cluster:
    """One ``llmgw server`` and one agent (``via`` "leader"); or, for ``--via standby``, an
    HA pair on a throwaway PostgreSQL (tests/pg.py), the agent connected to both, each phase
    entered through the leader and then through the standby (``entries``)."""

    def __init__(self, tmp: Path, via: str = "leader") -> None:
        tmp.mkdir(parents=True)
        self.pg: Any = None
        self.procs: list[Any] = []
        self.entries: dict[str, Server] = {}
        if via == "standby":
            from tests.integration.ha import cluster as ha_cluster
            from tests.pg import start_cluster

            self.pg = start_cluster()
            instances = ha_cluster(tmp, self.pg, count=2, extra=SERVER_KEYS)
            self.procs = [i.server.proc for i in instances]
            self.server = instances[0].server
            self.entries = {"leader": self.server, "standby": instances[1].server}
            servers = [f"127.0.0.1:{i.server.grpc_port}" for i in instances]
            agent = make_agent(tmp, self.server, "node-a", extra={"servers": servers})
        else:
            self.server = start_server_with(tmp, **SERVER_KEYS)
            self.entries = {"leader": self.server}
            agent = make_agent(tmp, self.server, "node-a")
        self.agent = start_agent(agent)
        wait_for(lambda: any(n["connected"] for n in self.server.nodes()), what="the agent")
        self.server.approve_pending(1)
        self.key = str(self.server.api("POST", "/api/keys", {"name": "bench"})["key"])

    def deploy(self, model: str) -> None:
        # Again each time: undeploying a model takes it out of the catalog.
        self.server.api(
            "PUT",
            "/api/catalog",
            {
                "models": {
                    f"chat-{policy}": {"profiles": {"default": {**PROFILE, "routing": policy}}}
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
        if "standby" in self.entries:
            standby = self.entries["standby"]
            wait_for(lambda: model in models_of(standby), timeout=60, what="the standby routes")

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
        for proc in reversed(self.procs or [self.server.proc]):
            stop_process(proc)
        if self.pg is not None:
            self.pg.destroy()


def models_of(server: Server) -> list[str]:
    """The models an instance routes now (its /healthz, with the admin token)."""
    from tests.integration.ha import health

    return list(health(server)[1].get("models", []))


def phases_of(args: argparse.Namespace) -> list[tuple[str, float, bool]]:
    """(label, share of capacity (0: saturated), unique prompts) of each phase."""
    phases: list[tuple[str, float, bool]] = []
    for workload in args.workloads:
        unique = workload == "low-reuse"
        tag = " low-reuse" if unique else ""
        phases += [(f"{load:.0%}{tag}", load, unique) for load in args.loads]
        if args.users:
            phases.append((f"saturated ({args.users} users){tag}", 0.0, unique))
    return phases


def run_phase(
    cluster: Cluster, entry: Server, model: str, load: float, unique: bool,
    args: argparse.Namespace, workload: Workload,
) -> dict[str, Any]:  # fmt: skip
    idle = idle_cpu_rate(entry)
    if load:
        job = drive(
            entry,
            cluster.key,
            model,
            load * workload.capacity(unique),
            args.duration,
            seed=int(load * 100) + (1000 if unique else 0),
            workload=workload,
            unique=unique,
        )
    else:
        job = drive_closed(
            entry, cluster.key, model, args.users, args.duration, seed=7, workload=workload,
            unique=unique,
        )  # fmt: skip
    results, start, cpu = asyncio.run(job)
    busy = cpu - idle * (time.perf_counter() - start)
    return summary(results, start, args.warmup, max(busy, 0.0))


def fleet_phases(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(seed=11)
    out: dict[str, Any] = {
        "capacity_rps": round(workload.capacity(), 2),
        "capacity_rps_low_reuse": round(workload.capacity(unique=True), 2),
        "via": args.via,
        "loads": {},
    }
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-bench-routing-")) / "cluster", args.via)
    try:
        for label, load, unique in phases_of(args):
            figures: dict[str, Any] = {}
            for policy in args.policies:
                model = f"chat-{policy}"
                for via, entry in cluster.entries.items():
                    cluster.deploy(model)
                    say(f"{label}: {policy} via the {via}")
                    fig = run_phase(cluster, entry, model, load, unique, args, workload)
                    say(f"  {fig}")
                    if args.via == "standby":
                        figures.setdefault(policy, {})[via] = fig
                    else:
                        figures[policy] = fig
                    cluster.undeploy(model)
            out["loads"][label] = figures
    finally:
        cluster.stop()
    return out


# --------------------------------------------------------------------------- output


TARGET_STANDBY = 0.05
"""Through a standby, hit rate and TTFT p90 within 5% of the leader's."""
TARGET_LOW_REUSE = 0.05
"""Low reuse: the cache-aware policies' TTFT p90 and throughput within 5% of
least-outstanding's."""


def _row(name: str, f: dict[str, Any]) -> str:
    if not f.get("ok"):
        return f"  {name:<26} no answers ({f.get('sent', 0)} sent)"
    return (
        f"  {name:<26} {f['ttft_p50_ms']:>7.0f}ms {f['ttft_p90_ms']:>7.0f}ms "
        f"{f['ttft_p99_ms']:>7.0f}ms {f['e2e_p99_ms']:>7.0f}ms "
        f"{f['output_tps']:>9.0f} {f['hit_rate']:>8.0%} {f['gateway_cpu_us']:>7}us "
        f"{f['gateway_cpu_us_per_chunk']:>7}us"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _standby_lines(figures: dict[str, Any]) -> list[str]:
    lines = []
    for policy, by in figures.items():
        lead, stand = by.get("leader", {}), by.get("standby", {})
        if not (lead.get("ok") and stand.get("ok")):
            continue
        hit = stand["hit_rate"] / lead["hit_rate"] - 1 if lead["hit_rate"] else 0.0
        ttft = stand["ttft_p90_ms"] / lead["ttft_p90_ms"] - 1
        ok = hit >= -TARGET_STANDBY and ttft <= TARGET_STANDBY
        lines.append(
            f"  {policy} through the standby: hit rate {hit:+.1%}, TTFT p90 {ttft:+.1%} of the "
            f"leader's (target within {TARGET_STANDBY:.0%}: {_met(ok)})"
        )
    return lines


def _comparison_lines(label: str, figures: dict[str, Any]) -> list[str]:
    lo = figures.get("least-outstanding", {})
    if not lo.get("ok"):
        return []
    saturated = label.startswith("saturated")
    if label.endswith("low-reuse"):
        lines = []
        for policy in ("prefix-approx", "kv-events"):
            f = figures.get(policy, {})
            if not f.get("ok"):
                continue
            if saturated:
                ratio = f["output_tps"] / lo["output_tps"] - 1
                ok = ratio >= -TARGET_LOW_REUSE
                what = f"throughput {ratio:+.1%}"
            else:
                ratio = f["ttft_p90_ms"] / lo["ttft_p90_ms"] - 1
                ok = ratio <= TARGET_LOW_REUSE
                what = f"TTFT p90 {ratio:+.1%}"
            lines.append(
                f"  {policy} vs least-outstanding at low reuse: {what} (target within "
                f"{TARGET_LOW_REUSE:.0%}: {_met(ok)})"
            )
        return lines
    kv = figures.get("kv-events", {})
    if not kv.get("ok"):
        return []
    if saturated:
        tps = kv["output_tps"] / lo["output_tps"] if lo["output_tps"] else math.inf
        return [
            f"  kv-events vs least-outstanding at saturation: throughput {tps:.2f}x "
            f"(target >= {TARGET_THROUGHPUT_RATIO:g}x: {_met(tps >= TARGET_THROUGHPUT_RATIO)})"
        ]
    # Below capacity both serve the whole offered load: throughput is compared at saturation.
    ttft = lo["ttft_p90_ms"] / kv["ttft_p90_ms"] if kv["ttft_p90_ms"] else math.inf
    return [
        f"  kv-events vs least-outstanding: p90 TTFT {ttft:.1f}x lower (target >= "
        f"{TARGET_TTFT_RATIO:g}x: {_met(ttft >= TARGET_TTFT_RATIO)})"
    ]


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
            f"{fleet['capacity_rps']} req/s (low reuse, unique {SYSTEM_TOKENS}-token prompts: "
            f"{fleet['capacity_rps_low_reuse']} req/s); entered through the "
            + ("leader, then a standby of an HA pair" if fleet["via"] == "standby" else "server")
        )
        lines.append(
            "  gw CPU: the entry instance's CPU less its idle rate, per request and per content "
            "event relayed (each token arrives alone, 10 ms apart)"
        )
        for load, figures in fleet["loads"].items():
            lines.append(f"at {load} of capacity:")
            lines.append(
                f"  {'policy':<26} {'TTFT p50':>9} {'p90':>9} {'p99':>9} {'e2e p99':>9} "
                f"{'out tok/s':>9} {'hit rate':>8} {'gw CPU':>9} {'/chunk':>9}"
            )
            for policy, f in figures.items():
                if fleet["via"] == "standby":
                    lines += [_row(f"{policy} via {via}", g) for via, g in f.items()]
                else:
                    lines.append(_row(policy, f))
            if fleet["via"] == "standby":
                lines += _standby_lines(figures)
            else:
                lines += _comparison_lines(load, figures)
    d = fig.get("decision")
    if d:
        lines += [
            f"The decision, in-process, {d['indexed_blocks']:,} blocks indexed over {REPLICAS} "
            "replicas:",
            f"  index lookup + scoring of a {SYSTEM_TOKENS}-token prompt: p50 "
            f"{d['choose_p50_us']} us, p99 {d['choose_p99_us']} us (target p99 <= "
            f"{TARGET_DECISION_US:g} us: {_met(d['choose_p99_us'] <= TARGET_DECISION_US)})",
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
    parser.add_argument(
        "--workloads",
        type=lambda s: [w for w in s.split(",") if w],
        default=["multi-turn", "low-reuse"],
        help="multi-turn (tenants' shared system prompts), low-reuse (unique prompts, one "
        "turn: the counter-case of KV routing), comma-separated",
    )
    parser.add_argument(
        "--policies",
        type=lambda s: [p for p in s.split(",") if p],
        default=list(POLICIES),
        help="routing policies to run, comma-separated",
    )
    parser.add_argument(
        "--via",
        choices=("leader", "standby"),
        default="leader",
        help="standby: an HA pair on a throwaway PostgreSQL, each phase through the leader "
        "and then through the standby",
    )
    parser.add_argument("--decision-only", action="store_true", help="skip the fleet phases")
    parser.add_argument("--no-decision", action="store_true", help="skip the in-process part")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    unknown = set(args.workloads) - {"multi-turn", "low-reuse"} | set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown workloads or policies: {', '.join(sorted(unknown))}")
    fig: dict[str, Any] = {}
    if not args.decision_only:
        fig["fleet"] = fleet_phases(args)
    if not args.no_decision:
        say("the decision alone")
        fig["decision"] = decision_figures(
            replicas=REPLICAS,
            prompt_tokens=SYSTEM_TOKENS,
            max_concurrency=MAX_CONCURRENCY,
            vocab=_VOCAB,
        )
    print(json.dumps(fig, indent=2) if args.json else render(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
