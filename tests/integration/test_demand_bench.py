"""bench/demand.py on a small fleet: the benchmark keeps working, and what holds at any size
holds: no request fails in any of the three runs, the fixed split answers every request
within the SLO, serving by demand (with and without sleep) holds fewer GPUs and its starts
are measured. Bounds are generous (the
figures themselves are the benchmark's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_demand_benchmark_runs_both_ways_on_a_small_fleet() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "demand.py"),
            *("--nodes", "1", "--models", "3", "--day", "20", "--peak", "2", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout)
    static, demand, sleep = fig["static"], fig["demand"], fig["sleep"]
    assert static["requests"] == demand["requests"] == sleep["requests"] > 0
    failures = (static["failures"], demand["failures"], sleep["failures"])
    assert static["failed"] == demand["failed"] == sleep["failed"] == 0, failures
    assert static["slo_attainment"] == 1.0
    assert demand["gpu_seconds"] < static["gpu_seconds"]
    assert demand["starts"] > 0 and demand["cold_requests"] > 0
    assert 0 <= demand["llmgw_start_p99"] < 30  # measured; its target is the benchmark's
    assert sleep["gpu_seconds"] < static["gpu_seconds"]
