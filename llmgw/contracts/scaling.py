"""A deployment's replica count: a fixed ``replicas: N`` or a scaling policy
``replicas: {min: 0, max: 8, ...}`` that the leader's planner follows by demand.

One parser for ``llmgw ctl deploy``, the admin API (``POST /api/models``), the console and
the catalog, so that each refuses a policy in the same words. The policy's keys:

- ``min``, ``max``: the bounds (``min`` may be 0: the model scales to zero when idle);
- ``target_inflight``: the demand (requests in flight plus queued, summed over every gateway
  instance) one replica is meant to carry; the planner wants ``ceil(demand / target)``;
- ``ttft_slo``: optional; when the gateways' TTFT p90 over the last minute exceeds it while
  there is demand, one replica more than demand alone asks for;
- ``scale_down_after``: how long demand must stay below the current count before one replica
  goes (default 5 min), one step at a time;
- ``cold_start_timeout``: how long a request for a model with no ready replica waits for one
  to be placed and become ready (default 5 min);
- ``priority``: ``high``, ``normal`` (default) or ``low``: when GPUs are short, a model's
  demand takes them from models of a lower priority (never below their ``min``);
- ``sleep_after``: optional; a replica idle this long is put to sleep (its profile must say
  ``sleep: {level: N}``): its GPU memory is free for others, its process kept, and the next
  request wakes it;
- ``prefetch``: ``true`` or ``false`` (default): keep the weights of its profile's source in
  the page cache of every node it may be placed on (:mod:`llmgw.server.fleet.warming`), so
  that a replica placed there (a scale-up from zero, a move) loads them from memory rather
  than disk. A fixed count asks for it as ``{min: N, max: N, prefetch: true}``.

It is stored as its JSON (:meth:`ScalingPolicy.to_json`) beside the model; a fixed count
stores none.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.durations import format_duration, parse_duration
from llmgw.errors import ConfigError

__all__ = [
    "DEFAULT_COLD_START_TIMEOUT",
    "DEFAULT_SCALE_DOWN_AFTER",
    "DEFAULT_TARGET_INFLIGHT",
    "MAX_REPLICAS",
    "MAX_TARGET_TOKENS",
    "PRIORITIES",
    "ScalingPolicy",
    "parse_replicas",
    "policy_of",
]

MAX_REPLICAS = 1000
MAX_TARGET_TOKENS = 100_000_000
DEFAULT_TARGET_INFLIGHT = 8
DEFAULT_SCALE_DOWN_AFTER = 300.0
DEFAULT_COLD_START_TIMEOUT = 300.0
_KEYS = (
    "min",
    "max",
    "target_inflight",
    "target_tokens",
    "ttft_slo",
    "scale_down_after",
    "cold_start_timeout",
    "priority",
    "sleep_after",
    "prefetch",
)
PRIORITIES = ("high", "normal", "low")
"""Highest first."""
_EXAMPLE = "e.g. replicas: 2, or replicas: {min: 0, max: 8, target_inflight: 16}"


@dataclass(frozen=True)
class ScalingPolicy:
    """Replicas by demand, between ``min`` and ``max``."""

    min: int
    max: int
    target_inflight: int = DEFAULT_TARGET_INFLIGHT
    ttft_slo: float | None = None  # seconds
    scale_down_after: float = DEFAULT_SCALE_DOWN_AFTER
    cold_start_timeout: float = DEFAULT_COLD_START_TIMEOUT
    priority: str = "normal"
    sleep_after: float | None = None  # seconds; None: its replicas never sleep
    prefetch: bool = False  # its source kept in the page cache of the nodes it may go to
    # Tokens one replica is meant to carry (None: it scales by requests alone).
    target_tokens: int | None = None

    @property
    def rank(self) -> int:
        """Higher for a higher priority (high 2, normal 1, low 0)."""
        return len(PRIORITIES) - 1 - PRIORITIES.index(self.priority)

    def wanted(self, demand: float, tokens: float = 0) -> int:
        """The replicas ``demand`` (requests in flight plus queued) and ``tokens`` (theirs,
        :attr:`target_tokens`'s figure) ask for, within the bounds."""
        return self.clamp(self.asked(demand, tokens))

    def asked(self, demand: float, tokens: float = 0) -> int:
        """What ``demand`` and ``tokens`` ask for, before the bounds: the larger of
        :meth:`by_requests` and :meth:`by_tokens`."""
        return max(self.by_requests(demand), self.by_tokens(tokens))

    def by_requests(self, demand: float) -> int:
        """``ceil(demand / target_inflight)``."""
        return math.ceil(demand / self.target_inflight) if demand > 0 else 0

    def by_tokens(self, tokens: float) -> int:
        """``ceil(tokens / target_tokens)``; 0 without a ``target_tokens``."""
        if self.target_tokens is None or tokens <= 0:
            return 0
        return math.ceil(tokens / self.target_tokens)

    def clamp(self, count: int) -> int:
        return max(self.min, min(self.max, count))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "min": self.min,
            "max": self.max,
            "target_inflight": self.target_inflight,
            "scale_down_after": self.scale_down_after,
            "cold_start_timeout": self.cold_start_timeout,
            "priority": self.priority,
        }
        if self.target_tokens is not None:
            out["target_tokens"] = self.target_tokens
        if self.ttft_slo is not None:
            out["ttft_slo"] = self.ttft_slo
        if self.sleep_after is not None:
            out["sleep_after"] = self.sleep_after
        if self.prefetch:
            out["prefetch"] = True
        return out

    def describe(self) -> str:
        """One line for ``ctl models`` and events: ``0-8 by demand (16 in flight each)``,
        ``0-8 by demand (16 in flight or 32000 tokens each)``."""
        text = f"{self.min}-{self.max} by demand ({self.target_inflight} in flight"
        if self.target_tokens is not None:
            text += f" or {self.target_tokens} tokens"
        text += " each"
        if self.prefetch:
            text += ", prefetch"
        if self.priority != "normal":
            text += f", priority {self.priority}"
        if self.sleep_after is not None:
            text += f", asleep after {format_duration(self.sleep_after)} idle"
        if self.ttft_slo is not None:
            text += f", TTFT p90 <= {format_duration(self.ttft_slo)}"
        return text + ")"


