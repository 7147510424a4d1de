"""The last hour of each model's traffic, kept in memory for the console's charts: per
10-second bucket the requests, the errors and a histogram of time to first token.

Each model has one :class:`_Series`: fixed arrays of ``BUCKETS`` (360) time buckets, used
as a ring (a bucket's slot is its number modulo 360; a slot whose stamp is not the bucket
asked for holds an older hour and reads as empty, and is zeroed when written again). Its
memory is fixed whatever the traffic: 360 x (``TTFT_BINS`` (52) + 2) 4-byte counters plus
360 8-byte stamps, 80,640 bytes of arrays per model. The models are bounded too: at most
``max_series`` (default 128, about 10 MB in all); a model that has recorded nothing for an
hour (undeployed) is dropped when room is needed or when the list is read, and a new model
past the cap while every series is live is not recorded (counted in ``dropped``). Only
deployed models reach :meth:`RequestHistory.record` (the gateway records a request once a
replica was chosen), so the cap is a bound, not a filter of users' input.

TTFT is a fixed log-spaced histogram per bucket: 10 bins per decade from 1 ms to 100 s (bin
edges 10^(k/10) ms), one bin below 1 ms and one at or above 100 s. A quantile is the
nearest-rank sample's bin, reported as the bin's geometric midpoint: within a factor of
10^(1/20) of the true nearest-rank sample, i.e. at most 12.2 % relative error
(``TTFT_ERROR``), for samples between 1 ms and 100 s (below 1 ms it reads 0.5 ms, from 100 s
on it reads 100 s).

What is recorded: every request relayed to a replica, whatever its answer; an error is an
answer of 5xx or a failed relay (the gateway's own refusals before a replica, 401, 404,
429 and queue timeouts, are not requests here). TTFT is that of streamed answers only (the
first chunk after the request arrived); a whole answer's time is not mixed into it. Each
control-plane instance keeps its own: the history shows this instance's gateway.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "BUCKETS",
    "BUCKET_S",
    "MAX_SERIES",
    "TTFT_BINS",
    "TTFT_ERROR",
    "Point",
    "RequestHistory",
    "ttft_bin",
    "ttft_quantile",
]

BUCKET_S = 10
"""Seconds per time bucket."""
BUCKETS = 360
"""Time buckets kept: one hour."""
MAX_SERIES = 128
"""Models kept at most (each 80,640 bytes of counters)."""

_PER_DECADE = 10
_LOW = 1e-3  # seconds: the first edge
_DECADES = 5  # 1 ms .. 100 s
TTFT_BINS = _PER_DECADE * _DECADES + 2
"""Bins of the TTFT histogram: below 1 ms, 50 log-spaced to 100 s, and 100 s or more."""
TTFT_ERROR = 10 ** (1 / (2 * _PER_DECADE)) - 1
"""The largest relative error of a TTFT quantile between 1 ms and 100 s (0.122)."""
_LOG_LOW = math.log10(_LOW)
_LAST = TTFT_BINS - 1


def ttft_bin(seconds: float) -> int:
    """The histogram bin of a TTFT of ``seconds``."""
    if seconds < _LOW:
        return 0
    i = int((math.log10(seconds) - _LOG_LOW) * _PER_DECADE) + 1
    return i if i < _LAST else _LAST


def _bin_value(i: int) -> float:
    """What bin ``i`` reads as: its geometric midpoint (the open ends: their edge)."""
    if i == 0:
        return _LOW / 2
    if i == _LAST:
        return _LOW * 10.0**_DECADES
    return _LOW * 10.0 ** ((i - 0.5) / _PER_DECADE)


def ttft_quantile(counts: list[int] | array[int], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1, nearest rank) of a TTFT histogram; None if empty."""
    total = sum(counts)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    running = 0
    for i, count in enumerate(counts):
        running += count
        if running >= rank:
            return _bin_value(i)
    return _bin_value(_LAST)  # not reached: running ends at total >= rank


@dataclass(frozen=True, slots=True)
class Point:
    """One time step of a model's series: its start (UNIX seconds), requests per second,
    TTFT p50 and p99 in seconds (None: no streamed answer then) and the errors."""

    t: float
    rps: float
    ttft_p50: float | None
    ttft_p99: float | None
    errors: int
    requests: int


class _Series:
    """One model's ring of buckets."""

    __slots__ = ("errors", "last", "requests", "stamps", "ttft")

    def __init__(self) -> None:
        # The bucket number each slot holds (-1: never written).
        self.stamps = array("q", [-1]) * BUCKETS
        self.requests = array("I", [0]) * BUCKETS
        self.errors = array("I", [0]) * BUCKETS
        self.ttft = array("I", [0]) * (BUCKETS * TTFT_BINS)
        self.last = -1  # the newest bucket written

    def nbytes(self) -> int:
        return sum(
            a.itemsize * len(a) for a in (self.stamps, self.requests, self.errors, self.ttft)
        )


