"""An API key's policy: the models it may call, its rate limits, its token budget, its
priority in the gateway's queues and its expiry; and one day of its usage, as stored.

The admin API takes the policy as JSON (``llmgw ctl keys create|update`` send it), the store
keeps it in the key's row, and the gateway's request path reads it from memory
(:mod:`llmgw.server.gateway.serving`). One parser here serves all three, so that a limit means the
same thing everywhere:

- ``rpm`` / ``tpm``: requests / tokens (prompt + completion) per minute, enforced as token
  buckets that refill continuously (a key at ``rpm: 60`` gets one request a second, and a
  burst of at most 60);
- ``max_concurrent``: requests of the key in flight at once (a stream until its last chunk);
- ``budget``: tokens per calendar period in UTC, ``10M/day`` or ``100M/month`` (a day starts
  at 00:00 UTC, a month on its first day); spent, the key gets 429 ``insufficient_quota``
  until the next period;
- ``priority``: ``high``, ``normal`` or ``low``, the key's weight when requests wait for a
  model that is full (:data:`PRIORITY_WEIGHTS`);
- ``models``: the models the key may call (empty: all);
- ``expires_at``: when the key stops working (UNIX time; None: never);
- ``resume``: false turns off, for this key's requests, the gateway's continuing of a stream
  (and retrying of an answer) on another replica when theirs breaks mid-answer
  (:mod:`llmgw.server.gateway.resume`); true (the default) leaves it to the model's profile.
  Off for the key wins over the profile's on.
"""

from __future__ import annotations

import datetime
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from llmgw.contracts.catalog import MODEL_NAME
from llmgw.contracts.disagg import split_pool
from llmgw.durations import parse_duration
from llmgw.errors import ConfigError

__all__ = [
    "BUDGET_PERIODS",
    "MAX_LIMIT",
    "POLICY_FIELDS",
    "PRIORITIES",
    "PRIORITY_WEIGHTS",
    "USAGE_COUNTS",
    "Budget",
    "KeyPolicy",
    "UsageRow",
    "describe_changes",
    "format_count",
    "parse_budget",
    "parse_count",
    "period_start",
    "policy_changes",
    "policy_from_json",
    "usage_day",
    "usage_day_from",
]

PRIORITIES: tuple[str, ...] = ("high", "normal", "low")
PRIORITY_WEIGHTS: Mapping[str, int] = {"high": 4, "normal": 2, "low": 1}
"""How many requests a key of each priority is served, in the gateway's fair queues, for
each one a ``low`` key is: a weighted round robin across the keys that have requests
waiting, so that no key waits behind another's whole queue."""

BUDGET_PERIODS: tuple[str, ...] = ("day", "month")
MAX_LIMIT = 10**15
"""The largest number a limit or a budget may be (past any real use; it keeps the store's
integers and the token buckets' floats exact)."""
USAGE_COUNTS: tuple[str, ...] = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "errors",
)
"""The counters of a :class:`UsageRow` (and the usage table's columns)."""
MAX_MODELS = 256
"""The most models one key may name."""

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}
_COUNT = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kKmMgGbBtT]?)")
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
POLICY_FIELDS: tuple[str, ...] = (
    "models",
    "rpm",
    "tpm",
    "max_concurrent",
    "budget",
    "priority",
    "expires",
    "resume",
)
"""The fields of a key's policy in the admin API's JSON (:func:`policy_from_json`)."""
_POLICY_KEYS = POLICY_FIELDS


@dataclass(frozen=True)
class Budget:
    """``tokens`` per calendar ``period`` (``day`` or ``month``, in UTC)."""

    tokens: int
    period: str

    def __str__(self) -> str:
        return f"{format_count(self.tokens)}/{self.period}"


