#!/usr/bin/env python3
"""Benchmark: the placement engine on a large cluster.

1,000 nodes of 8 GPUs (80 GiB each) on 4 fabrics; 2,000 replicas of mixed profiles (1, 2, 4
and 8 GPUs per shard, 1 and 2 nodes per replica) placed one after another into one
:class:`~llmgw.server.fleet.placement.Cluster`, once with ``binpack`` and once with ``spread``. The
mix asks for more GPUs than the cluster has, so the last placements fail, which times the
refusals (their reasons told per group of nodes). It also times building the cluster view
from the allocations placed (what every reconcile pass starts with; the best of three), and
the first decision of each kind of profile on it (which indexes the nodes it may use).

Prints figures next to the targets (>= 2,000 decisions/s, p99 <= 10 ms, at 10,000 nodes:
--nodes 10000 --replicas 20000); not a pass/fail test. At another size than 1,000 nodes it
runs 1,000 nodes too (the same mix, twice as many replicas as nodes) and prints the two side
by side.

Usage: python bench/placement.py [--nodes N] [--replicas N] [--seed N]
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from dataclasses import dataclass

from llmgw.server.fleet.placement import (
    Allocation,
    Cluster,
    GpuView,
    NodeView,
    Placement,
    Profile,
)

GPUS_PER_NODE = 8
GPU_MIB = 80 * 1024
FABRICS = ("ib-a", "ib-b", "ib-c", "ib-d")
PROFILES = (
    Profile("vllm", 1),
    Profile("vllm", 2),
    Profile("vllm", 4),
    Profile("vllm", 8),
    Profile("vllm", 4, nodes=2),
    Profile("vllm", 8, nodes=2),
)
TARGET_RATE = 2000.0
TARGET_P99_MS = 10.0
BASE_NODES = 1000


def make_nodes(count: int) -> list[NodeView]:
    return [
        NodeView(
            id=f"node{i:04d}",
            approved=True,
            connected=True,
            draining=False,
            lost=False,
            engines=frozenset({"vllm", "sim"}),
            gpus=tuple(GpuView(f"GPU-{i:04d}-{g}", GPU_MIB) for g in range(GPUS_PER_NODE)),
            fabrics=(FABRICS[i % len(FABRICS)],),
            mgmt_addr=f"10.0.{i // 256}.{i % 256}",
        )
        for i in range(count)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Figures:
    rate: float
    p99_ms: float
    build_ms: float = 0.0


def run(
    nodes: list[NodeView], profiles: list[Profile], strategy: str, *, quiet: bool = False
) -> tuple[list[Allocation], Figures]:
    cluster = Cluster(nodes, [])
    times: list[float] = []
    failed_times: list[float] = []
    allocations: list[Allocation] = []
    placed: list[bool] = []
    started = time.perf_counter()
    for n, profile in enumerate(profiles):
        t0 = time.perf_counter()
        result = cluster.place(profile, strategy=strategy, replica_id=f"r{n}")
        elapsed = time.perf_counter() - t0
        times.append(elapsed)
        placed.append(isinstance(result, Placement))
        if isinstance(result, Placement):
            allocations.extend(
                Allocation(f"r{n}", f"r{n}-s{s.rank}", s.node_id, s.gpus) for s in result.shards
            )
        else:
            failed_times.append(elapsed)
    total = time.perf_counter() - started
    rate = len(profiles) / total
    p50 = percentile(times, 0.50) * 1000
    p99 = percentile(times, 0.99) * 1000
    held = sum(len(a.gpus) for a in allocations)
    figures = Figures(rate, p99)
    if quiet:
        return allocations, figures
    print(f"{strategy}:")
    print(f"  placements/s      {rate:10.0f}   (target >= {TARGET_RATE:.0f})")
    print(f"  decision p50      {p50:10.3f} ms")
    print(f"  decision p99      {p99:10.3f} ms (target <= {TARGET_P99_MS:.0f} ms)")
    print(f"  decision max      {max(times) * 1000:10.3f} ms")
    placed_times = [t for t, ok in zip(times, placed, strict=True) if ok]
    if placed_times:
        print(
            f"  placed only       p50 {percentile(placed_times, 0.5) * 1000:.3f} ms, "
            f"p99 {percentile(placed_times, 0.99) * 1000:.3f} ms"
        )
    print(f"  placed            {len(profiles) - len(failed_times):10d}")
    print(f"  unplaceable       {len(failed_times):10d}", end="")
    if failed_times:
        print(f"   (p50 {percentile(failed_times, 0.5) * 1000:.3f} ms each)")
    else:
        print()
    print(f"  GPUs held         {held:10d} of {len(nodes) * GPUS_PER_NODE}")
    return allocations, figures


def time_build(
    nodes: list[NodeView], allocations: list[Allocation], *, quiet: bool = False
) -> float:
    """The best of three builds of the view, in ms; then the first decision of each kind
    of profile on the last one (single- and multi-node: the two pools the mix uses)."""
    builds = []
    for _ in range(3):
        t0 = time.perf_counter()
        cluster = Cluster(nodes, allocations)
        builds.append((time.perf_counter() - t0) * 1000)
    ms = min(builds)
    t0 = time.perf_counter()
    for profile in (PROFILES[0], PROFILES[-1]):
        cluster.place(profile)
    first = (time.perf_counter() - t0) * 1000
    if not quiet:
        print(f"  cluster view      {ms:10.3f} ms to build from {len(allocations)} allocations")
        print(f"  first decisions   {first:10.3f} ms (one single-node, one multi-node)")
    return ms


def measure(count: int, replicas: int, seed: int, *, quiet: bool = False) -> dict[str, Figures]:
    rng = random.Random(seed)
    nodes = make_nodes(count)
    profiles = [rng.choice(PROFILES) for _ in range(replicas)]
    if not quiet:
        asked = sum(p.gpus * p.nodes for p in profiles)
        print(
            f"python {platform.python_version()} on {platform.machine()}; "
            f"{count} nodes x {GPUS_PER_NODE} GPUs on {len(FABRICS)} fabrics; "
            f"{replicas} replicas asking for {asked} GPUs"
        )
    out = {}
    for strategy in ("binpack", "spread"):
        allocations, figures = run(nodes, profiles, strategy, quiet=quiet)
        figures.build_ms = time_build(nodes, allocations, quiet=quiet)
        out[strategy] = figures
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--replicas", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()

    figures = measure(args.nodes, args.replicas, args.seed)
    if args.nodes == BASE_NODES:
        return
    base = measure(BASE_NODES, 2 * BASE_NODES, args.seed, quiet=True)
    print(f"{BASE_NODES} nodes ({2 * BASE_NODES} replicas) beside {args.nodes}:")
    for strategy, at in figures.items():
        was = base[strategy]
        print(
            f"  {strategy:8}  decisions/s {was.rate:7.0f} -> {at.rate:7.0f}   "
            f"p99 {was.p99_ms:6.3f} -> {at.p99_ms:6.3f} ms   "
            f"view {was.build_ms:7.1f} -> {at.build_ms:7.1f} ms"
        )


if __name__ == "__main__":
    main()
