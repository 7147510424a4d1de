#!/usr/bin/env python3
"""Benchmark: disaggregated prefill/decode against aggregated serving, on the same sim GPUs.

A real ``llmgw server`` with one real agent whose eight GPUs are simulated (the
``eight-h100`` nvidia-smi fixture), serving sim replicas of one GPU each, in turn:

- aggregated: ``--gpus`` replicas (default 8), each prefilling and decoding;
- disaggregated, for each of ``--splits`` P:D (default 5:3, 6:2, 7:1): a profile with
  ``disaggregated: {prefill: {gpus: 1, replicas: P}, decode: {gpus: 1, replicas: D}}``, the
  gateway driving the hand-over (vLLM's protocol: a prefill with ``max_tokens: 1`` whose
  ``kv_transfer_params`` the decode request carries) and the decode replicas pulling the
  prompt's KV from the prefill's over a real TCP connection.

Costs as bench/routing.py's (0.1 ms a prompt token, 10 ms a generated token), with the sim's
step model ON in both arms (``step_model``: every decoding stream advances one token a step;
a step lasts 1/tps plus the prompt tokens prefilled in it, at most ``prefill_chunk`` = 2,048
of them, vLLM's chunked prefill): a long prompt on an aggregated replica stretches the steps
of every stream decoding beside it, which is what disaggregation removes. A replica serves
128 streams at once. The splits lean to prefill: the sim's step costs the same whatever its
batch, so decoding takes few GPUs and prefill most (a prefill replica is no faster than an
aggregated one: P of 8 GPUs prefill P/8 of what 8 aggregated replicas do).

Time is dilated ``--scale`` times (default 6): every cost runs that much slower, so that two
shared cores can relay every token of hundreds of streams (each token is a wake-up of the
sim, the agent, the gateway and the client); every figure is shown back in the GPU's time
(measured times divided by the scale, rates multiplied by it), and the SLOs are the GPU's.
The KV moves ``--kv-bytes-per-token`` (default 4 KiB) over loopback, paced (the sim's
``kv_transfer_mibps``) so that a transfer takes what the model's 128 KiB a token
(Llama-3-8B, fp16) takes over ``--fabric-gbps`` (default 400 Gb/s), dilated as the rest:
the bytes stay cheap on these cores, the time is a fabric's.

The workload: ``--long-share`` (default 0.1) of 8,192-token prompts among short chat turns of
100-300 tokens, each answer 100-200 tokens (``ignore_eos``), every prompt unique (no prefix
cache help), Poisson arrivals at each of ``--loads`` (default 50/70/90%) of the aggregated
capacity (prefill-bound: a saturated replica's steps each prefill a whole chunk; or its
streams' slots, whichever is less). First the counter-case, where disaggregation should not
pay: short prompts only, at each of ``--counter`` (default 5% and 20%) of their own
capacity. Each arm runs the phases back to back, ``--duration`` seconds of arrivals each
(bench time, default 16), the same arrivals for every arm; the first ``--warmup`` share of a
phase (its passage from the last) is not counted. Each request is a streamed chat
completion through the gateway with the official ``openai`` client, which stamps each
content chunk on arrival.

Reported per arm and phase, in its counted window: TTFT p50/p90 and goodput (requests per
second with TTFT <= 2 s and every inter-token gap <= 50 ms) of the requests that arrived in
it; inter-token latency p50/p99 (between a stream's content chunks) and output tokens per
second of every stream while it lasted; the hand-over p50/p99 (the gateway's
``llmgw_disagg_handover_seconds``, the prefill's answer to the decode's first token: the KV
pull and a first step, interpolated within its buckets, every hand-over of the phase);
failed requests (an error, or fewer tokens than asked) and the gateway's aggregated
fallbacks (``llmgw_disagg_fallbacks_total``). Targets (issue 41): the best split's ITL p99
>= 3x lower than aggregated's at equal or better throughput; goodput higher at 70% and 90%;
and in the counter-case, no gain: TTFT worse, goodput no higher.

It prints figures next to their targets; it is not a pass/fail test. Client, gateway, agent
and engines share this machine's CPUs.

Usage: python bench/disagg.py [--gpus 8] [--splits 5:3,6:2,7:1] [--loads 0.5,0.7,0.9]
    [--long-share 0.1] [--counter 0.05,0.2] [--scale 6] [--duration 16] [--warmup 0.25]
    [--kv-bytes-per-token 4096] [--fabric-gbps 400] [--json]
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
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import openai  # noqa: E402

from bench.demand import EIGHT_GPUS  # noqa: E402
from bench.disagg_report import bucket_quantile, delta, parse, render, sim_counters  # noqa: E402
from bench.routing import PREFILL_US, TPS, words  # noqa: E402
from bench.tenants import percentile, say  # noqa: E402
from llmgw.contracts.disagg import pool_name  # noqa: E402
from llmgw.engines.sim import PARAMS as SIM_PARAMS  # noqa: E402
from tests.integration.harness import (  # noqa: E402
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

LONG_TOKENS = 8192
SHORT_TOKENS = (100, 300)
OUTPUT_TOKENS = (100, 200)
MAX_LENGTH = 16384  # an 8k prompt and its answer
MAX_CONCURRENCY = 128  # streams a replica serves at once (each pool's replicas alike)
PREFILL_CHUNK = 2048  # prompt tokens a step takes (vLLM's chunked prefill budget)
KV_BYTES_PER_TOKEN = 4096
MODEL_KV_BYTES_PER_TOKEN = 128 * 1024  # Llama-3-8B in fp16: 2 x 32 layers x 8 KV heads x 128
FABRIC_GBPS = 400.0  # one 400 Gb/s NIC (InfiniBand NDR) per GPU
TTFT_SLO = 2.0  # seconds, GPU time
ITL_SLO = 0.050
TRANSFER_TIMEOUT = 30.0  # GPU time; x scale in the profile
STEP_PARAMS = ("step_model", "prefill_chunk", "kv_bytes_per_token")
PACED = "kv_transfer_mibps"  # the sim's fabric bandwidth, where it has one


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Request:
    phase: int
    at: float  # seconds after the arm's first phase began, bench time
    prompt: str
    long: bool
    max_tokens: int


@dataclass
class Outcome:
    request: Request
    ttft: float | None = None  # bench seconds
    stamps: list[float] = field(default_factory=list)  # content chunks' arrivals, perf_counter
    output: int = 0
    error: str = ""

    @property
    def gaps(self) -> list[float]:
        """The inter-token latencies: between its content chunks' arrivals."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]