_ZERO_BINS = array("I", [0]) * TTFT_BINS


class RequestHistory:
    """Each model's last hour, recorded by the gateway, read by the console and the admin API.

    ``clock`` gives UNIX seconds (the buckets are wall-clock, so that "minutes ago" and the
    times shown agree); injected by tests."""

    def __init__(
        self, *, max_series: int = MAX_SERIES, clock: Callable[[], float] = time.time
    ) -> None:
        self.max_series = max_series
        self.clock = clock
        self._series: dict[str, _Series] = {}
        # Records refused because max_series live models were kept already.
        self.dropped = 0

    def record(self, model: str, *, ttft: float | None = None, error: bool = False) -> None:
        """One request to ``model`` ended (``ttft``: its streamed answer's first chunk, in
        seconds since the request)."""
        bucket = int(self.clock()) // BUCKET_S
        series = self._series.get(model)
        if series is None:
            series = self._add(model, bucket)
            if series is None:
                return
        slot = bucket % BUCKETS
        if series.stamps[slot] != bucket:
            series.stamps[slot] = bucket
            series.requests[slot] = 0
            series.errors[slot] = 0
            series.ttft[slot * TTFT_BINS : (slot + 1) * TTFT_BINS] = _ZERO_BINS
            series.last = bucket
        series.requests[slot] += 1
        if error:
            series.errors[slot] += 1
        if ttft is not None:
            series.ttft[slot * TTFT_BINS + ttft_bin(ttft)] += 1

    def _add(self, model: str, bucket: int) -> _Series | None:
        if len(self._series) >= self.max_series:
            self._prune(bucket)
            if len(self._series) >= self.max_series:
                self.dropped += 1
                return None
        series = self._series[model] = _Series()
        return series

    def _prune(self, bucket: int) -> None:
        """Drop the series with nothing in the hour up to ``bucket``."""
        for name in [n for n, s in self._series.items() if s.last <= bucket - BUCKETS]:
            del self._series[name]

    def models(self, now: float | None = None) -> list[str]:
        """The models with a request in the last hour, sorted."""
        self._prune(int(self.clock() if now is None else now) // BUCKET_S)
        return sorted(self._series)

    def series(self, model: str, now: float | None = None, *, step: int = BUCKET_S) -> list[Point]:
        """``model``'s last hour, oldest first, one point per ``step`` seconds (a multiple of
        the bucket, dividing the hour; default one per bucket): every step present, those
        without requests as 0 with TTFT None. The last point is the step still filling; its
        rate is over the part of it gone by (at least one second)."""
        if step % BUCKET_S or (BUCKETS * BUCKET_S) % step:
            raise ValueError(
                f"step must be a multiple of {BUCKET_S} s dividing {BUCKETS * BUCKET_S} s, "
                f"not {step}"
            )
        at = self.clock() if now is None else now
        per = step // BUCKET_S
        current = int(at) // BUCKET_S
        # Steps aligned on multiples of ``step``: the last one holds ``current``.
        last_step = current // per
        first_bucket = (last_step - BUCKETS // per + 1) * per
        series = self._series.get(model)
        points = []
        for s in range(BUCKETS // per):
            start = first_bucket + s * per
            requests = errors = 0
            bins = [0] * TTFT_BINS
            if series is not None:
                for bucket in range(start, min(start + per, current + 1)):
                    slot = bucket % BUCKETS
                    if series.stamps[slot] != bucket:
                        continue
                    requests += series.requests[slot]
                    errors += series.errors[slot]
                    base = slot * TTFT_BINS
                    for i in range(TTFT_BINS):
                        bins[i] += series.ttft[base + i]
            t = float(start * BUCKET_S)
            span = min(float(step), max(1.0, at - t))
            points.append(
                Point(
                    t=t,
                    rps=requests / span,
                    ttft_p50=ttft_quantile(bins, 0.5),
                    ttft_p99=ttft_quantile(bins, 0.99),
                    errors=errors,
                    requests=requests,
                )
            )
        return points

    def recent_ttft(
        self, model: str, q: float, *, seconds: int = 60, now: float | None = None
    ) -> float | None:
        """``model``'s TTFT ``q`` quantile over the last ``seconds`` (whole buckets, the one
        filling included); None when no streamed answer was recorded in them."""
        series = self._series.get(model)
        if series is None:
            return None
        current = int(self.clock() if now is None else now) // BUCKET_S
        bins = [0] * TTFT_BINS
        for bucket in range(current - max(1, seconds // BUCKET_S) + 1, current + 1):
            slot = bucket % BUCKETS
            if series.stamps[slot] != bucket:
                continue
            base = slot * TTFT_BINS
            for i in range(TTFT_BINS):
                bins[i] += series.ttft[base + i]
        return ttft_quantile(bins, q)
