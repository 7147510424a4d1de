"""bench/disagg.py on two sim GPUs: the benchmark keeps working, and what holds at any size
holds: every request of both arms answers in full, the disaggregated arm hands every one
over (none falls back), and a long prompt stalls the aggregated replica's streams where the
decode pool's stay smooth. Bounds are generous (the figures themselves are the
benchmark's). Its refusals of bad arguments, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "disagg.py"


def test_the_disagg_benchmark_runs_both_arms_on_two_gpus() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            *("--gpus", "2", "--splits", "1:1", "--loads", "0.4", "--long-share", "0.5"),
            *("--counter", "0", "--scale", "1", "--duration", "10", "--warmup", "0", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fig = json.loads(proc.stdout)
    assert fig["interference"], fig["missing_params"]
    (label,) = fig["phases"]
    phase = fig["phases"][label]
    agg, split = fig["arms"]["aggregated"][label], fig["arms"]["disagg 1:1"][label]
    for arm in (agg, split):
        assert arm["sent"] > 0 and arm["failed"] == 0, arm["failures"]
    # Every request of the phase (its warm-up's too) handed over, none run whole.
    assert split["handovers"] == phase["requests"] and split["fallbacks"] == 0
    assert agg["handovers"] == 0
    # Each hand-over a pull of the prompt's KV over TCP, as the decodes themselves count it.
    pulled = fig["engines"]["disagg 1:1"]
    assert pulled["llmgw_sim_kv_pulls_total"] == phase["requests"]
    assert pulled["llmgw_sim_kv_bytes_received_total"] >= phase["requests"] * 100 * 4096
    assert pulled["llmgw_sim_kv_load_failures_total"] == 0
    assert 0 < split["handover_p50_ms"] <= split["handover_p99_ms"] < 2000
    # The interference the step model makes and the decode pool is spared: a long prompt's
    # chunk (200 ms at 2,048 tokens) against a 10 ms step.
    assert agg["itl_p99_ms"] > 2 * split["itl_p99_ms"]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--splits", "3:3"], "each must use the --gpus 8 GPUs"),
        (["--splits", "4-4"], "give PREFILL:DECODE replicas"),
        (["--splits", "0:8"], "each at least 1"),
        (["--loads", "0.5,fast"], "give shares of capacity"),
        (["--loads", "0"], "give shares of capacity"),
        (["--gpus", "9", "--splits", "5:4"], "give 1 to 8"),
        (["--long-share", "1.5"], "give a share from 0 to 1"),
        (["--counter", "0.1,x"], "give shares of capacity"),
        (["--scale", "0.5"], "--scale takes 1 or more"),
        (["--kv-bytes-per-token", "-1"], "take 0 or more"),
    ],
)
def test_the_disagg_benchmark_refuses_bad_arguments_before_it_starts(
    args: list[str], says: str
) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert says in proc.stderr, proc.stderr
