#!/usr/bin/env python3
"""Benchmark: memory of the gateway and the agent under concurrent maximum-size requests.

Starts ``llmgw up`` (control plane + one agent + one ``sim`` engine on loopback, default
limits: ``max_request_body`` 8 MiB and ``max_inflight_body_bytes`` 256 MiB on both hops) and
samples the resident memory (RSS) of the control plane (gateway) and of the agent every
20 ms while it sends:

1. rounds of 64 concurrent non-streamed chat completions whose bodies are exactly
   ``max_request_body`` (a 503 from the spent in-flight budget is retried after its
   ``Retry-After``, as OpenAI clients do);
2. 64 concurrent requests declaring a 1 GiB body (413 before the body is read);
3. 64 concurrent chunked bodies that never end (counted, 413 past the limit).

It prints RSS idle, the peak of each phase and RSS after it, the answers' statuses and the
time taken. It is not a pass/fail test; the bound it shows is the budget's: the peak stays
near a small multiple of ``max_inflight_body_bytes`` whatever the clients send.

Usage: python bench/bodies.py [--concurrency N] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from gateway import MODEL, BenchError, Cluster, say, start_cluster, stop_cluster

from llmgw.bodies import DEFAULT_MAX_INFLIGHT_BODY_BYTES, DEFAULT_MAX_REQUEST_BODY

MIB = 1024 * 1024
SAMPLE_S = 0.02
REQUEST_TIMEOUT_S = 300.0
MAX_RETRIES = 200


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Sampler:
    """The highest RSS of each process seen while running."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.peak = {name: 0.0 for name in pids}
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_mib(pid))
            await asyncio.sleep(SAMPLE_S)

    def __enter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


def max_size_body(size: int) -> bytes:
    """A chat completion request of exactly ``size`` bytes."""
    empty = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": ""}], "max_tokens": 4}
    ).encode()
    body = empty.replace(b'"content": ""', b'"content": "' + b"x" * (size - len(empty)) + b'"')
    assert len(body) == size
    return body


async def full_size(
    session: aiohttp.ClientSession, url: str, key: str, body: bytes
) -> tuple[int, int, str]:
    """One request, retried while the answer is 503; (final status, 503s seen, the error
    message of an answer that is not 200)."""
    busy = 0
    for _ in range(MAX_RETRIES):
        async with session.post(
            url,
            data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        ) as resp:
            data = await resp.read()
            if resp.status != 503:
                return resp.status, busy, "" if resp.status == 200 else data[:300].decode()
            busy += 1
            await asyncio.sleep(float(resp.headers.get("Retry-After", "1")))
    return 503, busy, "still 503 after every retry"


async def over_limit(host: str, port: int, key: str, *, chunked: bool) -> int:
    """A request whose body is over the limit, by hand: declared 1 GiB, or chunked without
    end; the status of the answer, which comes before the body is sent."""
    reader, writer = await asyncio.open_connection(host, port)
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {1024**3}"
    writer.write(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode()
    )
    piece = b"10000\r\n" + b" " * 0x10000 + b"\r\n" if chunked else b" " * 0x10000
    answer = asyncio.ensure_future(reader.readline())
    try:
        for _ in range(16 * 1024):  # 1 GiB at most
            if answer.done():
                break
            writer.write(piece)
            try:
                await writer.drain()
            except ConnectionError:
                break
        line = await asyncio.wait_for(answer, REQUEST_TIMEOUT_S)
        return int(line.split()[1]) if line else 0
    finally:
        answer.cancel()
        writer.close()


