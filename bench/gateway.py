#!/usr/bin/env python3
"""Benchmark: the sim engine hit directly vs through the gateway and the agent.

Starts ``llmgw up`` (control plane + one agent + one ``sim`` engine, all on loopback) in a
temporary state directory, then measures, alternating the two targets so that both see the
same machine conditions:

1. unary latency at concurrency 1 (non-streamed chat completions, 16 tokens);
2. throughput at concurrency 64 (non-streamed, fixed duration, two rounds);
3. SSE at concurrency 1 with 64 tokens: time to first content chunk and inter-chunk gaps;
4. 256 concurrent SSE streams through the gateway, twice (the first burst opens new
   gateway -> agent connections, the second reuses them): chunks received vs expected;
5. long answers: 512-token streams (vLLM's ``ignore_eos``) at concurrency 8, direct and
   proxied, and the CPU each process spends per streamed chunk: each hop's cost of relaying
   a realistic answer, not of a request's set-up.

Throughput also reports the CPU each process spends per request (from /proc), which says
where the time goes and what ratio a CPU-bound machine allows, and each hop's (the gateway's
and the agent's) against its target. The cluster runs on the loop llmgw/loop.py picks
(uvloop where installed); ``LLMGW_EVENT_LOOP=asyncio`` runs it on asyncio's, to compare.

"direct" is the engine's own plain-HTTP port; "proxied" is client -> gateway (HTTP) ->
agent data plane (mTLS) -> engine. It prints figures next to their targets; it is not a
pass/fail test. The client, gateway, agent and engine share this machine's CPUs, so on a
small machine the figures are pessimistic.

Usage: python bench/gateway.py [--requests N] [--duration S] [--streams N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from llmgw.loop import choose as choose_event_loop
from llmgw.sim.config import SimConfig
from llmgw.sim.generate import MAX_LENGTH, generate

T = TypeVar("T")

MODEL = "llmgw-sim"
UNARY_MAX_TOKENS = 16
STREAM_TOKENS = MAX_LENGTH  # 64
WARMUP = 200
CONCURRENCY = 64
THROUGHPUT_ROUNDS = 2
THROUGHPUT_WARMUP_S = 0.5
MANY_STREAMS = 256
LONG_TOKENS = 512
LONG_STREAMS = 32
LONG_CONCURRENCY = 8
SEED_SEARCH = range(1001)

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
REQUEST_TIMEOUT_S = 30.0
PHASE_TIMEOUT_S = 300.0
MAX_REQUESTS_PER_WORKER = 10_000_000

TARGET_ADDED_P99_MS = 1.5
TARGET_THROUGHPUT_RATIO = 0.5
TARGET_CHUNKS_LOST = 0
TARGET_CPU_US_PER_HOP = 80.0  # CPU per proxied request in the gateway, and in the agent

NS_PER_MS = 1_000_000


def say(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


class BenchError(Exception):
    pass


class Interrupted(BenchError):
    pass


class _Stop:
    """Set by SIGINT/SIGTERM; every measuring loop checks it (a cancellation alone can be
    swallowed by ``asyncio.wait_for`` on Python 3.11)."""

    requested = False


def stopping() -> bool:
    return _Stop.requested


# --------------------------------------------------------------------------- figures


def percentile(values: list[int], p: float) -> float:
    """Nearest-rank percentile of ``values`` (nanoseconds) in milliseconds; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1] / NS_PER_MS


def pcts(values: list[int]) -> dict[str, float]:
    return {f"p{p}_ms": round(percentile(values, p), 4) for p in (50, 90, 99)}


def met(value: float, ok: bool) -> str:
    if math.isnan(value):
        return "n/a"
    return "met" if ok else "MISSED"


def fmt_ms(value: float) -> str:
    if math.isnan(value):
        return "  n/a"
    return f"{0.0 if abs(value) < 0.005 else value:.2f} ms"


# --------------------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    proc: asyncio.subprocess.Process
    root: Path
    base_url: str = ""  # ends in /v1
    api_key: str = ""
    engine_port: int = 0
    pids: dict[str, int] = field(default_factory=dict)  # gateway, agent, engine
    stdout: list[str] = field(default_factory=list)
    drain: asyncio.Task[None] | None = None

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def log_path(self) -> Path:
        return self.root / "up.stderr.log"

    def log_tail(self, lines: int = 15) -> str:
        out = list(self.stdout)
        with contextlib.suppress(OSError):
            out += self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line[:400] for line in out[-lines:])


