"""Prometheus metrics of the gateway, rendered in the text exposition format by hand.

Counters, gauges and histograms keyed by label tuples; cheap enough for the request path
(a dict lookup and a bisect per observation).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

__all__ = ["Counter", "Gauge", "Histogram", "Metrics"]

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fmt(value: float) -> str:
    """Exact sample values: whole numbers without exponent, floats round-trippable."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value):
        return str(int(value))
    return repr(value)


class Counter:
    kind = "counter"

    def __init__(self, name: str, help_: str, labels: tuple[str, ...]) -> None:
        self.name, self.help, self.labelnames = name, help_, labels
        self.values: dict[tuple[str, ...], float] = defaultdict(float)

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[labels] += amount

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for key, value in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.labelnames, key)} {_fmt(value)}")
        return out


class Gauge(Counter):
    kind = "gauge"

    def set(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = value

    def dec(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[labels] -= amount


class Histogram:
    def __init__(
        self,
        name: str,
        help_: str,
        labels: tuple[str, ...],
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> None:
        self.name, self.help, self.labelnames, self.buckets = name, help_, labels, buckets
        self.counts: dict[tuple[str, ...], list[int]] = {}
        self.sums: dict[tuple[str, ...], float] = defaultdict(float)

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        counts = self.counts.get(labels)
        if counts is None:
            counts = self.counts[labels] = [0] * (len(self.buckets) + 1)
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[labels] += value

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for key, counts in sorted(self.counts.items()):
            running = 0
            for bound, count in zip(self.buckets, counts, strict=False):
                running += count
                le = 'le="%g"' % bound
                out.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {running}")
            running += counts[-1]
            inf = 'le="+Inf"'
            out.append(f"{self.name}_bucket{_labels(self.labelnames, key, inf)} {running}")
            out.append(f"{self.name}_sum{_labels(self.labelnames, key)} {self.sums[key]:.6f}")
            out.append(f"{self.name}_count{_labels(self.labelnames, key)} {running}")
        return out


class Metrics:
    """Every metric the control plane exports."""

    def __init__(self) -> None:
        mr = ("model", "replica")
        self.requests = Counter(
            "llmgw_requests_total",
            "Gateway requests by model, replica and HTTP status.",
            ("model", "replica", "code"),
        )
        self.latency = Histogram(
            "llmgw_request_duration_seconds", "Time from request to the end of the response.", mr
        )
        self.ttft = Histogram(
            "llmgw_time_to_first_token_seconds",
            "Time from request to the first streamed chunk.",
            mr,
        )
        self.tokens = Counter(
            "llmgw_tokens_total",
            "Tokens by model and kind (prompt, completion, cached).",
            ("model", "kind"),
        )
        self.inflight = Gauge("llmgw_requests_in_flight", "Requests being served now.", mr)
        self.nodes = Gauge("llmgw_nodes", "Nodes by state (connected, disconnected).", ("state",))
        self.ready_replicas = Gauge("llmgw_ready_replicas", "Ready replicas by model.", ("model",))
        self.queued = Gauge(
            "llmgw_queued_requests",
            "Requests waiting in the gateway for a place on a replica (every replica full).",
            ("model",),
        )
        self.queue_wait = Histogram(
            "llmgw_queue_wait_seconds",
            "Time requests waited in the gateway's queue before a replica took them.",
            ("model",),
        )
        # By the key's name (the operator's, never the users' free text): bounded by the keys.
        self.key_requests = Counter(
            "llmgw_key_requests_total",
            "Gateway requests by API key, model and HTTP status.",
            ("key", "model", "code"),
        )
        self.key_tokens = Counter(
            "llmgw_key_tokens_total",
            "Tokens by API key, model and kind (prompt, completion, cached).",
            ("key", "model", "kind"),
        )

    def render(self) -> str:
        lines: list[str] = []
        for metric in (
            self.requests,
            self.latency,
            self.ttft,
            self.tokens,
            self.inflight,
            self.nodes,
            self.ready_replicas,
            self.queued,
            self.queue_wait,
            self.key_requests,
            self.key_tokens,
        ):
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