def parse_replicas(value: object, *, key: str = "replicas") -> int | ScalingPolicy:
    """A fixed count (a whole number 0-1000) or a :class:`ScalingPolicy` from its mapping;
    :class:`ConfigError` naming ``key`` and what to write instead."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= MAX_REPLICAS:
            raise ConfigError(f"must be a whole number from 0 to {MAX_REPLICAS}", key=key)
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"must be a whole number or a mapping with min and max ({_EXAMPLE}); got {value!r}",
            key=key,
        )
    unknown = sorted(str(k) for k in value if k not in _KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r}; a scaling policy takes {', '.join(_KEYS)}", key=key
        )
    if "min" not in value or "max" not in value:
        raise ConfigError(f"a scaling policy needs both min and max ({_EXAMPLE})", key=key)
    low = _count(value["min"], f"{key}.min", 0)
    high = _count(value["max"], f"{key}.max", 1)
    if low > high:
        raise ConfigError(f"min ({low}) is above max ({high}); give min <= max", key=key)
    target = _count(
        value.get("target_inflight", DEFAULT_TARGET_INFLIGHT), f"{key}.target_inflight", 1
    )
    tokens = value.get("target_tokens")
    if tokens is not None and (
        not isinstance(tokens, int)
        or isinstance(tokens, bool)
        or not 1 <= tokens <= MAX_TARGET_TOKENS
    ):
        raise ConfigError(
            f"must be a whole number from 1 to {MAX_TARGET_TOKENS} (the prompt tokens a "
            f"prefill pool's replica, or the output tokens any other replica, is meant to "
            f"carry), or left out to scale by requests alone; got {tokens!r}",
            key=f"{key}.target_tokens",
        )
    slo = value.get("ttft_slo")
    sleep_after = value.get("sleep_after")
    priority = value.get("priority", "normal")
    prefetch = value.get("prefetch", False)
    if not isinstance(prefetch, bool):
        raise ConfigError(
            f"must be true or false (keep the weights in the page cache of the nodes the "
            f"model may be placed on); got {prefetch!r}",
            key=f"{key}.prefetch",
        )
    if priority not in PRIORITIES:
        raise ConfigError(
            f"must be one of {', '.join(PRIORITIES)}; got {priority!r}", key=f"{key}.priority"
        )
    return ScalingPolicy(
        min=low,
        max=high,
        target_inflight=target,
        ttft_slo=None if slo is None else _positive(slo, f"{key}.ttft_slo"),
        scale_down_after=_duration(
            value.get("scale_down_after", DEFAULT_SCALE_DOWN_AFTER), f"{key}.scale_down_after"
        ),
        cold_start_timeout=_positive(
            value.get("cold_start_timeout", DEFAULT_COLD_START_TIMEOUT),
            f"{key}.cold_start_timeout",
        ),
        priority=str(priority),
        sleep_after=None if sleep_after is None else _duration(sleep_after, f"{key}.sleep_after"),
        prefetch=prefetch,
        target_tokens=tokens,
    )


def policy_of(stored: Mapping[str, Any] | None) -> ScalingPolicy | None:
    """The policy a model's stored scaling JSON holds; None for a fixed count (``{}``)."""
    if not stored:
        return None
    policy = parse_replicas(dict(stored), key="scaling")
    return policy if isinstance(policy, ScalingPolicy) else None


def _count(value: object, key: str, lowest: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lowest <= value <= MAX_REPLICAS:
        raise ConfigError(
            f"must be a whole number from {lowest} to {MAX_REPLICAS}; got {value!r}", key=key
        )
    return value


def _duration(value: object, key: str) -> float:
    try:
        return parse_duration(value)
    except ConfigError as exc:
        raise ConfigError(str(exc), key=key) from None


def _positive(value: object, key: str) -> float:
    seconds = _duration(value, key)
    if seconds <= 0:
        raise ConfigError(f"must be more than 0 s; got {value!r}", key=key)
    return seconds