@dataclass(frozen=True)
class Costs:
    """The sim's costs in bench time: the GPU's, ``scale`` times slower."""

    scale: float

    @property
    def step_s(self) -> float:
        return self.scale / TPS

    @property
    def prefill_s(self) -> float:  # per prompt token
        return PREFILL_US * self.scale / 1e6

    def capacity(self, long_share: float, gpus: int) -> float:
        """Requests per second (bench time) ``gpus`` aggregated replicas serve: prefill-bound
        (a saturated replica's steps each prefill a whole chunk beside their decode) or
        bound by the streams' slots, whichever is less."""
        prompt = long_share * LONG_TOKENS + (1 - long_share) * sum(SHORT_TOKENS) / 2
        output = sum(OUTPUT_TOKENS) / 2
        chunk_step = self.step_s + PREFILL_CHUNK * self.prefill_s
        prefill_bound = gpus * PREFILL_CHUNK / chunk_step / prompt
        slot_s = output * self.step_s + prompt / (PREFILL_CHUNK / chunk_step)
        return min(prefill_bound, gpus * MAX_CONCURRENCY / slot_s)


def arrivals(phase: int, rate: float, start: float, duration: float, long_share: float,
             seed: int) -> list[Request]:  # fmt: skip
    """Poisson arrivals at ``rate`` from ``start`` for ``duration`` s, each prompt its own
    words (unique: its first block names the request, so no prefix is shared)."""
    times = random.Random(seed)
    rng = random.Random(seed + 1)
    out: list[Request] = []
    at = times.expovariate(rate)
    while at < duration:
        long = rng.random() < long_share
        n = LONG_TOKENS if long else rng.randint(*SHORT_TOKENS)
        prompt = f"Request {seed}-{len(out)}. " + words(rng, n - 3)
        out.append(Request(phase, start + at, prompt, long, rng.randint(*OUTPUT_TOKENS)))
        at += times.expovariate(rate)
    return out


