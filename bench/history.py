#!/usr/bin/env python3
"""Benchmark: what recording one request in the gateway's request history costs
(:meth:`llmgw.server.gateway.history.RequestHistory.record`, on the request path once per relayed
request), and what reading a model's hour costs (the console's and the admin API's read).

Recording is timed on a warm series: with a TTFT (a streamed answer), without one, and an
error, each over many calls on the real wall clock, so that bucket rotation happens as it
would. Printed as ns per call; the request path's budget is a few µs.

Usage: python bench/history.py [--calls N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from llmgw.server.gateway.history import RequestHistory

TARGET_NS = 3000  # "a few µs at most" on the request path


def per_call_ns(calls: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000)
    args = parser.parse_args()
    history = RequestHistory()
    record = history.record
    for name in ("llama", "qwen", "mistral"):
        record(name, ttft=0.1)
    # The loop and the lambda's call alone, taken off each figure.
    empty_ns = per_call_ns(args.calls, lambda: None)
    cases = {
        "record, streamed (ttft)": lambda: record("llama", ttft=0.137),
        "record, whole answer": lambda: record("llama"),
        "record, error": lambda: record("llama", error=True),
    }
    for label, fn in cases.items():
        ns = per_call_ns(args.calls, fn) - empty_ns
        print(f"{label:28} {ns:8.0f} ns per record (target < {TARGET_NS} ns)")
    start = time.perf_counter()
    reads = 20
    for _ in range(reads):
        history.series("llama")
    print(
        f"{'series (360 points)':28} {(time.perf_counter() - start) / reads * 1e3:8.2f} ms per read"
    )
    start = time.perf_counter()
    for _ in range(reads):
        history.series("llama", step=60)
    print(
        f"{'series (60 points, 60 s)':28} {(time.perf_counter() - start) / reads * 1e3:8.2f} ms per read"
    )


if __name__ == "__main__":
    main()
