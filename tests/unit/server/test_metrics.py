"""The gateway's hand-rendered Prometheus metrics, checked against the text exposition format."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.server.common.metrics import LATENCY_BUCKETS, Counter, Gauge, Histogram, Metrics

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}


@dataclass
class Family:
    name: str
    help: str | None = None
    type: str | None = None
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def _parse_float(text: str) -> float:
    if text in ("+Inf", "Inf"):
        return math.inf
    if text == "-Inf":
        return -math.inf
    if text == "NaN":
        return math.nan
    assert re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", text), f"bad value {text!r}"
    return float(text)


def _parse_labels(text: str, pos: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="x",b="y"}`` starting at ``text[pos] == '{'``; return labels and end index."""
    assert text[pos] == "{"
    pos += 1
    labels: dict[str, str] = {}
    while text[pos] != "}":
        m = LABEL_NAME.match(text, pos)
        assert m, f"bad label name at {text[pos:]!r}"
        name = m.group()
        pos = m.end()
        assert text[pos : pos + 2] == '="', f'expected =" after {name} in {text!r}'
        pos += 2
        value = []
        while True:
            c = text[pos]
            if c == "\\":
                nxt = text[pos + 1]
                assert nxt in '\\"n', f"bad escape \\{nxt} in {text!r}"
                value.append({"\\": "\\", '"': '"', "n": "\n"}[nxt])
                pos += 2
            elif c == '"':
                pos += 1
                break
            else:
                assert c != "\n"
                value.append(c)
                pos += 1
        assert name not in labels, f"label {name} repeated in {text!r}"
        labels[name] = "".join(value)
        if text[pos] == ",":
            pos += 1
        else:
            assert text[pos] == "}", f"expected , or }} in {text!r}"
    return labels, pos + 1