async def one(client: openai.AsyncOpenAI, model: str, req: Request, t0: float) -> Outcome:
    """``req`` at its time: a streamed chat completion; its chunks stamped on arrival."""
    await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
    out = Outcome(req)
    started = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": req.prompt}],
            max_tokens=req.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                if not out.stamps:
                    out.ttft = now - started
                out.stamps.append(now)
            if chunk.usage is not None:
                out.output = chunk.usage.completion_tokens
    except openai.OpenAIError as exc:
        out.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    if not out.error and out.ttft is None:
        out.error = "no content"
    elif not out.error and out.output != req.max_tokens:  # ignore_eos: exactly max_tokens
        out.error = f"{out.output} tokens of {req.max_tokens}"
    return out


async def play(
    server: Server, key: str, model: str, reqs: list[Request], phases: int, duration: float
) -> tuple[list[Outcome], float, list[dict[str, Any]]]:
    """Every phase's requests, back to back; the gateway's /metrics read as each phase
    begins and once all have answered (so each phase's hand-overs are told apart)."""
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=600.0
    )
    snapshots: list[dict[str, Any]] = []

    async def scrape_at(at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        snapshots.append(parse(await asyncio.to_thread(server.metrics), model))

    async with client:
        t0 = time.perf_counter() + 0.5
        scrapes = [asyncio.create_task(scrape_at(t0 + k * duration)) for k in range(phases)]
        outs = await asyncio.gather(*(one(client, model, r, t0) for r in reqs))
        await asyncio.gather(*scrapes)
        snapshots.append(parse(await asyncio.to_thread(server.metrics), model))
    return list(outs), t0, snapshots


# --------------------------------------------------------------------------- figures


def summary(
    outs: list[Outcome],
    phase: int,
    t0: float,
    duration: float,
    warmup: float,
    costs: Costs,
    metrics: dict[str, Any],
) -> dict[str, Any]:
    """Phase ``phase``'s figures in the GPU's time (bench seconds / scale): TTFT and goodput
    of the requests that arrived in its counted window; inter-token latencies and
    throughput of every stream while that window lasted (what this load did to them)."""
    s = costs.scale
    since, until = t0 + (phase + warmup) * duration, t0 + (phase + 1) * duration
    counted = [o for o in outs if o.request.phase == phase and since <= t0 + o.request.at < until]
    ok = [o for o in counted if not o.error]
    window = (until - since) / s  # GPU seconds
    ttft = [o.ttft / s for o in ok if o.ttft is not None]
    gaps = [
        (b - a) / s
        for o in outs
        for a, b in zip(o.stamps, o.stamps[1:], strict=False)
        if since <= b < until
    ]
    good = [
        o
        for o in ok
        if o.ttft is not None and o.ttft / s <= TTFT_SLO and all(g / s <= ITL_SLO for g in o.gaps)
    ]
    # Throughput: the tokens that reached the client in the window, every stream's: what the
    # arm delivered under this load; one that falls behind delivers fewer.
    delivered = sum(1 for o in outs for t in o.stamps if since <= t < until)
    fig: dict[str, Any] = {
        "sent": len(counted),
        "long": sum(1 for o in counted if o.request.long),
        "ok": len(ok),
        "failed": len(counted) - len(ok),
        "failures": sorted({o.error for o in counted if o.error})[:3],
        "ttft_p50_ms": round(percentile(ttft, 50) * 1000, 1),
        "ttft_p90_ms": round(percentile(ttft, 90) * 1000, 1),
        "itl_p50_ms": round(percentile(gaps, 50) * 1000, 1),
        "itl_p99_ms": round(percentile(gaps, 99) * 1000, 1),
        "output_tps": round(delivered / window, 1),
        "goodput_rps": round(len(good) / window, 2),
        "goodput_share": round(len(good) / len(counted), 3) if counted else math.nan,
    }
    buckets = metrics["buckets"]
    handed = max(buckets.values(), default=0.0)
    fig["handovers"] = int(handed)
    fig["handover_p50_ms"] = round(bucket_quantile(buckets, 0.5) / s * 1000, 1)
    fig["handover_p99_ms"] = round(bucket_quantile(buckets, 0.99) / s * 1000, 1)
    fig["fallbacks"] = int(sum(metrics["fallbacks"].values()))
    fig["fallback_reasons"] = {k: int(v) for k, v in metrics["fallbacks"].items() if v}
    return fig


# --------------------------------------------------------------------------- the deployments


def interference_params() -> list[str]:
    """The step model's sim params this llmgw lacks (the bench needs them in both arms)."""
    return [p for p in STEP_PARAMS if p not in SIM_PARAMS]


def transfer_mibps(costs: Costs, kv_bytes: int, gbps: float) -> float:
    """The bandwidth the sim sends ``kv_bytes`` a token at, so that a transfer takes what the
    model's real KV takes over a ``gbps`` fabric, dilated as every cost (0: unpaced)."""
    if gbps <= 0 or kv_bytes <= 0:
        return 0.0
    real_s_per_token = MODEL_KV_BYTES_PER_TOKEN / (gbps * 1e9 / 8)
    return kv_bytes / (real_s_per_token * costs.scale) / 2**20


def profile(
    costs: Costs, split: tuple[int, int] | None, kv_bytes: int, gbps: float
) -> dict[str, Any]:
    params: dict[str, Any] = {
        "prefill_us_per_token": PREFILL_US * costs.scale,
        "tps": TPS / costs.scale,
        "max_length": MAX_LENGTH,
    }
    if not interference_params():
        params |= {"step_model": "true", "prefill_chunk": PREFILL_CHUNK}
    # Unconfined: a sandbox (bwrap) changes no timing here, and the bench needs none.
    out: dict[str, Any] = {
        "engine": "sim",
        "gpus": 1,
        "max_concurrency": MAX_CONCURRENCY,
        "sandbox": False,
    }
    if split is not None:
        params["kv_bytes_per_token"] = kv_bytes
        if PACED in SIM_PARAMS and (mibps := transfer_mibps(costs, kv_bytes, gbps)):
            params[PACED] = round(mibps, 3)
        out["disaggregated"] = {
            "prefill": {"gpus": 1, "replicas": split[0]},
            "decode": {"gpus": 1, "replicas": split[1]},
            "transfer_timeout": TRANSFER_TIMEOUT * costs.scale,
        }
    out["params"] = {k: str(v) for k, v in params.items()}
    return out


def arm_name(split: tuple[int, int] | None) -> str:
    return "aggregated" if split is None else f"disagg {split[0]}:{split[1]}"


def model_of(split: tuple[int, int] | None) -> str:
    return "chat-agg" if split is None else f"chat-pd{split[0]}-{split[1]}"


class Cluster:
    """One ``llmgw server`` and one agent with eight simulated GPUs."""

    def __init__(self, tmp: Path) -> None:
        self.server = start_server_with(tmp, queue_timeout=600, max_inflight_body_bytes="1GiB")
        extra = {"discovery": {"nvidia_smi": str(EIGHT_GPUS)}}
        self.agent = start_agent(make_agent(tmp, self.server, "node-a", extra=extra))
        wait_for(lambda: any(n["connected"] for n in self.server.nodes()), what="the agent")
        self.server.approve_pending(1)
        wait_for(lambda: self.server.nodes()[0]["engines"], timeout=120, what="its engines")
        self.key = str(self.server.api("POST", "/api/keys", {"name": "bench"})["key"])

    def deploy(
        self, model: str, prof: dict[str, Any], split: tuple[int, int] | None, gpus: int
    ) -> None:
        catalog = {"models": {model: {"profiles": {"default": prof}}}}
        self.server.api("PUT", "/api/catalog", catalog)
        body: dict[str, Any] = {"name": model, "profile": "default"}
        if split is None:
            body["replicas"] = gpus
            wanted = {model: gpus}
        else:
            wanted = {pool_name(model, "prefill"): split[0], pool_name(model, "decode"): split[1]}
        self.server.api("POST", "/api/models", body)

        def ready() -> bool:
            rows = self.server.replicas()
            # A pool's replica is listed under its model, its pool beside (stage's listing).
            return all(
                sum(1 for r in rows if (r.get("pool") or r["model"]) == m and r["routable"]) == n
                for m, n in wanted.items()
            )

        wait_for(ready, timeout=180, what=f"the replicas of {model}: {wanted}")

    def engine_counters(self, model: str) -> dict[str, float]:
        """The KV transfer counters of ``model``'s sim engines, summed (their own /metrics:
        the pulls, bytes and failed pulls that the decodes recomputed)."""
        total: dict[str, float] = {}
        for row in self.server.replicas():
            if row["model"] != model or not row.get("port"):
                continue
            url = f"http://127.0.0.1:{row['port']}/metrics"
            with urllib.request.urlopen(url, timeout=10) as resp:
                for name, value in sim_counters(resp.read().decode()).items():
                    total[name] = total.get(name, 0.0) + value
        return total

    def undeploy(self, model: str) -> None:
        self.server.api("DELETE", f"/api/models/{model}")
        wait_for(
            lambda: not [r for r in self.server.replicas() if r["model"] == model],
            timeout=120,
            what=f"{model} gone",
        )

    def stop(self) -> None:
        if self.agent.proc is not None:
            stop_process(self.agent.proc)
        stop_process(self.server.proc)


@dataclass(frozen=True)
class Phase:
    label: str
    load: float  # share of the workload's aggregated capacity
    rate: float  # arrivals per second, bench time
    long_share: float
    seed: int


def phases_of(args: argparse.Namespace, costs: Costs) -> list[Phase]:
    """The counter-case first (short prompts only, at each of ``--counter`` of their own
    capacity: the lowest loads, the first run from idle), then the mixed workload at each of ``--loads`` in the
    order given; each phase's arrivals its own seed's, the same for every arm."""
    out = [
        Phase(f"{load:.0%} short only", load, load * costs.capacity(0.0, args.gpus), 0.0, 900 + i)
        for i, load in enumerate(args.counter)
    ]
    cap = costs.capacity(args.long_share, args.gpus)
    tag = "" if args.long_share else " short only"
    out += [
        Phase(f"{load:.0%}{tag}", load, load * cap, args.long_share, 100 + i)
        for i, load in enumerate(args.loads)
    ]
    return out


def run_arms(args: argparse.Namespace, costs: Costs) -> dict[str, Any]:
    phases = phases_of(args, costs)
    per = [
        arrivals(k, p.rate, k * args.duration, args.duration, p.long_share, p.seed)
        for k, p in enumerate(phases)
    ]
    reqs = [r for phase in per for r in phase]
    fig: dict[str, Any] = {"phases": {}, "arms": {}, "engines": {}}
    for p, mine in zip(phases, per, strict=True):
        fig["phases"][p.label] = {
            "load": p.load,
            "rate_rps": round(p.rate * costs.scale, 2),
            "long_share": p.long_share,
            "requests": len(mine),
            "long": sum(1 for r in mine if r.long),
        }
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-bench-disagg-")))
    try:
        for split in [None, *args.splits]:
            model, name = model_of(split), arm_name(split)
            say(f"{name}: deploying")
            prof = profile(costs, split, args.kv_bytes_per_token, args.fabric_gbps)
            cluster.deploy(model, prof, split, args.gpus)
            say(
                f"{name}: {len(reqs)} requests, "
                + ", ".join(f"{p.label} for {args.duration:g} s" for p in phases)
            )
            job = play(cluster.server, cluster.key, model, reqs, len(phases), args.duration)
            outs, t0, snaps = asyncio.run(job)
            by_load: dict[str, Any] = {}
            for k, p in enumerate(phases):
                metrics = delta(snaps[k + 1], snaps[k])
                fig_k = summary(outs, k, t0, args.duration, args.warmup, costs, metrics)
                by_load[p.label] = fig_k
                say(f"  {p.label}: {fig_k}")
            fig["arms"][name] = by_load
            if split is not None:
                fig["engines"][name] = cluster.engine_counters(model)
            cluster.undeploy(model)
    finally:
        cluster.stop()
    return fig


def _splits(text: str) -> list[tuple[int, int]]:
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        m = re.fullmatch(r"(\d+):(\d+)", part)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise argparse.ArgumentTypeError(
                f"{part!r} is no split: give PREFILL:DECODE replicas, each at least 1, e.g. 5:3"
            )
        out.append((int(m.group(1)), int(m.group(2))))
    return out


def _shares(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(not 0 < x <= 2 for x in out):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give shares of capacity over 0 (at most 2), comma-separated, e.g. 0.5,0.9"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8, help="sim GPUs in each arm (at most 8)")
    parser.add_argument(
        "--splits",
        type=_splits,
        default=[(5, 3), (6, 2), (7, 1)],
        help="prefill:decode replicas, comma-separated",
    )
    parser.add_argument(
        "--loads",
        type=_shares,
        default=[0.5, 0.7, 0.9],
        help="shares of the aggregated capacity, comma-separated",
    )
    parser.add_argument(
        "--long-share", type=float, default=0.1, help=f"share of {LONG_TOKENS}-token prompts"
    )
    parser.add_argument(
        "--counter",
        type=lambda text: [] if text.strip() in ("", "0") else _shares(text),
        default=[0.05, 0.2],
        help="the counter-case's shares of capacity, short prompts only, comma-separated (0: none)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=6.0,
        help="time dilation: the costs run this many times slower",
    )
    parser.add_argument(
        "--duration", type=float, default=16.0, help="seconds of arrivals a phase (bench time)"
    )
    parser.add_argument(
        "--warmup", type=float, default=0.25, help="share of each phase's arrivals not counted"
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=KV_BYTES_PER_TOKEN,
        help="KV bytes a prompt token moves over loopback (the model's real KV is "
        f"{MODEL_KV_BYTES_PER_TOKEN // 1024} KiB: the fabric's pace makes up for the rest)",
    )
    parser.add_argument(
        "--fabric-gbps",
        type=float,
        default=FABRIC_GBPS,
        help="the fabric a transfer's time stands for (0: as fast as loopback goes)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 1 <= args.gpus <= 8:
        parser.error(f"--gpus {args.gpus}: the agent has 8 simulated GPUs; give 1 to 8")
    wrong = [f"{p}:{d}" for p, d in args.splits if p + d != args.gpus]
    if wrong:
        parser.error(f"--splits {', '.join(wrong)}: each must use the --gpus {args.gpus} GPUs")
    if not 0 <= args.long_share <= 1:
        parser.error(f"--long-share {args.long_share}: give a share from 0 to 1")
    if args.scale < 1 or args.duration <= 0 or not 0 <= args.warmup < 1:
        parser.error("--scale takes 1 or more, --duration over 0, --warmup 0 to under 1")
    if args.kv_bytes_per_token < 0 or args.fabric_gbps < 0:
        parser.error("--kv-bytes-per-token and --fabric-gbps take 0 or more")
    costs = Costs(args.scale)
    missing = interference_params()
    if missing:
        say(f"this sim lacks {', '.join(missing)}: the step model is OFF (figures not comparable)")
    fig: dict[str, Any] = {
        "gpus": args.gpus,
        "scale": args.scale,
        "long_share": args.long_share,
        "duration": args.duration,
        "warmup": args.warmup,
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "fabric_gbps": args.fabric_gbps if PACED in SIM_PARAMS else 0.0,
        "model_kv_bytes_per_token": MODEL_KV_BYTES_PER_TOKEN,
        "interference": not missing,
        "missing_params": missing,
        "capacity_rps": round(costs.capacity(args.long_share, args.gpus) * args.scale, 2),
        "engine": {
            "prefill_ms_per_token": PREFILL_US / 1000,
            "decode_ms_per_token": 1000 / TPS,
            "prefill_chunk": PREFILL_CHUNK,
            "max_concurrency": MAX_CONCURRENCY,
        },
        "workload": {
            "long_tokens": LONG_TOKENS,
            "short_tokens": SHORT_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
        },
        "slo": {"ttft_s": TTFT_SLO, "itl_ms": ITL_SLO * 1000},
    }
    fig |= run_arms(args, costs)
    print(json.dumps(fig, indent=2) if args.json else render(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
