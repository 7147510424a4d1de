"""The in-memory hour of each model's traffic (llmgw.server.gateway.history): buckets rotating under
an injected clock, gaps, TTFT quantiles within the stated bound, and the memory bounds."""

from __future__ import annotations

import math
import random

import pytest

from llmgw.server.gateway.history import (
    BUCKET_S,
    BUCKETS,
    TTFT_BINS,
    TTFT_ERROR,
    RequestHistory,
    _Series,
    ttft_bin,
    ttft_quantile,
)
from tests.unit.clock import Clock

BOUND = TTFT_ERROR + 1e-9
T0 = 1_800_000_000.0  # a multiple of 10 s: bucket edges fall on whole tens


def test_a_request_lands_in_its_bucket_and_the_hour_has_every_step() -> None:
    clock = Clock(T0 + 3)
    history = RequestHistory(clock=clock)
    history.record("m", ttft=0.2)
    history.record("m", error=True)
    points = history.series("m", now=T0 + 5)
    assert len(points) == BUCKETS
    assert [p.t for p in points[-2:]] == [T0 - BUCKET_S, T0]
    last = points[-1]
    assert (last.requests, last.errors) == (2, 1)
    # The bucket still filling: its rate over the 5 s gone by.
    assert last.rps == pytest.approx(2 / 5)
    assert last.ttft_p50 is not None and abs(last.ttft_p50 / 0.2 - 1) <= BOUND
    # Every other step is a gap: zero requests, no TTFT.
    assert all(p.requests == 0 and p.rps == 0 and p.ttft_p50 is None for p in points[:-1])


def test_buckets_rotate_and_an_hour_old_bucket_reads_empty() -> None:
    clock = Clock(T0)
    history = RequestHistory(clock=clock)
    history.record("m")
    clock.t = T0 + 25  # two buckets later
    history.record("m")
    history.record("m")
    points = history.series("m", now=T0 + 29)
    assert [p.requests for p in points[-3:]] == [1, 0, 2]
    assert points[-3].rps == pytest.approx(1 / BUCKET_S)
    # An hour on, the first bucket's slot is that of the new bucket: its old count is gone.
    clock.t = T0 + BUCKETS * BUCKET_S
    history.record("m", ttft=1.0)
    points = history.series("m")
    assert points[-1].requests == 1 and points[-1].ttft_p99 is not None
    assert sum(p.requests for p in points) == 3  # the two at T0+25 still inside the hour
    clock.t += 30
    assert sum(p.requests for p in history.series("m")) == 1


def test_a_reader_never_sees_a_slot_of_an_older_hour() -> None:
    clock = Clock(T0)
    history = RequestHistory(clock=clock)
    history.record("m")
    # Nothing written for 1.5 hours: the slot the reader maps to holds T0's bucket.
    now = T0 + 1.5 * BUCKETS * BUCKET_S
    assert sum(p.requests for p in history.series("m", now=now)) == 0


def test_steps_add_up_buckets() -> None:
    clock = Clock(T0)
    history = RequestHistory(clock=clock)
    for i in range(6):
        clock.t = T0 + i * BUCKET_S
        for _ in range(i + 1):
            history.record("m", ttft=0.1)
    points = history.series("m", now=T0 + 59.9, step=60)
    assert len(points) == 60
    assert points[-1].requests == 21 and points[-1].t == T0
    assert points[-1].rps == pytest.approx(21 / 59.9)
    with pytest.raises(ValueError, match="multiple of 10"):
        history.series("m", step=15)
    with pytest.raises(ValueError, match="dividing"):
        history.series("m", step=70)


def test_an_unknown_model_reads_as_an_hour_of_zeros() -> None:
    points = RequestHistory(clock=Clock(T0)).series("never")
    assert len(points) == BUCKETS and not any(p.requests for p in points)


@pytest.mark.parametrize("q", [0.5, 0.99])
def test_quantiles_within_the_stated_bound(q: float) -> None:
    rng = random.Random(17)
    for _ in range(20):
        samples = [math.exp(rng.uniform(math.log(0.001), math.log(99.0))) for _ in range(500)]
        counts = [0] * TTFT_BINS
        for s in samples:
            counts[ttft_bin(s)] += 1
        exact = sorted(samples)[max(1, math.ceil(q * len(samples))) - 1]
        got = ttft_quantile(counts, q)
        assert got is not None
        assert abs(got / exact - 1) <= BOUND, (got, exact)


def test_quantile_bins_at_the_edges() -> None:
    assert ttft_bin(0.0) == 0 and ttft_bin(-1.0) == 0 and ttft_bin(0.00099) == 0
    assert ttft_bin(0.001) == 1
    assert ttft_bin(100.0) == TTFT_BINS - 1 and ttft_bin(1e9) == TTFT_BINS - 1
    assert ttft_quantile([0] * TTFT_BINS, 0.5) is None
    # Known data: 99 fast answers (10 ms) and one slow (5 s); p99 the fast, p100 the slow.
    counts = [0] * TTFT_BINS
    counts[ttft_bin(0.010)] = 99
    counts[ttft_bin(5.0)] = 1
    assert abs(ttft_quantile(counts, 0.5) / 0.010 - 1) <= BOUND  # type: ignore[operator]
    assert abs(ttft_quantile(counts, 0.99) / 0.010 - 1) <= BOUND  # type: ignore[operator]
    assert abs(ttft_quantile(counts, 1.0) / 5.0 - 1) <= BOUND  # type: ignore[operator]


def test_memory_per_model_is_fixed() -> None:
    history = RequestHistory(clock=Clock(T0))
    history.record("m")
    series = history._series["m"]
    before = series.nbytes()
    assert before == BUCKETS * (TTFT_BINS + 2) * 4 + BUCKETS * 8 == 80_640
    for i in range(5000):
        history.clock.t = T0 + i  # type: ignore[attr-defined]
        history.record("m", ttft=i / 1000, error=i % 3 == 0)
    assert series.nbytes() == before
    assert _Series().nbytes() == before


def test_series_are_capped_and_a_silent_model_is_dropped_after_its_hour() -> None:
    clock = Clock(T0)
    history = RequestHistory(max_series=2, clock=clock)
    history.record("a")
    history.record("b")
    history.record("c")  # past the cap while a and b are live: not kept
    assert history.models() == ["a", "b"] and history.dropped == 1
    clock.t = T0 + BUCKETS * BUCKET_S - 1
    history.record("b")
    history.record("c")  # a's hour is not over yet
    assert history.models() == ["a", "b"] and history.dropped == 2
    clock.t = T0 + BUCKETS * BUCKET_S
    history.record("c")  # a has been silent an hour: dropped for c
    assert history.models() == ["b", "c"]
    # Read alone, the list drops the silent too.
    clock.t += 2 * BUCKETS * BUCKET_S
    assert history.models() == []