@dataclass(frozen=True)
class KeyPolicy:
    """What a key may do. Every limit None (or ``models`` empty) means: not limited."""

    models: tuple[str, ...] = ()
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    budget: Budget | None = None
    priority: str = "normal"
    expires_at: float | None = None
    resume: bool = True

    @property
    def weight(self) -> int:
        return PRIORITY_WEIGHTS[self.priority]

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def summary(self, *, expiry: bool = False) -> str:
        """The limits in a few words (``models llama, rpm 60, budget 10M/day, priority
        high``; ``unlimited``), for a table's column and the events; with *expiry*, when
        the key expires too (a table gives that a column of its own)."""
        parts: list[str] = []
        if self.models:
            many = len(self.models) > 3
            parts.append(
                f"{len(self.models)} models" if many else "models " + ",".join(self.models)
            )
        for name, value in (("rpm", self.rpm), ("tpm", self.tpm)):
            if value is not None:
                parts.append(f"{name} {format_count(value)}")
        if self.max_concurrent is not None:
            parts.append(f"{self.max_concurrent} at once")
        if self.budget is not None:
            parts.append(f"budget {self.budget}")
        if self.priority != "normal":
            parts.append(f"priority {self.priority}")
        if expiry and self.expires_at is not None:
            parts.append(f"expires {_shown('expires_at', self.expires_at)}")
        if not self.resume:
            parts.append("no resume")
        return ", ".join(parts) or "unlimited"

    def to_json(self) -> dict[str, Any]:
        """As the admin API answers it: every field, None where not limited."""
        return {
            "models": list(self.models),
            "rpm": self.rpm,
            "tpm": self.tpm,
            "max_concurrent": self.max_concurrent,
            "budget": str(self.budget) if self.budget is not None else None,
            "priority": self.priority,
            "expires_at": self.expires_at,
            "resume": self.resume,
        }


def policy_from_json(
    data: Mapping[str, Any], *, base: KeyPolicy | None = None, now: float | None = None
) -> KeyPolicy:
    """The policy that ``data`` (the admin API's JSON: ``models``, ``rpm``, ``tpm``,
    ``max_concurrent``, ``budget``, ``priority``, ``expires``, ``resume``) makes of ``base`` (a new key's
    defaults when None). A key absent keeps ``base``'s value; null clears a limit (``expires:
    null``: never expires). ``expires`` is a duration from ``now`` (``90d``) or ``never``.
    Raises :class:`ConfigError` naming the field and what it takes."""
    policy = base or KeyPolicy()
    unknown = sorted(k for k in data if k not in _POLICY_KEYS and k != "name")
    if unknown:
        raise ConfigError(
            f"unknown key policy field(s) {', '.join(unknown)}; a key's policy takes "
            f"{', '.join(_POLICY_KEYS)}"
        )
    changes: dict[str, Any] = {}
    if "models" in data:
        changes["models"] = _models(data["models"])
    for name in ("rpm", "tpm", "max_concurrent"):
        if name in data:
            changes[name] = _limit(name, data[name])
    if "budget" in data:
        changes["budget"] = None if data["budget"] is None else parse_budget(data["budget"])
    if "priority" in data:
        priority = data["priority"]
        if priority is None:
            priority = "normal"
        if priority not in PRIORITIES:
            raise ConfigError(f"priority must be one of {', '.join(PRIORITIES)}; got {priority!r}")
        changes["priority"] = priority
    if "expires" in data:
        changes["expires_at"] = _expires(data["expires"], time.time() if now is None else now)
    if "resume" in data:
        changes["resume"] = _resume(data["resume"])
    return replace(policy, **changes)


def policy_changes(old: KeyPolicy, new: KeyPolicy) -> dict[str, tuple[Any, Any]]:
    """The fields of :meth:`KeyPolicy.to_json` that differ, each ``(old, new)``."""
    before, after = old.to_json(), new.to_json()
    return {k: (before[k], after[k]) for k in before if before[k] != after[k]}


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """``rpm 60 -> 120, budget none -> 10M/day``: :func:`policy_changes` for a person."""
    return ", ".join(
        f"{name.replace('_at', '')} {_shown(name, old)} -> {_shown(name, new)}"
        for name, (old, new) in changes.items()
    )


def usage_day_from(value: str, now: float, what: str = "since") -> str:
    """The UTC day a usage query's bound names: a day ``YYYY-MM-DD``, or a duration back
    from *now* (``7d``: the day a week ago; ``0d``: today)."""
    text = value.strip()
    if _DAY.fullmatch(text):
        try:
            return datetime.date.fromisoformat(text).isoformat()
        except ValueError:
            pass
    else:
        try:
            day = usage_day(now - parse_duration(text))
        except (ConfigError, OverflowError, OSError, ValueError):
            day = ""
        if _DAY.fullmatch(day):  # not before year 1000, nor past 9999
            return day
    raise ConfigError(
        f"{what} must be a day YYYY-MM-DD (UTC) or a duration back from now such as 7d, 30d "
        f"or 12h; got {value!r}"
    )