async def start_cluster(root: Path) -> Cluster:
    state = root / "state"
    with open(root / "up.stderr.log", "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmgw",
            "up",
            "--state-dir",
            str(state),
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--agent-port",
            "0",
            "--enroll-port",
            "0",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=err,
        )
    cluster = Cluster(proc, root)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not (cluster.base_url and cluster.api_key):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(
                    f"'llmgw up' printed no base URL and API key within {STARTUP_TIMEOUT_S:.0f}s:\n"
                    + cluster.log_tail()
                )
            try:
                raw = await asyncio.wait_for(proc.stdout.readline(), remaining)
            except TimeoutError:
                continue
            if not raw:
                await proc.wait()
                raise BenchError(
                    f"'llmgw up' exited with code {proc.returncode} before it was up:\n"
                    + cluster.log_tail()
                )
            line = raw.decode(errors="replace").rstrip("\n")
            cluster.stdout.append(line)
            key, _, value = line.strip().partition(":")
            if key == "OpenAI base URL":
                cluster.base_url = value.strip()
            elif key == "API key":
                cluster.api_key = value.strip()
        cluster.drain = asyncio.create_task(_drain_stdout(cluster))
        cluster.engine_port, engine_pid = await _engine(cluster)
        cluster.pids = {"gateway": proc.pid, "engine": engine_pid}
        agent_pid = _parent_pid(engine_pid)  # the engine is the agent's child
        if agent_pid:
            cluster.pids["agent"] = agent_pid
        return cluster
    except BaseException:
        # failed or interrupted while starting: stop what was started
        await stop_cluster(cluster)
        raise


def _parent_pid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


async def _drain_stdout(cluster: Cluster) -> None:
    """Keep reading ``llmgw up``'s stdout so that it never blocks on a full pipe."""
    assert cluster.proc.stdout is not None
    for _ in range(100_000):
        raw = await cluster.proc.stdout.readline()
        if not raw:
            return
        cluster.stdout.append(raw.decode(errors="replace").rstrip("\n"))


async def _engine(cluster: Cluster) -> tuple[int, int]:
    """The ready engine's port and process id, from the admin API."""
    token = (cluster.state_dir / "server" / "admin.token").read_text().strip()
    root_url = cluster.base_url.removesuffix("/v1")
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(
            f"{root_url}/api/replicas", headers={"Authorization": f"Bearer {token}"}
        ) as resp,
    ):
        if resp.status != 200:
            raise BenchError(f"GET /api/replicas: HTTP {resp.status}: {await resp.text()}")
        replicas = await resp.json()
    for rep in replicas:
        if rep.get("model") == MODEL and rep.get("state") == "ready" and rep.get("port"):
            return int(rep["port"]), int(rep.get("pid") or 0)
    raise BenchError(f"no ready replica of {MODEL} in /api/replicas: {replicas}")


async def stop_cluster(cluster: Cluster) -> int | None:
    proc = cluster.proc
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            say(f"'llmgw up' did not stop within {STOP_TIMEOUT_S:.0f}s after SIGINT; killing it")
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    if cluster.drain is not None:
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(cluster.drain, 5)
    return proc.returncode


# --------------------------------------------------------------------------- clients


@dataclass
class Target:
    name: str
    session: aiohttp.ClientSession
    url: str
    headers: dict[str, str]


def stream_prompt() -> tuple[str, int, list[str]]:
    """A prompt and seed for which the sim emits all ``STREAM_TOKENS`` tokens.

    The sim draws a length in [8, 64], so with ``max_tokens`` 64 a full-length answer has
    exactly 64 tokens and finishes with ``stop`` (``length`` needs more than 64).
    """
    # Chat prompt text as the sim computes it: the message contents joined by newlines.
    prompt = "Tell me a long story."
    cfg = SimConfig()
    for seed in SEED_SEARCH:
        tokens, _finish = generate(cfg, prompt, max_tokens=STREAM_TOKENS, seed=seed)
        if len(tokens) >= STREAM_TOKENS:
            return prompt, seed, tokens
    raise BenchError(f"no seed in {SEED_SEARCH} gives {STREAM_TOKENS} tokens for {prompt!r}")


def chat_body(
    prompt: str,
    *,
    max_tokens: int,
    stream: bool,
    seed: int | None = None,
    extra: dict[str, Any] | None = None,
) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        **(extra or {}),
    }
    if seed is not None:
        body["seed"] = seed
    if stream:
        body["stream"] = True
    return json.dumps(body, separators=(",", ":")).encode()


async def unary(target: Target, body: bytes) -> int:
    """One non-streamed request; its latency in ns. Raises on a non-200 answer."""
    t0 = time.perf_counter_ns()
    async with target.session.post(target.url, data=body, headers=target.headers) as resp:
        data = await resp.read()
    elapsed = time.perf_counter_ns() - t0
    if resp.status != 200:
        raise BenchError(f"HTTP {resp.status}: {data[:200]!r}")
    return elapsed