def parse_exposition(text: str) -> dict[str, Family]:
    """A strict parser of the Prometheus text format (0.0.4); asserts on anything invalid."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    families: dict[str, Family] = {}
    current: Family | None = None
    closed: set[str] = set()
    for line in text[:-1].split("\n"):
        assert line, "no blank lines expected"
        if line.startswith("#"):
            m = re.fullmatch(r"# (HELP|TYPE) (\S+) (.*)", line)
            assert m, f"bad comment line {line!r}"
            kind, name, rest = m.groups()
            assert METRIC_NAME.fullmatch(name), name
            if current is None or current.name != name:
                assert name not in families, f"family {name} appears twice"
                if current is not None:
                    closed.add(current.name)
                current = families[name] = Family(name)
            assert not current.samples, f"# {kind} {name} after its samples"
            if kind == "HELP":
                assert current.help is None, f"two HELP lines for {name}"
                current.help = rest
            else:
                assert current.type is None, f"two TYPE lines for {name}"
                assert rest in TYPES, rest
                current.type = rest
            continue
        m = METRIC_NAME.match(line)
        assert m, f"bad sample line {line!r}"
        sample_name = m.group()
        pos = m.end()
        labels: dict[str, str] = {}
        if pos < len(line) and line[pos] == "{":
            labels, pos = _parse_labels(line, pos)
        assert line[pos] == " ", f"expected a space in {line!r}"
        value, *timestamp = line[pos + 1 :].split(" ")
        assert len(timestamp) <= 1
        assert current is not None, f"sample {sample_name} before any # TYPE"
        allowed = {current.name}
        if current.type == "histogram":
            allowed = {current.name + s for s in ("_bucket", "_sum", "_count")}
        assert sample_name in allowed, f"sample {sample_name} outside its family {current.name}"
        current.samples.append((sample_name, labels, _parse_float(value)))
    for fam in families.values():
        assert fam.help is not None and fam.type is not None, fam.name
    return families


def check_histogram(fam: Family, buckets: tuple[float, ...]) -> dict[tuple, dict]:  # type: ignore[type-arg]
    """Check every series of a histogram family; return them keyed by their labels."""
    series: dict[tuple, dict] = {}  # type: ignore[type-arg]
    for name, labels, value in fam.samples:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        s = series.setdefault(key, {"buckets": [], "sum": None, "count": None})
        if name.endswith("_bucket"):
            assert "le" in labels
            s["buckets"].append((_parse_float(labels["le"]), value))
        elif name.endswith("_sum"):
            assert "le" not in labels and s["sum"] is None
            s["sum"] = value
        else:
            assert "le" not in labels and s["count"] is None
            s["count"] = value
    for key, s in series.items():
        bounds = [b for b, _ in s["buckets"]]
        counts = [c for _, c in s["buckets"]]
        assert bounds == [*sorted(buckets), math.inf], key
        assert counts == sorted(counts), f"buckets of {key} are not cumulative: {counts}"
        assert s["sum"] is not None, f"{fam.name}_sum missing for {key}"
        assert s["count"] is not None, f"{fam.name}_count missing for {key}"
        assert counts[-1] == s["count"], "+Inf bucket differs from _count"
    return series


# --------------------------------------------------------------------------- tests


def test_empty_metrics_render_help_and_type_only() -> None:
    text = Metrics().render()
    families = parse_exposition(text)
    assert set(families) == {
        "llmgw_requests_total",
        "llmgw_stream_resumes_total",
        "llmgw_request_retries_total",
        "llmgw_streams_broken_total",
        "llmgw_instance_draining",
        "llmgw_drain_requests_cut_total",
        "llmgw_request_duration_seconds",
        "llmgw_time_to_first_token_seconds",
        "llmgw_tokens_total",
        "llmgw_requests_in_flight",
        "llmgw_nodes",
        "llmgw_gpus",
        "llmgw_sleepers_host_memory_bytes",
        "llmgw_warm_source_bytes",
        "llmgw_ready_replicas",
        "llmgw_replicas",
        "llmgw_queued_requests",
        "llmgw_queue_wait_seconds",
        "llmgw_capacity_waiting_requests",
        "llmgw_capacity_wait_seconds",
        "llmgw_desired_replicas",
        "llmgw_replica_start_seconds",
        "llmgw_replica_wake_seconds",
        "llmgw_scaling_decisions_total",
        "llmgw_key_requests_total",
        "llmgw_key_tokens_total",
        "llmgw_replica_prompt_tokens_total",
        "llmgw_routing_decisions_total",
        "llmgw_routing_decision_seconds",
        "llmgw_prefix_cache_hit_ratio",
        "llmgw_prefix_index_blocks",
        "llmgw_kv_relay_frames_total",
        "llmgw_kv_relay_standbys",
        "llmgw_kv_relay_cut_off_total",
        "llmgw_disagg_requests_total",
        "llmgw_disagg_fallbacks_total",
        "llmgw_disagg_prefill_retries_total",
        "llmgw_disagg_handover_seconds",
        "llmgw_disagg_prefill_seconds",
        "llmgw_disagg_transfer_tokens_total",
        "llmgw_disagg_transfer_bytes_total",
        "llmgw_decoding_tokens",
    }
    assert families["llmgw_requests_total"].type == "counter"
    assert families["llmgw_request_duration_seconds"].type == "histogram"
    assert families["llmgw_requests_in_flight"].type == "gauge"
    # The one sample: not draining (0), so that a dashboard sees the gauge before any stop.
    draining = families.pop("llmgw_instance_draining")
    assert draining.type == "gauge" and len(draining.samples) == 1
    for fam in families.values():
        assert fam.help
        assert fam.samples == []
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or line == "llmgw_instance_draining 0"


def test_full_render_is_valid() -> None:
    m = Metrics()
    m.requests.inc(("m1", "r1", "200"))
    m.requests.inc(("m1", "r1", "200"))
    m.requests.inc(("m1", "r2", "502"))
    m.tokens.inc(("m1", "completion"), 17)
    m.inflight.inc(("m1", "r1"))
    m.inflight.inc(("m1", "r1"))
    m.inflight.dec(("m1", "r1"))
    m.nodes.set(("connected",), 3)
    m.ready_replicas.set(("m1",), 2)
    for v in (0.0004, 0.003, 0.003, 0.2, 7.0, 500.0):
        m.latency.observe(("m1", "r1"), v)
    m.ttft.observe(("m1", "r2"), 0.01)

    families = parse_exposition(m.render())
    req = families["llmgw_requests_total"].samples
    assert ("llmgw_requests_total", {"model": "m1", "replica": "r1", "code": "200"}, 2.0) in req
    assert ("llmgw_requests_total", {"model": "m1", "replica": "r2", "code": "502"}, 1.0) in req
    assert families["llmgw_tokens_total"].samples == [
        ("llmgw_tokens_total", {"model": "m1", "kind": "completion"}, 17.0)
    ]
    assert families["llmgw_requests_in_flight"].samples == [
        ("llmgw_requests_in_flight", {"model": "m1", "replica": "r1"}, 1.0)
    ]
    assert families["llmgw_nodes"].samples == [("llmgw_nodes", {"state": "connected"}, 3.0)]

    lat = check_histogram(families["llmgw_request_duration_seconds"], LATENCY_BUCKETS)
    (series,) = lat.values()
    assert series["count"] == 6
    assert series["sum"] == pytest.approx(507.2064, abs=1e-5)
    by_le = dict(series["buckets"])
    assert by_le[0.001] == 1
    assert by_le[0.005] == 3
    assert by_le[0.25] == 4
    assert by_le[10] == 5
    assert by_le[120] == 5
    assert by_le[math.inf] == 6
    check_histogram(families["llmgw_time_to_first_token_seconds"], LATENCY_BUCKETS)


def test_histogram_bound_is_inclusive() -> None:
    h = Histogram("h", "help", ("a",), buckets=(1.0, 2.0))
    h.observe(("x",), 1.0)
    h.observe(("x",), 2.0)
    h.observe(("x",), 2.5)
    fam = parse_exposition("\n".join(h.render()) + "\n")["h"]
    (series,) = check_histogram(fam, (1.0, 2.0)).values()
    assert series["buckets"] == [(1.0, 1), (2.0, 2), (math.inf, 3)]
    assert series["count"] == 3
    assert series["sum"] == pytest.approx(5.5)


def test_histogram_without_labels() -> None:
    h = Histogram("plain_seconds", "help", (), buckets=(0.5,))
    h.observe((), 0.1)
    lines = h.render()
    assert 'plain_seconds_bucket{le="0.5"} 1' in lines
    assert 'plain_seconds_bucket{le="+Inf"} 1' in lines
    assert "plain_seconds_count 1" in lines
    assert any(line.startswith("plain_seconds_sum ") for line in lines)
    check_histogram(parse_exposition("\n".join(lines) + "\n")["plain_seconds"], (0.5,))


@pytest.mark.parametrize(
    "value",
    ['say "hi"', "back\\slash", "two\nlines", '\\"\n\\n', "", "plain", "ünïcödé {},="],
)
def test_label_escaping_round_trips(value: str) -> None:
    c = Counter("c_total", "help", ("model",))
    c.inc((value,))
    g = Gauge("g", "help", ("model",))
    g.set((value,), 2)
    h = Histogram("h", "help", ("model",), buckets=(1.0,))
    h.observe((value,), 0.5)
    text = "\n".join(c.render() + g.render() + h.render()) + "\n"
    assert len(text[:-1].split("\n")) == 3 + 3 + 6  # no raw newline leaked into a line
    families = parse_exposition(text)
    assert families["c_total"].samples == [("c_total", {"model": value}, 1.0)]
    assert families["g"].samples == [("g", {"model": value}, 2.0)]
    for _, labels, _ in families["h"].samples:
        assert labels["model"] == value
    check_histogram(families["h"], (1.0,))


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=12),
        st.lists(st.floats(0, 200, allow_nan=False), min_size=1, max_size=20),
        max_size=4,
    )
)
def test_histogram_property(observations: dict[str, list[float]]) -> None:
    h = Histogram("p_seconds", "help", ("model",))
    c = Counter("p_total", "help", ("model",))
    for model, values in observations.items():
        for v in values:
            h.observe((model,), v)
            c.inc((model,))
    families = parse_exposition("\n".join(h.render() + c.render()) + "\n")
    series = check_histogram(families["p_seconds"], LATENCY_BUCKETS)
    assert {dict(k)["model"] for k in series} == set(observations)
    for key, s in series.items():
        values = observations[dict(key)["model"]]
        assert s["count"] == len(values)
        assert s["sum"] == pytest.approx(sum(values), abs=1e-5)
        for bound, count in s["buckets"]:
            assert count == sum(1 for v in values if v <= bound)
    counts = {labels["model"]: v for _, labels, v in families["p_total"].samples}
    assert counts == {m: len(v) for m, v in observations.items()}


def test_small_counter_values_are_exact() -> None:
    c = Counter("c_total", "help", ("k",))
    c.inc(("a",), 999_999)
    c.inc(("b",), 0.5)
    samples = parse_exposition("\n".join(c.render()) + "\n")["c_total"].samples
    assert samples == [("c_total", {"k": "a"}, 999_999.0), ("c_total", {"k": "b"}, 0.5)]


def test_large_counter_values_are_exact() -> None:
    c = Counter("llmgw_tokens_total", "help", ("model", "kind"))
    c.inc(("m", "completion"), 1_234_567)
    first = parse_exposition("\n".join(c.render()) + "\n")["llmgw_tokens_total"].samples
    c.inc(("m", "completion"), 3)
    second = parse_exposition("\n".join(c.render()) + "\n")["llmgw_tokens_total"].samples
    assert first[0][2] == 1_234_567
    assert second[0][2] == 1_234_570


def test_replicas_by_state_count_the_sleeping_and_forget_what_is_gone() -> None:
    m = Metrics()
    m.set_replica_states({("a", "ready"): 2, ("a", "asleep"): 1, ("b", "waking"): 1})
    text = m.render()
    assert 'llmgw_replicas{model="a",state="asleep"} 1' in text
    assert 'llmgw_replicas{model="b",state="waking"} 1' in text
    m.set_replica_states({("a", "ready"): 3})
    text = m.render()
    assert 'llmgw_replicas{model="a",state="asleep"} 0' in text  # none asleep now
    assert 'model="b"' not in text  # its model went


def test_the_gpus_gauge_by_state() -> None:
    metrics = Metrics()
    metrics.set_gpus({"healthy": 6, "unhealthy": 1, "cordoned": 1})
    text = metrics.render()
    assert 'llmgw_gpus{state="healthy"} 6' in text
    assert 'llmgw_gpus{state="unhealthy"} 1' in text
    assert 'llmgw_gpus{state="cordoned"} 1' in text