def parse_count(value: object, what: str) -> int:
    """A whole number of 1 or more from ``120``, ``"120"``, ``"10k"``, ``"2.5M"``, ``"1G"``
    (k = 10^3, M = 10^6, G or B = 10^9, T = 10^12)."""
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and (m := _COUNT.fullmatch(value.strip())):
        number = float(m.group(1)) * _SUFFIXES[m.group(2).lower()]
        if not math.isfinite(number) or number != int(number):
            raise ConfigError(f"{what} must be a whole number; got {value!r}")
        count = int(number)
    else:
        raise ConfigError(
            f"{what} must be a whole number, optionally with k, M, G or T "
            f"(e.g. 500, 10k, 2M); got {value!r}"
        )
    if not 1 <= count <= MAX_LIMIT:
        raise ConfigError(f"{what} must be between 1 and {MAX_LIMIT}; got {value!r}")
    return count


def format_count(count: int) -> str:
    """``10000000`` -> ``10M``, ``1500`` -> ``1500``: the shortest exact form
    :func:`parse_count` reads back."""
    for suffix, unit in (("T", 10**12), ("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if count >= unit and count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)


def parse_budget(value: object) -> Budget:
    """``"10M/day"``, ``"100M/month"``: tokens per calendar period in UTC."""
    if not isinstance(value, str) or value.count("/") != 1:
        raise ConfigError(
            f"budget must be TOKENS/PERIOD with PERIOD day or month (in UTC), e.g. 10M/day or "
            f"100M/month; got {value!r}"
        )
    tokens, period = (part.strip() for part in value.split("/"))
    if period not in BUDGET_PERIODS:
        raise ConfigError(
            f"budget period must be day or month (calendar periods in UTC); got {period!r} "
            f"in {value!r}"
        )
    return Budget(parse_count(tokens, "budget tokens"), period)


def usage_day(when: float) -> str:
    """The UTC day ``when`` falls on, as usage rows name it (``2026-12-02``)."""
    return time.strftime("%Y-%m-%d", time.gmtime(when))


def period_start(period: str, when: float) -> str:
    """The first UTC day of the budget period (``day`` or ``month``) that holds ``when``."""
    day = usage_day(when)
    return day if period == "day" else day[:8] + "01"


@dataclass
class UsageRow:
    """One key's use of one model on one UTC day (as stored, and as a flush adds to it)."""

    day: str
    key_id: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    key_name: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "day": self.day,
            "key_id": self.key_id,
            "key": self.key_name,
            "model": self.model,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "errors": self.errors,
        }


def _shown(name: str, value: Any) -> str:
    if value is None:
        return "never" if name == "expires_at" else "none"
    if name == "expires_at":
        return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(value))
    if name == "models":
        return ",".join(value) or "all"
    if isinstance(value, bool):
        return "on" if value else "off"
    return format_count(value) if isinstance(value, int) else str(value)


def _limit(name: str, value: object) -> int | None:
    return None if value is None else parse_count(value, name)


def _models(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple) or not all(isinstance(m, str) for m in value):
        raise ConfigError(
            f"models must be a list of model names (a,b on the command line); got {value!r}"
        )
    if len(value) > MAX_MODELS:
        raise ConfigError(f"a key may name at most {MAX_MODELS} models; got {len(value)}")
    for model in value:
        pool = split_pool(model)
        if pool is not None:
            raise ConfigError(
                f"{model!r} is the {pool[1]} pool of the disaggregated model {pool[0]}; name "
                f"{pool[0]} (its requests use both its pools)"
            )
        if not MODEL_NAME.fullmatch(model):
            raise ConfigError(
                f"{model!r} is not a model name (1-128 letters, digits and . _ : / -)"
            )
    return tuple(dict.fromkeys(value))


def _resume(value: object) -> bool:
    if value is None:
        return True  # cleared: the model's profile decides
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "on", "false", "off"):
        return value.strip().lower() in ("true", "on")
    raise ConfigError(
        f"resume must be true (the model's profile decides) or false (a broken stream of this "
        f"key ends with an error event, a failed answer is not retried); got {value!r}"
    )


def _expires(value: object, now: float) -> float | None:
    if value is None or value == "never":
        return None
    try:
        seconds = parse_duration(value)
    except ConfigError as exc:
        raise ConfigError(f"expires {exc} (or never)") from None
    if seconds < 60:
        raise ConfigError(f"expires must be at least 1 minute from now (e.g. 90d); got {value!r}")
    return now + seconds
