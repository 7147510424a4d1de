#!/usr/bin/env python3
"""Benchmark: serving by demand on a fixed fleet against the best fixed split of its GPUs.

A real ``llmgw server`` and ``--nodes`` real agents, each with eight simulated GPUs (the
``eight-h100`` nvidia-smi fixture: 64 GPUs at the default 8 nodes), serving ``--models``
sim models of one GPU a replica. Each model's weights load takes its size's time
(``load_s``: small 1 s, medium 2 s, large 4 s: a 60-240 s load compressed 60x); each answer
streams 16 tokens at 50 tokens/s after a 50 ms first token.

The trace: a day compressed into ``--day`` seconds (the default 240 s: 360x). Model
popularity is Zipf (s = 1.1); each model is on or off in turns (exponential periods, 1/12 of
the day on average), and the whole load follows a day's curve (a trough at 20% of the
peak). At the peak the fleet sees ``--peak`` requests per second. The same trace (one seed)
is played against:

- static: every model always has the replicas its share of the day's average demand gives
  it (at least one), the 64 GPUs split once, ahead of time, knowing the whole trace;
- by demand: ``replicas: {min: 0, max: 8, target_inflight: 2}`` with ``scale_down_after``
  compressed like the day (5 min -> 1 s at 360x, at least 1 s), so that a model at zero is
  started by its first request.

- with sleep: the same, but every model keeps one replica (``min: 1``), its profile sleeping
  at level 1 (a wake takes 0.3 s): an idle replica sleeps after a compressed minute (its GPU
  free for others, so it holds no GPU-hour), those above one are stopped after a compressed
  half hour, and a quiet model's request wakes its replica rather than starts one.

Reported per run: SLO attainment (the share of requests with a TTFT of at most 2 s, not
compressed: a user's wait is not), failed requests, the GPU-hours held (replicas of any
state but stopped, each its GPUs, sampled each second; the day's real hours: x the
compression), cold-start TTFT p50/p99 (the requests that waited for a replica to exist), and
llmgw's own part of each replica start (placement to routable less the engine's part, from
the shard_ready events) p50/p99. Targets (issue 39; with sleep): SLO attainment >= static's
at <= 60% of its GPU-hours, 0 failed, llmgw's part <= 300 ms p99.

It prints figures next to their targets; it is not a pass/fail test. Everything shares this
machine's CPUs.

A request "waited" when its TTFT is over 0.2 s (4x the sim's own) or the gateway kept its
stream alive: it waited for a replica to start or wake; its TTFT counts that wait.

Usage: python bench/demand.py [--nodes 8] [--models 24] [--day 240] [--peak 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from bench.tenants import percentile, say  # noqa: E402
from tests.integration.harness import (  # noqa: E402
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

EIGHT_GPUS = ROOT / "tests" / "fixtures" / "nvidia-smi" / "eight-h100"
SIZES = (("small", 1.0), ("medium", 2.0), ("large", 4.0))
SLO_S = 2.0
WAKE_S = 0.3  # a level-1 wake (weights back from host memory), compressed as the loads are
WAITED_S = 0.2  # a TTFT over this (4x the sim's own 50 ms) waited for a start or a wake
MAX_TOKENS = 16
TARGET_SHARE = 0.6
TARGET_LLMGW_P99 = 0.3
_LLMGW_PART = re.compile(r"llmgw ([0-9.]+) s\)")


@dataclass(frozen=True)
class Request:
    at: float  # seconds into the day
    model: str


@dataclass
class Outcome:
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    cold: list[float] = field(default_factory=list)  # TTFTs of requests that waited (start/wake)
    misses: list[str] = field(default_factory=list)  # those over the SLO: model, when, TTFT


def trace(models: list[str], day: float, peak: float, seed: int) -> list[Request]:
    """The day's requests: Zipf popularity, on/off bursts, a day's curve; sorted by time."""
    rng = random.Random(seed)
    weights = [1 / (i + 1) ** 1.1 for i in range(len(models))]
    total = sum(weights)
    out: list[Request] = []
    for model, weight in zip(models, weights, strict=True):
        t = 0.0
        on = rng.random() < 0.5
        while t < day:
            period = rng.expovariate(12 / day)
            if on:
                end = min(day, t + period)
                at = t
                while True:
                    curve = 0.2 + 0.8 * math.sin(math.pi * at / day) ** 2
                    # The model's share of the peak, doubled while on (on half of the time).
                    rate = max(1e-6, 2 * peak * weight / total * curve)
                    at += rng.expovariate(rate)
                    if at >= end:
                        break
                    out.append(Request(at, model))
            t += period
            on = not on
    return sorted(out, key=lambda r: r.at)


def static_split(reqs: list[Request], models: list[str], gpus: int) -> dict[str, int]:
    """The best fixed split for the day: each model its share of the requests (its average
    demand), at least one replica, the whole fleet used."""
    counts = {m: 0 for m in models}
    for r in reqs:
        counts[r.model] += 1
    total = max(1, sum(counts.values()))
    split = {m: 1 for m in models}
    spare = gpus - len(models)
    for m in sorted(models, key=lambda m: -counts[m]):
        extra = min(spare, round((gpus - len(models)) * counts[m] / total))
        split[m] += extra
        spare -= extra
    return split


class Fleet:
    def __init__(self, tmp: Path, nodes: int) -> None:
        self.server: Server = start_server_with(
            tmp, heartbeat=1.0, queue_timeout=120, replica_wait=30
        )
        self.agents: list[Agent] = []
        for i in range(nodes):
            extra = {"discovery": {"nvidia_smi": str(EIGHT_GPUS)}}
            self.agents.append(start_agent(make_agent(tmp, self.server, f"gpu-{i}", extra=extra)))
        wait_for(
            lambda: sum(n["connected"] for n in self.server.nodes()) == nodes,
            timeout=120,
            what="the agents",
        )
        self.server.approve_pending(nodes)
        wait_for(
            lambda: sum(1 for n in self.server.nodes() if n["engines"]) == nodes,
            timeout=120,
            what="the agents' engines",
        )
        self.key = str(self.server.api("POST", "/api/keys", {"name": "bench"})["key"])

    def deploy(self, name: str, load_s: float, replicas: Any, *, sleeps: bool) -> None:
        """``name`` from the catalog: one GPU a replica, its load ``load_s``; ``sleeps``: its
        profile sleeps at level 1 (waking takes WAKE_S)."""
        params = {"load_s": load_s, "ttft_ms": 50, "tps": 50, "max_tokens": MAX_TOKENS}
        profile: dict[str, Any] = {"engine": "sim", "gpus": 1}
        if sleeps:
            params["wake_seconds"] = WAKE_S
            profile["sleep"] = {"level": 1}
        profile["params"] = {k: str(v) for k, v in params.items()}
        self.server.api(
            "PUT", "/api/catalog", {"models": {name: {"profiles": {"default": profile}}}}
        )
        body = {"name": name, "profile": "default", "replicas": replicas}
        self.server.api("POST", "/api/models", body)

    def undeploy_all(self) -> None:
        for m in self.server.api("GET", "/api/models"):
            self.server.api("DELETE", f"/api/models/{m['name']}")
        wait_for(lambda: not self.server.replicas(), timeout=120, what="every replica gone")

    def stop(self) -> None:
        for agent in self.agents:
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(self.server.proc)


async def play(fleet: Fleet, reqs: list[Request], outcome: Outcome) -> None:
    """Each request at its time (open loop), streamed; its TTFT, or why it failed."""
    url = fleet.server.url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {fleet.key}"}
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        began = time.monotonic()

        async def one(r: Request) -> None:
            await asyncio.sleep(max(0.0, r.at - (time.monotonic() - began)))
            body = {
                "model": r.model,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": MAX_TOKENS,
                "stream": True,
            }
            sent = time.monotonic()
            first: float | None = None
            waited = False
            try:
                async with session.post(url, json=body, headers=headers) as resp:
                    if resp.status != 200:
                        outcome.failed.append(f"{r.model}: {resp.status} {await resp.text()}")
                        return
                    async for line in resp.content:
                        if line.startswith(b":"):
                            waited = True  # the gateway's keep-alive: a cold start
                        elif line.startswith(b"data: {") and first is None:
                            if b'"error"' in line:
                                outcome.failed.append(f"{r.model}: {line[:200]!r}")
                                return
                            first = time.monotonic() - sent
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcome.failed.append(f"{r.model}: {type(exc).__name__}: {exc}")
                return
            if first is None:
                outcome.failed.append(f"{r.model}: no token")
                return
            outcome.ok += 1
            outcome.ttft.append(first)
            if waited or first > WAITED_S:
                outcome.cold.append(first)
            if first > SLO_S:
                outcome.misses.append(f"{r.model} at {r.at:.1f} s: TTFT {first:.2f} s")

        await asyncio.gather(*(one(r) for r in reqs))


def held_gpu_seconds(fleet: Fleet, stop: threading.Event, out: list[float]) -> None:
    """Each second, the replicas holding a GPU (any state but asleep or gone), one each."""
    while not stop.wait(1.0):
        try:
            rows = fleet.server.replicas()
            out.append(float(len({r["replica"] for r in rows if r["state"] != "asleep"})))
        except Exception:  # the server is busy: the next sample counts
            continue


def llmgw_parts(fleet: Fleet, since: float) -> list[float]:
    """llmgw's part of each replica start since ``since`` (UNIX seconds), from the events."""
    events = fleet.server.api("GET", "/api/events?limit=5000")
    return [
        float(m.group(1))
        for e in events
        if e["kind"] == "shard_ready"
        and e["ts"] >= since
        and (m := _LLMGW_PART.search(e["message"]))
    ]