@dataclass
class StreamResult:
    status: int = 0
    ttft_ns: int | None = None
    total_ns: int = 0
    chunk_times: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def chunks(self) -> int:
        return len(self.chunk_times)

    def gaps(self) -> list[int]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]


async def stream(target: Target, body: bytes, *, keep_text: bool = False) -> StreamResult:
    """One SSE request; arrival times of content events (role/finish events do not count)."""
    res = StreamResult()
    t0 = time.perf_counter_ns()
    async with target.session.post(target.url, data=body, headers=target.headers) as resp:
        res.status = resp.status
        if resp.status != 200:
            detail = await resp.read()
            raise BenchError(f"HTTP {resp.status}: {detail[:200]!r}")
        for _ in range(100_000):
            line = await resp.content.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                res.done = True
            elif b'"content":"' in line and b'"content":""' not in line:
                res.chunk_times.append(time.perf_counter_ns())
                if keep_text:
                    event = json.loads(line[6:])
                    res.text.append(event["choices"][0]["delta"]["content"])
    res.total_ns = time.perf_counter_ns() - t0
    if res.chunk_times:
        res.ttft_ns = res.chunk_times[0] - t0
    return res


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it: an engine in its sandbox is bwrap's grandchild,
    and the engine's own CPU is theirs, not bwrap's."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                children.setdefault(int(_stat(int(entry.name))[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU time (user + system) used so far by this process ("client") and by ``pids``; the
    engine's with every process below it (its sandbox)."""
    out = {"client": time.process_time()}
    for name, pid in pids.items():
        total, seen = 0.0, False
        for member in _tree(pid) if name == "engine" else [pid]:
            try:
                fields = _stat(member)
                total += (int(fields[11]) + int(fields[12])) / _CLK_TCK
                seen = True
            except (OSError, ValueError, IndexError):
                continue
        if seen:
            out[name] = total
    return out


