"""Prometheus metrics of the gateway, rendered in the text exposition format by hand.

Counters, gauges and histograms keyed by label tuples; cheap enough for the request path
(a dict lookup and a bisect per observation).
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Mapping

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
# Replica starts: llmgw's own part (tens of ms) to an engine loading a large model (minutes).
START_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05)


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

    def quantile(self, labels: tuple[str, ...], q: float) -> float | None:
        """The ``q`` quantile of the values observed under ``labels``, from the buckets as
        Prometheus's histogram_quantile reads them (linear within a bucket; beyond the last
        bound: that bound); None when none was observed."""
        counts = self.counts.get(labels)
        total = sum(counts) if counts else 0
        if not counts or not total:
            return None
        rank, running, lower = q * total, 0, 0.0
        for bound, count in zip(self.buckets, counts, strict=False):
            if count and running + count >= rank:
                return lower + (bound - lower) * (rank - running) / count
            running += count
            lower = bound
        return self.buckets[-1]

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
        self.stream_resumes = Counter(
            "llmgw_stream_resumes_total",
            "Streams that broke after their first token and were continued on another replica, "
            "by model, cause (reset: the connection broke; timeout: the replica went silent; "
            "error: the replica sent an error event; eof: it ended without [DONE]) and outcome (completed, broken: it broke "
            "again, no_replica, refused: the other replica did not take it).",
            ("model", "cause", "outcome"),
        )
        self.request_retries = Counter(
            "llmgw_request_retries_total",
            "Requests sent again, whole, to another replica because theirs failed before a byte "
            "of the answer reached the client (a non-streamed answer cut short, a stream broken "
            "before its first byte), by model, cause (reset, timeout, protocol; engine_reset, "
            "engine_timeout: the engine failed under its agent) and outcome (answered, "
            "refused: the other replica answered a 4xx, failed: it failed too, no_replica).",
            ("model", "cause", "outcome"),
        )
        self.streams_broken = Counter(
            "llmgw_streams_broken_total",
            "Streams that broke after their first token and ended with an error event, by model "
            "and why they were not resumed (off, endpoint, n, logprobs, tool_calls, reasoning, "
            "engine, prompt, limit, max_resumes, no_replica, refused, finished). With resume off "
            "the gateway reads nothing of a stream: only a broken connection is counted.",
            ("model", "reason"),
        )
        # A stop's drain (llmgw.server.ha.drain).
        self.draining = Gauge(
            "llmgw_instance_draining",
            "1 while this instance drains before its stop (SIGTERM: /healthz answers 503, then "
            "no new connection while the requests in flight end), else 0.",
            (),
        )
        self.draining.set((), 0)
        self.drain_cut = Counter(
            "llmgw_drain_requests_cut_total",
            "Requests still in flight when a drain gave up on them, cut, by kind (stream, "
            "request: the others) and when (drain_timeout, or signal: a second stop signal). "
            "Counted just before the process stops: its log line 'streams cut' and the event "
            "instance_stopped keep them.",
            ("kind", "at"),
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
        self.gpus = Gauge(
            "llmgw_gpus",
            "GPUs of all nodes by state (healthy, unhealthy: an XID or vanished from NVML, "
            "cordoned by an operator).",
            ("state",),
        )
        self.sleepers_host_memory = Gauge(
            "llmgw_sleepers_host_memory_bytes",
            "Host memory the sleeping replicas of a node hold (level 1 keeps the weights): "
            "as their engines said, else their weights' size as the node lists them.",
            ("node",),
        )
        self.warm_source_bytes = Gauge(
            "llmgw_warm_source_bytes",
            "Bytes of model sources a node reports warm in its page cache (prefetch: true), "
            "as its last inventory said; 0 for a node that had some and has none now.",
            ("node",),
        )
        self.ready_replicas = Gauge("llmgw_ready_replicas", "Ready replicas by model.", ("model",))
        self.replica_states = Gauge(
            "llmgw_replicas",
            "Replicas by model and state (ready; asleep, waking, falling_asleep: sleeping "
            "replicas; starting, pending, failed, stopping).",
            ("model", "state"),
        )
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
        self._demand_metrics()
        self._relay_metrics()
        self._disagg_metrics()
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
        # Cache-aware routing (llmgw.server.gateway.prefixes).
        self.replica_tokens = Counter(
            "llmgw_replica_prompt_tokens_total",
            "Prompt tokens by model and replica, as the engine reported them (kind: prompt, "
            "and cached: those its prefix cache already held).",
            (*mr, "kind"),
        )
        self.routing = Counter(
            "llmgw_routing_decisions_total",
            "Replica choices by model, routing policy and reason (prefix_hit, spread, "
            "session, session_moved, no_prefix, least_outstanding, round_robin, no_tokenizer).",
            ("model", "policy", "reason"),
        )
        self.decision = Histogram(
            "llmgw_routing_decision_seconds",
            "Time to route a request by its prefix, by phase: keys (tokenise and hash the "
            "prompt) and choose (index lookup and scoring).",
            ("model", "phase"),
            DECISION_BUCKETS,
        )

    def set_replica_states(self, counts: Mapping[tuple[str, str], int]) -> None:
        """``llmgw_replicas`` as the store counts them now ((model, state) -> replicas): a
        state no replica is in any more reads 0 until its model goes."""
        models = {model for model, _ in counts}
        for key in list(self.replica_states.values):
            if key[0] not in models:
                del self.replica_states.values[key]
            elif key not in counts:
                self.replica_states.values[key] = 0
        for key, n in counts.items():
            self.replica_states.set(key, n)

    def show_warm_bytes(self, node_id: str, size: int) -> None:
        """``llmgw_warm_source_bytes`` for a node's new inventory: no series for a node that
        never kept anything warm (most of a fleet), 0 once it had some and has none."""
        if size or (node_id,) in self.warm_source_bytes.values:
            self.warm_source_bytes.set((node_id,), size)

    def set_gpus(self, counts: Mapping[str, int]) -> None:
        """The GPUs gauge: how many GPUs are in each state now."""
        for state, count in counts.items():
            self.gpus.set((state,), count)

    def _demand_metrics(self) -> None:
        """Serving by demand (llmgw.server.gateway.capacity, llmgw.server.fleet.planner)."""
        self.capacity_waiting = Gauge(
            "llmgw_capacity_waiting_requests",
            "Requests waiting for a model to have a ready replica at all (a cold start).",
            ("model",),
        )
        self.capacity_wait = Histogram(
            "llmgw_capacity_wait_seconds",
            "Time requests waited for a replica of their model to exist (cold starts).",
            ("model",),
        )
        self.desired_replicas = Gauge(
            "llmgw_desired_replicas",
            "Replicas each model wants, as deployed or as the planner set it by demand.",
            ("model",),
        )
        self.replica_start = Histogram(
            "llmgw_replica_start_seconds",
            "Time from a replica's placement to its being routable, by part: engine (its "
            "process start to its health check passing, as its agent measured) and llmgw "
            "(the rest: the order, the agent, the report, the route).",
            ("model", "part"),
            START_BUCKETS,
        )
        self.replica_wake = Histogram(
            "llmgw_replica_wake_seconds",
            "Time from a wake order to the replica being routable again, by part: engine "
            "(its agent's call to the engine's answer) and llmgw (the rest).",
            ("model", "part"),
            START_BUCKETS,
        )
        self.scaling_decisions = Counter(
            "llmgw_scaling_decisions_total",
            "The planner's changes of a model's replica count, by direction (up, down) and "
            "reason (demand: requests; tokens; ttft_slo, bounds, idle).",
            ("model", "direction", "reason"),
        )

    def hit_ratio(self, model: str, replica: str | None = None) -> float | None:
        """The share of prompt tokens the engines had cached, for a model (or one replica of
        it) since this instance started; None before any prompt token was reported."""
        prompt = cached = 0.0
        for (m, r, kind), value in self.replica_tokens.values.items():
            if m != model or (replica is not None and r != replica):
                continue
            if kind == "prompt":
                prompt += value
            else:
                cached += value
        return cached / prompt if prompt else None

    def _derived(self, index_sizes: Mapping[tuple[str, str], int]) -> list[str]:
        out = [
            "# HELP llmgw_prefix_cache_hit_ratio Share of prompt tokens the replica's engine "
            "had in its prefix cache, since this instance started.",
            "# TYPE llmgw_prefix_cache_hit_ratio gauge",
        ]
        replicas = sorted({(m, r) for m, r, _ in self.replica_tokens.values})
        for model, replica in replicas:
            ratio = self.hit_ratio(model, replica)
            if ratio is not None:
                labels = _labels(("model", "replica"), (model, replica))
                out.append(f"llmgw_prefix_cache_hit_ratio{labels} {_fmt(ratio)}")
        out += [
            "# HELP llmgw_prefix_index_blocks Block keys the gateway's prefix index holds, by "
            "model and index (events: reported by the engines; approx: what it sent where).",
            "# TYPE llmgw_prefix_index_blocks gauge",
        ]
        for (model, index), count in sorted(index_sizes.items()):
            labels = _labels(("model", "index"), (model, index))
            out.append(f"llmgw_prefix_index_blocks{labels} {count}")
        return out

    def _relay_metrics(self) -> None:
        """The KV events relay between instances (llmgw.server.ha.kvrelay)."""
        self.kv_relay_frames = Counter(
            "llmgw_kv_relay_frames_total",
            "KV event frames of the relay between instances, by side (sent: put to a standby's "
            "stream by this leader, once per standby; applied: taken from the leader by this "
            "standby, the snapshots' included).",
            ("side",),
        )
        self.kv_relay_standbys = Gauge(
            "llmgw_kv_relay_standbys",
            "Standbys following this leader's KV events now.",
            (),
        )
        self.kv_relay_cut_off = Counter(
            "llmgw_kv_relay_cut_off_total",
            "Standbys this leader cut off for falling too far behind its KV events (each dials "
            "again and is sent the whole index).",
            (),
        )

    def _disagg_metrics(self) -> None:
        """Disaggregated models' hand-over between their pools (llmgw.server.gateway.disagg);
        each pool's load is its replicas' in llmgw_requests_in_flight and these."""
        self.disagg_requests = Counter(
            "llmgw_disagg_requests_total",
            "Requests to disaggregated models by outcome: handed_over (prefilled on the "
            "prefill pool, decoded on the decode pool), failed (prefilled, the decode "
            "refused or failed) or fallback (run whole on a decode replica).",
            ("model", "outcome"),
        )
        self.disagg_fallbacks = Counter(
            "llmgw_disagg_fallbacks_total",
            "Requests to disaggregated models run whole on a decode replica, by reason: "
            "no_prefill (no prefill replica ready, or all tried failed), prefill_busy (none "
            "free within queue_timeout), transfer_timeout (no first token within the "
            "transfer_timeout), no_transfer_params (the prefill named no KV to pull), "
            "no_transfer_addr (an SGLang prefill replica without its bootstrap address), "
            "endpoint (an endpoint without hand-over).",
            ("model", "reason"),
        )
        self.disagg_prefill_retries = Counter(
            "llmgw_disagg_prefill_retries_total",
            "Prefills sent again to another prefill replica after one failed.",
            ("model",),
        )
        self.disagg_handover = Histogram(
            "llmgw_disagg_handover_seconds",
            "Time from the prefill's answer to the decode's first streamed token: the KV "
            "transfer and the first step.",
            ("model",),
        )
        self.disagg_prefill = Histogram(
            "llmgw_disagg_prefill_seconds",
            "Time a prefill replica took to answer the prefill (its place taken).",
            ("model",),
        )
        self.disagg_transfer_tokens = Counter(
            "llmgw_disagg_transfer_tokens_total",
            "Prompt tokens whose KV a decode replica took from a prefill rather than "
            "computing them: the prompt tokens the prefill reported (an upper bound: a "
            "decode's own prefix cache may hold some, which no engine reports per request).",
            ("model",),
        )
        self.disagg_transfer_bytes = Counter(
            "llmgw_disagg_transfer_bytes_total",
            "Bytes of KV those tokens moved: llmgw_disagg_transfer_tokens_total times the "
            "profile's disaggregated.kv_bytes_per_token (the sim's own by default); not "
            "counted for a model without it.",
            ("model",),
        )
        self.decoding_tokens = Gauge(
            "llmgw_decoding_tokens",
            "Output tokens the requests on a decode pool's replica may still generate (what "
            "the gateway chooses decode replicas by, least first).",
            ("model", "replica"),
        )

    def render(self, index_sizes: Mapping[tuple[str, str], int] | None = None) -> str:
        """The exposition; ``index_sizes``: (model, index) -> block keys in the gateway's
        prefix indexes (:meth:`llmgw.server.gateway.prefixes.PrefixRouting.index_sizes`)."""
        lines: list[str] = []
        for metric in (
            self.requests,
            self.stream_resumes,
            self.request_retries,
            self.streams_broken,
            self.draining,
            self.drain_cut,
            self.latency,
            self.ttft,
            self.tokens,
            self.inflight,
            self.nodes,
            self.gpus,
            self.sleepers_host_memory,
            self.warm_source_bytes,
            self.ready_replicas,
            self.replica_states,
            self.queued,
            self.queue_wait,
            self.capacity_waiting,
            self.capacity_wait,
            self.desired_replicas,
            self.replica_start,
            self.replica_wake,
            self.scaling_decisions,
            self.key_requests,
            self.key_tokens,
            self.replica_tokens,
            self.routing,
            self.decision,
            self.kv_relay_frames,
            self.kv_relay_standbys,
            self.kv_relay_cut_off,
            self.disagg_requests,
            self.disagg_fallbacks,
            self.disagg_prefill_retries,
            self.disagg_handover,
            self.disagg_prefill,
            self.disagg_transfer_tokens,
            self.disagg_transfer_bytes,
            self.decoding_tokens,
        ):
            lines.extend(metric.render())
        lines.extend(self._derived(index_sizes or {}))
        return "\n".join(lines) + "\n"