async def phase(
    name: str, cluster: Cluster, coros: Callable[[], list[Awaitable[Any]]]
) -> dict[str, Any]:
    say(f"{name} ...")
    started = time.perf_counter()
    with Sampler(cluster.pids) as sampler:
        results = await asyncio.gather(*coros(), return_exceptions=True)
    took = time.perf_counter() - started
    await asyncio.sleep(2.0)  # then what is still held
    statuses: Counter[str] = Counter()
    busy = 0
    errors: set[str] = set()
    for result in results:
        if isinstance(result, BaseException):
            statuses[type(result).__name__] += 1
            errors.add(repr(result)[:300])
        elif isinstance(result, tuple):
            statuses[str(result[0])] += 1
            busy += result[1]
            if result[2]:
                errors.add(result[2])
        else:
            statuses[str(result)] += 1
    return {
        "phase": name,
        "seconds": round(took, 2),
        "statuses": dict(statuses),
        "retried_503": busy,
        "errors": sorted(errors)[:5],
        "peak_rss_mib": {k: round(v, 1) for k, v in sampler.peak.items()},
        "after_rss_mib": {k: round(rss_mib(pid), 1) for k, pid in cluster.pids.items()},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-bodies-") as tmp:
        say("starting 'llmgw up' ...")
        cluster = await start_cluster(Path(tmp))
        try:
            pids = {k: v for k, v in cluster.pids.items() if k in ("gateway", "agent")}
            if "agent" not in pids:
                raise BenchError("could not find the agent's process")
            cluster.pids = pids
            root = cluster.base_url.removesuffix("/v1")
            host, _, port = root.removeprefix("http://").rpartition(":")
            url = cluster.base_url + "/chat/completions"
            key = cluster.api_key
            body = max_size_body(DEFAULT_MAX_REQUEST_BODY)
            figures: dict[str, Any] = {
                "concurrency": args.concurrency,
                "body_bytes": len(body),
                "max_inflight_body_bytes": DEFAULT_MAX_INFLIGHT_BODY_BYTES,
                "idle_rss_mib": {k: round(rss_mib(pid), 1) for k, pid in pids.items()},
                "phases": [],
            }
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                for i in range(args.rounds):
                    figures["phases"].append(
                        await phase(
                            f"{args.concurrency} x {len(body) // MIB} MiB bodies, round {i + 1}",
                            cluster,
                            lambda: [
                                full_size(session, url, key, body) for _ in range(args.concurrency)
                            ],
                        )
                    )
            for chunked in (False, True):
                what = "chunked bodies without end" if chunked else "bodies declared 1 GiB"
                clients = [
                    over_limit(host, int(port), key, chunked=chunked)
                    for _ in range(args.concurrency)
                ]
                figures["phases"].append(
                    await phase(f"{args.concurrency} x {what}", cluster, lambda c=clients: c)
                )
            return figures
        finally:
            say("stopping 'llmgw up' ...")
            await stop_cluster(cluster)


def render(fig: dict[str, Any]) -> str:
    idle = fig["idle_rss_mib"]
    lines = [
        f"bodies: {fig['concurrency']} concurrent requests, max_request_body "
        f"{fig['body_bytes'] // MIB} MiB, max_inflight_body_bytes "
        f"{fig['max_inflight_body_bytes'] // MIB} MiB (both hops)",
        f"  RSS idle: gateway {idle['gateway']:.0f} MiB, agent {idle['agent']:.0f} MiB",
    ]
    for p in fig["phases"]:
        peak, after = p["peak_rss_mib"], p["after_rss_mib"]
        statuses = ", ".join(f"{n} x {s}" for s, n in sorted(p["statuses"].items()))
        lines.append(
            f"  {p['phase']}: {p['seconds']:.1f} s; answers {statuses}"
            + (f" ({p['retried_503']} 503s retried)" if p["retried_503"] else "")
        )
        lines.append(
            f"    RSS peak gateway {peak['gateway']:.0f} MiB, agent {peak['agent']:.0f} MiB; "
            f"2 s after: gateway {after['gateway']:.0f} MiB, agent {after['agent']:.0f} MiB"
        )
        lines.extend(f"    error: {e}" for e in p["errors"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="RSS of the gateway and the agent under concurrent maximum-size requests "
        "(starts 'llmgw up' on loopback)."
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    if sys.platform != "linux" or not os.path.exists("/proc/self/status"):
        say("needs Linux /proc to read RSS")
        return 2
    try:
        figures = asyncio.run(run(args))
    except BenchError as exc:
        say(str(exc))
        return 1
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