async def run_all(coros: list[Coroutine[Any, Any, T]], timeout: float) -> list[T | BaseException]:
    """Run ``coros`` concurrently for at most ``timeout`` seconds; their results or exceptions
    (``TimeoutError`` for those still running then). Leaves no task behind, even when cancelled."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        await asyncio.wait(tasks, timeout=timeout)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    out: list[T | BaseException] = []
    for task in tasks:
        if task.cancelled():
            out.append(TimeoutError(f"still running after {timeout:.0f}s"))
        elif (exc := task.exception()) is not None:
            out.append(exc)
        else:
            out.append(task.result())
    return out


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=120),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        auto_decompress=False,
    )


def _error_key(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:160]


# --------------------------------------------------------------------------- phases


async def phase_unary(direct: Target, proxied: Target, n: int) -> dict[str, Any]:
    body = chat_body("Hello there!", max_tokens=UNARY_MAX_TOKENS, stream=False)
    lat: dict[str, list[int]] = {"direct": [], "proxied": []}
    errors: Counter[str] = Counter()
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    for i in range(WARMUP + n):
        if stopping():
            break
        if time.monotonic() > deadline:
            say(f"unary: stopped after {i} pairs (phase time limit)")
            break
        # ABBA order, so that neither target always goes first
        pair = (direct, proxied) if i % 2 == 0 else (proxied, direct)
        for target in pair:
            try:
                ns = await unary(target, body)
            except (aiohttp.ClientError, TimeoutError, BenchError) as exc:
                errors[f"{target.name}: {_error_key(exc)}"] += 1
                continue
            if i >= WARMUP:
                lat[target.name].append(ns)
    d, p = pcts(lat["direct"]), pcts(lat["proxied"])
    added_p50 = round(p["p50_ms"] - d["p50_ms"], 4)
    added_p99 = round(p["p99_ms"] - d["p99_ms"], 4)
    return {
        "requests_each": len(lat["proxied"]),
        "max_tokens": UNARY_MAX_TOKENS,
        "direct": d,
        "proxied": p,
        "added_p50_ms": added_p50,
        "added_p99_ms": added_p99,
        "target_added_p99_ms": TARGET_ADDED_P99_MS,
        "met": added_p99 <= TARGET_ADDED_P99_MS,
        "errors": dict(errors),
    }


async def _load(target: Target, body: bytes, concurrency: int, duration_s: float) -> dict[str, Any]:
    ok = 0
    errors: Counter[str] = Counter()
    deadline = time.perf_counter_ns() + int(duration_s * 1e9)

    async def worker() -> None:
        nonlocal ok
        for _ in range(MAX_REQUESTS_PER_WORKER):
            if time.perf_counter_ns() >= deadline or stopping():
                return
            try:
                async with target.session.post(
                    target.url, data=body, headers=target.headers
                ) as resp:
                    await resp.read()
                if resp.status == 200:
                    ok += 1
                else:
                    errors[f"HTTP {resp.status}"] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                errors[_error_key(exc)] += 1

    t0 = time.perf_counter_ns()
    for res in await run_all(
        [worker() for _ in range(concurrency)], duration_s + REQUEST_TIMEOUT_S
    ):
        if isinstance(res, BaseException):
            raise res
    elapsed_s = (time.perf_counter_ns() - t0) / 1e9
    return {"ok": ok, "elapsed_s": elapsed_s, "rps": ok / elapsed_s, "errors": errors}


async def phase_throughput(
    direct: Target,
    proxied: Target,
    duration_s: float,
    pids: dict[str, int],
    rounds: int = THROUGHPUT_ROUNDS,
) -> dict[str, Any]:
    body = chat_body("Hello there!", max_tokens=UNARY_MAX_TOKENS, stream=False)
    # open the connections (and the gateway's to the agent, with TLS) before measuring
    for target in (direct, proxied):
        await _load(target, body, CONCURRENCY, THROUGHPUT_WARMUP_S)
    ok = {"direct": 0, "proxied": 0}
    secs = {"direct": 0.0, "proxied": 0.0}
    cpu: dict[str, dict[str, float]] = {"direct": {}, "proxied": {}}
    errors: Counter[str] = Counter()
    per_round: list[dict[str, float]] = []
    for r in range(rounds):
        order = (direct, proxied) if r % 2 == 0 else (proxied, direct)
        entry: dict[str, float] = {}
        for target in order:
            before = cpu_seconds(pids)
            res = await _load(target, body, CONCURRENCY, duration_s)
            after = cpu_seconds(pids)
            for proc_name, secs_used in after.items():
                used = secs_used - before.get(proc_name, secs_used)
                cpu[target.name][proc_name] = cpu[target.name].get(proc_name, 0.0) + used
            ok[target.name] += res["ok"]
            secs[target.name] += res["elapsed_s"]
            entry[f"{target.name}_rps"] = round(res["rps"], 1)
            for key, count in res["errors"].items():
                errors[f"{target.name}: {key}"] += count
        per_round.append(entry)
    d_rps = ok["direct"] / secs["direct"] if secs["direct"] else 0.0
    p_rps = ok["proxied"] / secs["proxied"] if secs["proxied"] else 0.0
    ratio = p_rps / d_rps if d_rps else math.nan
    # CPU microseconds per request in each process, and CPUs busy in all of them together
    cpu_us = {
        name: {k: round(v / ok[name] * 1e6, 1) for k, v in cpu[name].items() if ok[name]}
        for name in cpu
    }
    busy = {
        name: round(sum(cpu[name].values()) / secs[name], 2) if secs[name] else math.nan
        for name in cpu
    }
    # with every process sharing the same CPUs and those CPUs saturated, the ratio can be no
    # better than the CPU a direct request costs over the CPU a proxied one costs
    d_cpu, p_cpu = sum(cpu_us["direct"].values()), sum(cpu_us["proxied"].values())
    return {
        "concurrency": CONCURRENCY,
        "duration_s_each": duration_s,
        "rounds": per_round,
        "direct_rps": round(d_rps, 1),
        "proxied_rps": round(p_rps, 1),
        "ratio": round(ratio, 4),
        "target_ratio": TARGET_THROUGHPUT_RATIO,
        "met": ratio >= TARGET_THROUGHPUT_RATIO,
        "cpu_us_per_request": cpu_us,
        # What each hop adds: the gateway's and the agent's process on a proxied request.
        "cpu_us_per_hop": {k: cpu_us["proxied"].get(k, math.nan) for k in ("gateway", "agent")},
        "target_cpu_us_per_hop": TARGET_CPU_US_PER_HOP,
        "cpu_per_hop_met": all(
            cpu_us["proxied"].get(k, math.inf) <= TARGET_CPU_US_PER_HOP
            for k in ("gateway", "agent")
        ),
        "cpus_busy": busy,
        "cpu_bound_ratio": round(d_cpu / p_cpu, 4) if d_cpu and p_cpu else math.nan,
        "errors": dict(errors),
    }


async def phase_sse(direct: Target, proxied: Target, n: int) -> dict[str, Any]:
    prompt, seed, _tokens = stream_prompt()
    body = chat_body(prompt, max_tokens=STREAM_TOKENS, stream=True, seed=seed)
    ttft: dict[str, list[int]] = {"direct": [], "proxied": []}
    gaps: dict[str, list[int]] = {"direct": [], "proxied": []}
    total: dict[str, list[int]] = {"direct": [], "proxied": []}
    short = Counter[str]()
    errors: Counter[str] = Counter()
    warmup = min(WARMUP, max(10, n // 10))
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    for i in range(warmup + n):
        if stopping():
            break
        if time.monotonic() > deadline:
            say(f"sse: stopped after {i} pairs (phase time limit)")
            break
        pair = (direct, proxied) if i % 2 == 0 else (proxied, direct)
        for target in pair:
            try:
                res = await stream(target, body)
            except (aiohttp.ClientError, TimeoutError, BenchError) as exc:
                errors[f"{target.name}: {_error_key(exc)}"] += 1
                continue
            if res.chunks != STREAM_TOKENS or not res.done:
                short[target.name] += 1
            if i < warmup or res.ttft_ns is None:
                continue
            ttft[target.name].append(res.ttft_ns)
            gaps[target.name].extend(res.gaps())
            total[target.name].append(res.total_ns)
    out: dict[str, Any] = {"streams_each": len(total["proxied"]), "tokens": STREAM_TOKENS}
    out["seed"] = seed
    for name in ("direct", "proxied"):
        out[name] = {
            "ttft": pcts(ttft[name]),
            "gap": pcts(gaps[name]),
            "total": pcts(total[name]),
        }
    out["added_ttft_p50_ms"] = round(
        out["proxied"]["ttft"]["p50_ms"] - out["direct"]["ttft"]["p50_ms"], 4
    )
    out["added_ttft_p99_ms"] = round(
        out["proxied"]["ttft"]["p99_ms"] - out["direct"]["ttft"]["p99_ms"], 4
    )
    out["added_gap_p99_ms"] = round(
        out["proxied"]["gap"]["p99_ms"] - out["direct"]["gap"]["p99_ms"], 4
    )
    out["incomplete_streams"] = dict(short)
    out["errors"] = dict(errors)
    return out


async def _burst(proxied: Target, body: bytes, expected_text: str, n: int) -> dict[str, Any]:
    t0 = time.perf_counter_ns()
    results = await run_all(
        [stream(proxied, body, keep_text=True) for _ in range(n)], REQUEST_TIMEOUT_S + 5
    )
    wall_s = (time.perf_counter_ns() - t0) / 1e9
    received = done = wrong_text = 0
    errors: Counter[str] = Counter()
    totals: list[int] = []
    ttfts: list[int] = []
    for res in results:
        if isinstance(res, BaseException):
            errors[_error_key(res)] += 1
            continue
        received += res.chunks
        done += res.done
        totals.append(res.total_ns)
        if res.ttft_ns is not None:
            ttfts.append(res.ttft_ns)
        if "".join(res.text) != expected_text:
            wrong_text += 1
    return {
        "received": received,
        "done": done,
        "wrong_text": wrong_text,
        "wall_s": round(wall_s, 3),
        "ttft": pcts(ttfts),
        "total": pcts(totals),
        "errors": errors,
    }


async def phase_many_streams(
    proxied: Target, pids: dict[str, int], n: int = MANY_STREAMS, bursts: int = 2
) -> dict[str, Any]:
    """``bursts`` bursts of ``n`` concurrent streams; the first opens new gateway -> agent
    connections (mTLS handshakes) beyond those the earlier phases left open, later ones
    reuse them."""
    prompt, seed, tokens = stream_prompt()
    body = chat_body(prompt, max_tokens=STREAM_TOKENS, stream=True, seed=seed)
    expected_text = "".join(tokens)
    runs: list[dict[str, Any]] = []
    errors: Counter[str] = Counter()
    for _ in range(bursts):
        if stopping():
            break
        before = cpu_seconds(pids)
        res = await _burst(proxied, body, expected_text, n)
        after = cpu_seconds(pids)
        res["cpu_s"] = {
            k: round(after[k] - before[k], 3) for k in ("gateway", "agent") if k in after
        }
        errors.update(res.pop("errors"))
        runs.append(res)
        await asyncio.sleep(0.2)
    expected = bursts * n * STREAM_TOKENS
    received = sum(r["received"] for r in runs)
    done = sum(r["done"] for r in runs)
    return {
        "streams": n,
        "bursts": runs,
        "chunks_expected": expected,
        "chunks_received": received,
        "chunks_lost": expected - received,
        "done_received": done,
        "done_expected": bursts * n,
        "wrong_text": sum(r["wrong_text"] for r in runs),
        "target_chunks_lost": TARGET_CHUNKS_LOST,
        "met": expected - received <= TARGET_CHUNKS_LOST and done == bursts * n and not errors,
        "errors": dict(errors),
    }


async def phase_long_streams(
    direct: Target, proxied: Target, pids: dict[str, int], n: int = LONG_STREAMS
) -> dict[str, Any]:
    """``n`` streams of ``LONG_TOKENS`` tokens per target, ``LONG_CONCURRENCY`` at a time,
    direct then proxied, and the CPU microseconds each process spent per chunk received."""
    body = chat_body(
        "Tell me a long story.",
        max_tokens=LONG_TOKENS,
        stream=True,
        seed=1,
        extra={"ignore_eos": True},
    )
    out: dict[str, Any] = {
        "streams_each": n,
        "tokens": LONG_TOKENS,
        "concurrency": LONG_CONCURRENCY,
    }
    errors: Counter[str] = Counter()
    for target in (direct, proxied):
        gate = asyncio.Semaphore(LONG_CONCURRENCY)

        async def one(target: Target = target, gate: asyncio.Semaphore = gate) -> StreamResult:
            async with gate:
                return await stream(target, body)

        before = cpu_seconds(pids)
        t0 = time.monotonic()
        results = await run_all([one() for _ in range(n)], PHASE_TIMEOUT_S)
        wall = time.monotonic() - t0
        after = cpu_seconds(pids)
        chunks = 0
        for res in results:
            if isinstance(res, BaseException):
                errors[_error_key(res)] += 1
            else:
                chunks += res.chunks
        out[target.name] = {
            "chunks": chunks,
            "wall_s": round(wall, 2),
            "chunks_per_s": round(chunks / wall, 1) if wall else math.nan,
            "cpu_us_per_chunk": {
                k: round((after[k] - before[k]) / chunks * 1e6, 2) if chunks else math.nan
                for k in after
                if k in before
            },
        }
    out["chunks_expected"] = n * LONG_TOKENS
    out["cpu_us_per_chunk_per_hop"] = {
        k: out["proxied"]["cpu_us_per_chunk"].get(k, math.nan) for k in ("gateway", "agent")
    }
    out["errors"] = dict(errors)
    return out


# --------------------------------------------------------------------------- report


def _errors_line(errors: dict[str, int]) -> str:
    if not errors:
        return ""
    return "  errors: " + "; ".join(f"{k} x{v}" for k, v in sorted(errors.items()))


def _cpu_line(t: dict[str, Any]) -> str:
    parts = []
    for name in ("direct", "proxied"):
        us = t["cpu_us_per_request"].get(name) or {}
        procs = " ".join(
            f"{k} {us[k]:.0f}" for k in ("client", "gateway", "agent", "engine") if k in us
        )
        parts.append(
            f"  CPU us/request {name:<8} {procs}  (total {sum(us.values()):.0f}; "
            f"{t['cpus_busy'][name]:.2f} CPUs busy)"
        )
    hop = t["cpu_us_per_hop"]
    parts.append(
        f"  CPU us/request per hop: gateway {hop['gateway']:.0f}, agent {hop['agent']:.0f}   "
        f"(target <= {t['target_cpu_us_per_hop']:.0f} each: "
        f"{met(max(hop.values()), t['cpu_per_hop_met'])})"
    )
    parts.append(
        "  (what a bare Python relay hop costs on this machine, TLS or not: "
        "python bench/hop_floor.py)"
    )
    parts.append(
        f"  CPU-bound ratio (direct CPU/request / proxied CPU/request): {t['cpu_bound_ratio']:.2f}"
    )
    return "\n".join(parts)


def _no_nan(value: Any) -> Any:
    """``value`` with NaN floats as None, for strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def render(fig: dict[str, Any]) -> str:
    lines = [
        f"llmgw gateway benchmark (sim engine, loopback, {fig['cpus']} CPUs, "
        f"python {fig['python']}, aiohttp {fig['aiohttp']}, event loop {fig['event_loop']})",
        "  direct = engine's own port; proxied = client -> gateway -> agent (mTLS) -> engine",
    ]
    u = fig.get("unary")
    if u:
        d, p = u["direct"], u["proxied"]
        lines.append(
            f"unary c=1      n={u['requests_each']} each, max_tokens {u['max_tokens']}\n"
            f"  direct   p50 {fmt_ms(d['p50_ms'])}  p90 {fmt_ms(d['p90_ms'])}  p99 {fmt_ms(d['p99_ms'])}\n"
            f"  proxied  p50 {fmt_ms(p['p50_ms'])}  p90 {fmt_ms(p['p90_ms'])}  p99 {fmt_ms(p['p99_ms'])}\n"
            f"  added    p50 {fmt_ms(u['added_p50_ms'])}  p99 {fmt_ms(u['added_p99_ms'])}"
            f"   (target p99 <= {TARGET_ADDED_P99_MS} ms: {met(u['added_p99_ms'], u['met'])})"
            + _errors_line(u["errors"])
        )
    t = fig.get("throughput")
    if t:
        rounds = ", ".join(
            f"round {i + 1}: direct {r['direct_rps']:.0f} / proxied {r['proxied_rps']:.0f}"
            for i, r in enumerate(t["rounds"])
        )
        lines.append(
            f"throughput c={t['concurrency']}  {t['duration_s_each']:g} s x {len(t['rounds'])} "
            f"rounds each\n"
            f"  direct {t['direct_rps']:.0f} req/s | proxied {t['proxied_rps']:.0f} req/s | "
            f"ratio {t['ratio']:.2f}   (target >= {TARGET_THROUGHPUT_RATIO}: "
            f"{met(t['ratio'], t['met'])})\n"
            f"  ({rounds})\n" + _cpu_line(t) + _errors_line(t["errors"])
        )
    s = fig.get("sse")
    if s:
        d, p = s["direct"], s["proxied"]
        lines.append(
            f"sse c=1        n={s['streams_each']} each, {s['tokens']} tokens (seed {s['seed']})\n"
            f"  direct   ttft p50 {fmt_ms(d['ttft']['p50_ms'])} p99 {fmt_ms(d['ttft']['p99_ms'])}"
            f" | gap p50 {fmt_ms(d['gap']['p50_ms'])} p99 {fmt_ms(d['gap']['p99_ms'])}"
            f" | whole stream p50 {fmt_ms(d['total']['p50_ms'])} p99 {fmt_ms(d['total']['p99_ms'])}\n"
            f"  proxied  ttft p50 {fmt_ms(p['ttft']['p50_ms'])} p99 {fmt_ms(p['ttft']['p99_ms'])}"
            f" | gap p50 {fmt_ms(p['gap']['p50_ms'])} p99 {fmt_ms(p['gap']['p99_ms'])}"
            f" | whole stream p50 {fmt_ms(p['total']['p50_ms'])} p99 {fmt_ms(p['total']['p99_ms'])}\n"
            f"  added    ttft p50 {fmt_ms(s['added_ttft_p50_ms'])} p99 {fmt_ms(s['added_ttft_p99_ms'])}"
            f" | inter-chunk gap p99 {fmt_ms(s['added_gap_p99_ms'])}"
            + (
                f"  incomplete streams: {s['incomplete_streams']}"
                if s["incomplete_streams"]
                else ""
            )
            + _errors_line(s["errors"])
        )
    m = fig.get("many_streams")
    if m:
        lines.append(
            f"{m['streams']} streams    at once through the gateway, {len(m['bursts'])} bursts, "
            f"{STREAM_TOKENS} chunks + [DONE] each\n"
            f"  chunks lost: {m['chunks_lost']} of {m['chunks_expected']}"
            f" | [DONE] {m['done_received']} of {m['done_expected']}"
            f" | wrong text {m['wrong_text']}"
            f"   (target 0 lost, no errors: {'met' if m['met'] else 'MISSED'})"
        )
        for i, b in enumerate(m["bursts"]):
            what = "new gateway->agent connections" if i == 0 else "pooled connections"
            cpu = " ".join(f"{k} {v:.2f} s" for k, v in b["cpu_s"].items())
            lines.append(
                f"  burst {i + 1} ({what}): wall {b['wall_s']:.2f} s"
                f" | ttft p50 {fmt_ms(b['ttft']['p50_ms'])} p99 {fmt_ms(b['ttft']['p99_ms'])}"
                f" | CPU {cpu}"
            )
        lines.append("  errors: none" if not m["errors"] else _errors_line(m["errors"]))
    g = fig.get("long_streams")
    if g:
        lines.append(
            f"long answers   {g['streams_each']} streams of {g['tokens']} tokens each, "
            f"c={g['concurrency']} (ignore_eos)"
        )
        for name in ("direct", "proxied"):
            r = g[name]
            us = r["cpu_us_per_chunk"]
            procs = " ".join(
                f"{k} {us[k]:.1f}" for k in ("client", "gateway", "agent", "engine") if k in us
            )
            lines.append(
                f"  {name:<8} {r['chunks']} of {g['chunks_expected']} chunks in {r['wall_s']:.1f} s"
                f" ({r['chunks_per_s']:.0f}/s) | CPU us/chunk {procs}"
            )
        hop = g["cpu_us_per_chunk_per_hop"]
        lines.append(
            f"  CPU us per streamed chunk per hop: gateway {hop['gateway']:.1f}, "
            f"agent {hop['agent']:.1f}" + _errors_line(g["errors"])
        )
    lines.append(f"total run {fig['run_s']:.1f} s")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    fig: dict[str, Any] = {
        "cpus": cpus,
        "python": platform.python_version(),
        "aiohttp": aiohttp.__version__,
        # The loop 'llmgw up' and its agent and engine run (they inherit LLMGW_EVENT_LOOP).
        "event_loop": choose_event_loop().name,
    }
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()

    def interrupt() -> None:
        _Stop.requested = True
        if main_task is not None:
            main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt)
    root = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    cluster: Cluster | None = None
    try:
        say("starting 'llmgw up' ...")
        cluster = await start_cluster(root)
        say(
            f"up after {time.monotonic() - started:.1f} s: gateway {cluster.base_url}, "
            f"engine 127.0.0.1:{cluster.engine_port}"
        )
        json_headers = {"Content-Type": "application/json"}
        async with _session() as d_session, _session() as p_session:
            direct = Target(
                "direct",
                d_session,
                f"http://127.0.0.1:{cluster.engine_port}/v1/chat/completions",
                json_headers,
            )
            proxied = Target(
                "proxied",
                p_session,
                f"{cluster.base_url}/chat/completions",
                {**json_headers, "Authorization": f"Bearer {cluster.api_key}"},
            )
            phases: list[tuple[str, str, Callable[[], Awaitable[dict[str, Any]]]]] = [
                (
                    "unary",
                    f"unary c=1: {WARMUP} + {args.requests} requests each",
                    lambda: phase_unary(direct, proxied, args.requests),
                ),
                (
                    "throughput",
                    f"throughput c={CONCURRENCY}: {args.duration:g} s x {THROUGHPUT_ROUNDS} each",
                    lambda: phase_throughput(direct, proxied, args.duration, cluster.pids),
                ),
                (
                    "sse",
                    f"sse c=1: {args.streams} streams each",
                    lambda: phase_sse(direct, proxied, args.streams),
                ),
                (
                    "many_streams",
                    f"{MANY_STREAMS} concurrent streams through the gateway, 2 bursts",
                    lambda: phase_many_streams(proxied, cluster.pids),
                ),
                (
                    "long_streams",
                    f"{LONG_STREAMS} streams of {LONG_TOKENS} tokens each, c={LONG_CONCURRENCY}",
                    lambda: phase_long_streams(direct, proxied, cluster.pids),
                ),
            ]
            for key, what, phase in phases:
                if stopping():
                    raise Interrupted("interrupted")
                if cluster.proc.returncode is not None:
                    raise BenchError(
                        f"'llmgw up' exited with code {cluster.proc.returncode} during the "
                        f"run:\n{cluster.log_tail()}"
                    )
                say(what + " ...")
                t0 = time.monotonic()
                fig[key] = await phase()
                say(f"  {time.monotonic() - t0:.1f} s")
    except asyncio.CancelledError:
        if not stopping():
            raise
        raise Interrupted("interrupted") from None
    finally:
        if cluster is not None:
            say("stopping 'llmgw up' (SIGINT) ...")
            code = await stop_cluster(cluster)
            fig["up_exit_code"] = code
            if code not in (0, None):
                say(f"'llmgw up' exited with code {code}:\n{cluster.log_tail()}")
        shutil.rmtree(root, ignore_errors=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.remove_signal_handler(sig)
    if stopping():
        raise Interrupted("interrupted")
    fig["run_s"] = round(time.monotonic() - started, 1)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Latency and throughput of the sim engine directly vs through llmgw's "
        "gateway and agent (starts 'llmgw up' on loopback)."
    )
    parser.add_argument(
        "--requests", type=int, default=2000, help="unary requests per target (default 2000)"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=5.0,
        help="seconds per throughput run; 2 rounds per target (default 5)",
    )
    parser.add_argument(
        "--streams", type=int, default=300, help="SSE streams per target at c=1 (default 300)"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.streams < 1 or not 0 < args.duration <= 120:
        parser.error("--requests and --streams must be >= 1 and --duration in (0, 120]")
    try:
        fig = asyncio.run(run(args))
    except Interrupted:
        say("interrupted")
        return 130
    except BenchError as exc:
        say(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    if args.json:
        print(json.dumps(_no_nan(fig), indent=2, allow_nan=False))
    else:
        print(render(fig))
    return 0


if __name__ == "__main__":
    sys.exit(main())