def run(
    fleet: Fleet,
    name: str,
    reqs: list[Request],
    deploy: dict[str, Any],
    day: float,
    *,
    sleeps: bool = False,
) -> dict[str, Any]:
    say(f"{name}: deploying {len(deploy)} models")
    since = time.time()
    sizes = {m: SIZES[i % len(SIZES)][1] for i, m in enumerate(sorted(deploy))}
    for model, replicas in deploy.items():
        fleet.deploy(model, sizes[model], replicas, sleeps=sleeps)
    # A run starts as its fleet stands: static with its split placed, with sleep with each
    # model's floor of one (min: 1) loaded; by demand from nothing (min: 0).
    wanted = sum(floor(r) for r in deploy.values())
    if wanted:
        wait_for(
            lambda: (
                sum(1 for r in fleet.server.replicas() if r["routable"] or r["state"] == "asleep")
                == wanted
            ),
            timeout=300,
            what=f"{wanted} replicas of {name}",
        )
    samples: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=held_gpu_seconds, args=(fleet, stop, samples), daemon=True)
    sampler.start()
    outcome = Outcome()
    say(f"{name}: playing {len(reqs)} requests over {day:g} s")
    asyncio.run(play(fleet, reqs, outcome))
    stop.set()
    sampler.join()
    parts = llmgw_parts(fleet, since)
    events = [e for e in fleet.server.api("GET", "/api/events?limit=5000") if e["ts"] >= since]
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    wakes = kinds.get("replica_awake", 0)
    retired: dict[str, int] = {}  # why replicas were retired, their figures left out
    for e in events:
        if e["kind"] == "replica_retiring":
            why = re.sub(r"[0-9a-f]{6,}|\b\d+\b|m\d\d", "#", e["message"])
            retired[why] = retired.get(why, 0) + 1
    fleet.undeploy_all()
    ttft = outcome.ttft
    return {
        "requests": len(reqs),
        "ok": outcome.ok,
        "failed": len(outcome.failed),
        "failures": outcome.failed[:5],
        "slo_attainment": sum(1 for t in ttft if t <= SLO_S) / max(1, len(reqs)),
        "gpu_seconds": sum(samples),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "cold_requests": len(outcome.cold),
        "cold_ttft_p50": percentile(outcome.cold, 50),
        "cold_ttft_p99": percentile(outcome.cold, 99),
        "starts": len(parts),
        "llmgw_start_p50": percentile(parts, 50),
        "llmgw_start_p99": percentile(parts, 99),
        "wakes": wakes,
        "misses": outcome.misses[:200],
        "events": dict(sorted(kinds.items())),
        "retired": retired,
    }


def floor(replicas: Any) -> int:
    """The replicas a deployment's ``replicas`` keeps at the least."""
    return int(replicas["min"]) if isinstance(replicas, dict) else int(replicas)


RUNS = (("static", "static"), ("demand", "by demand"), ("sleep", "with sleep"))


def render(fig: dict[str, Any]) -> str:
    ran = [(name, label) for name, label in RUNS if name in fig]
    first = fig[ran[0][0]]
    lines = [
        f"fleet: {fig['gpus']} GPUs on {fig['nodes']} nodes, {fig['models']} models; a day in "
        f"{fig['day']:g} s ({fig['compression']:.0f}x), {first['requests']} requests",
        f"{'':20}" + "".join(f"{label:>12}" for _, label in ran),
    ]
    for key, label, fmt in (
        ("slo_attainment", "SLO (<=2 s)", "{:.1%}"),
        ("failed", "failed", "{}"),
        ("gpu_seconds", "GPU-hours", "gpuh"),
        ("ttft_p50", "TTFT p50 s", "{:.3f}"),
        ("ttft_p99", "TTFT p99 s", "{:.3f}"),
        ("cold_requests", "waited (start/wake)", "{}"),
        ("cold_ttft_p50", "  their TTFT p50", "{:.2f}"),
        ("cold_ttft_p99", "  their TTFT p99", "{:.2f}"),
        ("starts", "starts", "{}"),
        ("llmgw_start_p50", "llmgw start p50", "{:.3f}"),
        ("llmgw_start_p99", "llmgw start p99", "{:.3f}"),
        ("wakes", "wakes", "{}"),
    ):
        cells = []
        for run_ in (fig[name] for name, _ in ran):
            value = run_[key]
            if fmt == "gpuh":
                cells.append(f"{value * fig['compression'] / 3600:.1f}")
            else:
                cells.append(fmt.format(value))
        lines.append(f"{label:20}" + "".join(f"{c:>12}" for c in cells))
    if "static" in fig and "sleep" in fig:
        static, sleep = fig["static"], fig["sleep"]
        share = sleep["gpu_seconds"] / max(1e-9, static["gpu_seconds"])
        parts = [fig[n]["llmgw_start_p99"] for n in ("demand", "sleep") if n in fig]
        lines.append(
            f"with sleep: {share:.0%} of static's GPU-hours (target <= {TARGET_SHARE:.0%}) at "
            f"{sleep['slo_attainment']:.1%} SLO attainment (static's: "
            f"{static['slo_attainment']:.1%}); llmgw's part of a start p99 "
            f"{max(parts):.3f} s (target <= {TARGET_LLMGW_P99} s)"
        )
    for name, label in ran:
        for failure in fig[name]["failures"]:
            lines.append(f"failed ({label}): {failure[:300]}")
        misses = fig[name]["misses"]
        if misses and name != "static":
            lines.append(f"over the SLO ({label}), first {len(misses)}: " + "; ".join(misses[:8]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--models", type=int, default=24)
    parser.add_argument("--day", type=float, default=240.0, help="seconds a day takes")
    parser.add_argument("--peak", type=float, default=10.0, help="requests/s at the peak")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--runs", default="static,demand,sleep", help="which runs, comma-separated (all three)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = sorted(set(runs) - {name for name, _ in RUNS})
    if unknown or not runs:
        parser.error(f"--runs: unknown {', '.join(unknown) or 'nothing'}; give static,demand,sleep")
    gpus = 8 * args.nodes
    if args.models > gpus:
        parser.error(f"--models {args.models} is more than the fleet's {gpus} GPUs")
    models = [f"m{i:02d}" for i in range(args.models)]
    reqs = trace(models, args.day, args.peak, args.seed)
    compression = 86400 / args.day
    window = max(1.0, 300 / compression)
    policy = {"min": 0, "max": 8, "target_inflight": 2, "scale_down_after": window,
              "cold_start_timeout": 120}  # fmt: skip
    fig: dict[str, Any] = {
        "nodes": args.nodes,
        "gpus": gpus,
        "models": args.models,
        "day": args.day,
        "compression": compression,
    }
    # With sleep: every model keeps one replica, asleep when idle (a compressed minute), so
    # that a quiet model's request wakes it rather than starts it; the replicas above it are
    # stopped after a compressed half hour.
    sleepy = {
        **policy,
        "min": 1,
        "sleep_after": max(0.5, 60 / compression),
        "scale_down_after": max(2.0, 1800 / compression),
    }
    plans = {
        "static": (static_split(reqs, models, gpus), False),
        "demand": (dict.fromkeys(models, policy), False),
        "sleep": (dict.fromkeys(models, sleepy), True),
    }
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-demand-") as tmp:
        fleet = Fleet(Path(tmp), args.nodes)
        try:
            for name in runs:
                deploy, sleeps = plans[name]
                fig[name] = run(fleet, name, reqs, deploy, args.day, sleeps=sleeps)
        finally:
            fleet.stop()
    print(json.dumps(fig, indent=2) if args.json else render(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
