"""Each API key's limits on the request path, kept in memory: requests and tokens per minute
(token buckets), requests in flight, and the token budget of its calendar period.

Nothing here touches the store. A request is admitted (:meth:`KeyLimits.admit`) with an
estimate of its tokens (:mod:`llmgw.server.gateway.metering`), debited from the key's token bucket
up front, and settled (:meth:`Grant.settle`) on what it cost, so that the bucket ends up
charged what the request really cost. A budget is checked against what the key spent in its
period, the store's total (every gateway instance's flushed usage, read back by
:mod:`llmgw.server.gateway.usage` at each flush) plus what this instance settled since, and against
the estimates of the key's requests in flight here (``reserved``): a key cannot start many
large requests at once on a budget that has room for one.

With several gateway instances (the control-plane instances on PostgreSQL), each enforces
its share of a key's ``rpm``, ``tpm`` and ``max_concurrent`` (the limit divided by the
number of instances serving, rounded up, at least 1), so that clients spread across the
instances get the key's limit in all; a budget is shared through the store, so the
instances together overshoot it by at most what they serve in one flush interval.
"""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmgw.contracts.keypolicy import KeyPolicy, period_start
from llmgw.server.store.rows import ApiKey

__all__ = ["Grant", "KeyLimits", "KeyState", "Refusal", "format_reset"]


def format_reset(seconds: float) -> str:
    """A reset time as OpenAI's ``x-ratelimit-reset-*`` headers say it: ``20ms``, ``1s``,
    ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms"
    if seconds < 60:
        text = f"{seconds:.3f}".rstrip("0").rstrip(".")
        return f"{text}s"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"


class _Bucket:
    """A token bucket of ``capacity`` that refills at ``capacity`` per minute; its level may
    go below zero when a settled request cost more than its estimate (a debt repaid by the
    refill)."""

    __slots__ = ("at", "capacity", "level", "rate")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / 60.0
        self.level = float(capacity)
        self.at = now

    def refill(self, now: float) -> float:
        level = self.level + (now - self.at) * self.rate
        if level > self.capacity:
            level = self.capacity
        self.level = level
        self.at = now
        return level

    def resize(self, capacity: int, now: float) -> None:
        self.refill(now)
        self.capacity = float(capacity)
        self.rate = capacity / 60.0
        if self.level > self.capacity:
            self.level = self.capacity

    def wait_for(self, need: float) -> float:
        """Seconds until the level reaches ``need``."""
        return max(need - self.level, 0.0) / self.rate

    def until_full(self) -> float:
        return max(self.capacity - self.level, 0.0) / self.rate


@dataclass(frozen=True)
class Refusal:
    """Why a request was refused: its HTTP status, OpenAI's error type and code, the message
    and the headers (the rate-limit trio(s) and ``Retry-After``)."""

    status: int
    type: str
    code: str
    message: str
    headers: dict[str, str]


class KeyState:
    """One key's limits as they stand on this instance."""

    __slots__ = (
        "budget_base",
        "budget_period",
        "id",
        "inflight",
        "name",
        "policy",
        "requests",
        "reserved",
        "share",
        "tokens",
        "unconfirmed",
    )

    def __init__(self, key: ApiKey, share: int, now: float) -> None:
        self.id = key.id
        self.name = key.name
        self.policy: KeyPolicy = key.policy
        self.share = share
        self.inflight = 0
        # The estimates of its requests in flight, held against its budget until they settle.
        self.reserved = 0
        self.requests: _Bucket | None = None
        self.tokens: _Bucket | None = None
        # The budget period's first day, the store's total for it (every instance's flushed
        # usage, read at the last flush) and what this instance settled that the total does
        # not hold yet.
        self.budget_period = ""
        self.budget_base = 0
        self.unconfirmed = 0
        self.apply(key.policy, share, now)

    def apply(self, policy: KeyPolicy, share: int, now: float) -> None:
        """A new policy (``keys update``) or a new number of instances: resize the buckets,
        keeping what was used."""
        self.policy = policy
        self.share = share
        self.requests = _resized(self.requests, _part(policy.rpm, share), now)
        self.tokens = _resized(self.tokens, _part(policy.tpm, share), now)

    @property
    def max_concurrent(self) -> int | None:
        return _part(self.policy.max_concurrent, self.share)

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers for the key's buckets, as they stand."""
        out: dict[str, str] = {}
        for bucket, kind in ((self.requests, "requests"), (self.tokens, "tokens")):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                out[f"x-ratelimit-remaining-{kind}"] = str(max(int(bucket.level), 0))
                out[f"x-ratelimit-reset-{kind}"] = format_reset(bucket.until_full())
        return out


def _part(limit: int | None, share: int) -> int | None:
    if limit is None:
        return None
    return max(math.ceil(limit / share), 1)


def _resized(bucket: _Bucket | None, capacity: int | None, now: float) -> _Bucket | None:
    if capacity is None:
        return None
    if bucket is None:
        return _Bucket(capacity, now)
    if bucket.capacity != capacity:
        bucket.resize(capacity, now)
    return bucket


class Grant:
    """An admitted request: held until :meth:`settle`, which gives back its place among the
    key's requests in flight and charges its real tokens."""

    __slots__ = ("estimate", "state")

    def __init__(self, state: KeyState, estimate: int) -> None:
        self.state = state
        self.estimate = estimate

    def settle(self, tokens: int | None, now: float) -> None:
        """The request ended having cost ``tokens`` (prompt + completion, as its usage is
        recorded; None: the estimate stands)."""
        state = self.state
        state.inflight -= 1
        state.reserved -= self.estimate
        used = self.estimate if tokens is None else tokens
        bucket = state.tokens
        if bucket is not None and used != self.estimate:
            bucket.refill(now)
            bucket.level = min(bucket.level + self.estimate - used, bucket.capacity)
        if state.policy.budget is not None and used:
            state.unconfirmed += used


class KeyLimits:
    """The limit state of every key this instance has served, by key id: what enforces each
    key's :class:`~llmgw.contracts.keypolicy.KeyPolicy` (its rpm, tpm, concurrency and
    budget); not server.yaml's request limits (:class:`llmgw.server.gateway.gateway.GatewaySettings`)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        instances: Callable[[], int] = lambda: 1,
        budget_spent: Callable[[str, str], int] = lambda _key_id, _since: 0,
    ) -> None:
        self.clock = clock
        self.wall = wall
        # How many gateway instances share each key's limits.
        self.instances = instances
        # The store's tokens of a key since a day (its budget period's first): read once per
        # key and period, when the key is first seen in it; the flushes keep it current.
        self.budget_spent = budget_spent
        self.states: dict[str, KeyState] = {}
        self._day_ends = 0.0
        self._periods: dict[str, str] = {}

    def state(self, key: ApiKey) -> KeyState:
        state = self.states.get(key.id)
        if state is None:
            state = self.states[key.id] = KeyState(key, max(self.instances(), 1), self.clock())
        elif state.policy is not key.policy:
            state.apply(key.policy, max(self.instances(), 1), self.clock())
        return state

    def reshare(self) -> None:
        """The number of instances changed: every key's share follows."""
        share = max(self.instances(), 1)
        now = self.clock()
        for state in self.states.values():
            if state.share != share:
                state.apply(state.policy, share, now)

    def forget(self, keep: set[str]) -> None:
        """Drop the state of keys no longer active (revoked), except those in flight."""
        for key_id in [k for k, s in self.states.items() if k not in keep and not s.inflight]:
            del self.states[key_id]

    def period(self, name: str) -> str:
        """The first day of the current budget period ``name`` (``day``, ``month``)."""
        wall = self.wall()
        if wall >= self._day_ends:
            # Recomputed once a day, not per request.
            self._periods = {p: period_start(p, wall) for p in ("day", "month")}
            self._day_ends = (math.floor(wall / 86400) + 1) * 86400
        return self._periods[name]

    def admit(self, key: ApiKey, estimate: int) -> Grant | Refusal:
        """Admit a request of ``key`` estimated at ``estimate`` tokens, or say why not. An
        admitted request holds its place in flight until its grant is settled."""
        state = self.state(key)
        policy = state.policy
        now = self.clock()
        limit = state.max_concurrent
        if limit is not None and state.inflight >= limit:
            return Refusal(
                429,
                "requests",
                "concurrency_limit_exceeded",
                f"Key '{state.name}' already has {state.inflight} requests in flight, its "
                f"limit ({policy.max_concurrent}"
                + (f", {limit} on this gateway instance" if state.share > 1 else "")
                + "); wait for one to finish (a stream counts until its last chunk), or ask "
                "the operator to raise it ('llmgw ctl keys update KEY --max-concurrent N').",
                {**state.headers(), "Retry-After": "1"},
            )
        if policy.budget is not None:
            period = self.period(policy.budget.period)
            if state.budget_period != period:  # first seen, or a new period began
                state.budget_period = period
                state.budget_base = self.budget_spent(state.id, period)
                state.unconfirmed = 0
            spent = state.budget_base + state.unconfirmed
            if spent + state.reserved >= policy.budget.tokens:
                return self._budget_refusal(state, spent, period)
        requests = state.requests
        if requests is not None and requests.refill(now) < 1.0:
            wait = requests.wait_for(1.0)
            return self._rate_refusal(state, "requests", policy.rpm, "RPM", wait)
        tokens = state.tokens
        if tokens is not None:
            need = min(float(estimate), tokens.capacity)
            if tokens.refill(now) < need:
                return self._rate_refusal(state, "tokens", policy.tpm, "TPM", tokens.wait_for(need))
            tokens.level -= estimate
        if requests is not None:
            requests.level -= 1.0
        state.inflight += 1
        state.reserved += estimate
        return Grant(state, estimate)

    def _budget_refusal(self, state: KeyState, spent: int, period: str) -> Refusal:
        budget = state.policy.budget
        assert budget is not None
        if spent < budget.tokens:
            why = (
                f"has {state.inflight} requests in flight estimated at {state.reserved} "
                f"tokens, which with the {spent} used since {period} (UTC) reach its budget "
                f"of {budget} tokens; retry when they finish"
            )
            retry = 1
        else:
            why = (
                f"has spent its budget of {budget} tokens ({spent} used since {period}, UTC); "
                f"it renews at the start of the next {budget.period}"
            )
            retry = self._until_next(budget.period)
        return Refusal(
            429,
            "insufficient_quota",
            "insufficient_quota",
            f"Key '{state.name}' {why}, or the operator raises it ('llmgw ctl keys update "
            "KEY --budget TOKENS/PERIOD').",
            {"Retry-After": str(retry)},
        )

    def _rate_refusal(
        self, state: KeyState, kind: str, limit: int | None, unit: str, wait: float
    ) -> Refusal:
        share = f" ({unit} {math.ceil((limit or 0) / state.share)} on this gateway instance)"
        return Refusal(
            429,
            kind,
            "rate_limit_exceeded",
            f"Rate limit reached for key '{state.name}' on {kind} per minute: limit {limit} "
            f"{unit}{share if state.share > 1 else ''}. Please try again in "
            f"{format_reset(wait)}, or ask the operator to raise it ('llmgw ctl keys update "
            f"KEY --{unit.lower()} N').",
            {**state.headers(), "Retry-After": str(max(math.ceil(wait), 1))},
        )

    def _until_next(self, period: str) -> int:
        """Whole seconds until the next budget period starts."""
        wall = self.wall()
        if period == "day":
            return max(math.ceil((math.floor(wall / 86400) + 1) * 86400 - wall), 1)
        t = time.gmtime(wall)
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        return max(math.ceil(calendar.timegm((year, month, 1, 0, 0, 0)) - wall), 1)

    # -- the budgets' totals, at each flush of usage ---------------------------------------------

    def budgeted(self) -> dict[str, list[KeyState]]:
        """The keys with a budget, by the first day of their current period."""
        out: dict[str, list[KeyState]] = {}
        for state in self.states.values():
            budget = state.policy.budget
            if budget is not None:
                out.setdefault(self.period(budget.period), []).append(state)
        return out

    def confirm(self, flushed: dict[str, int], totals: dict[str, dict[str, int]]) -> None:
        """A flush stored ``flushed`` (tokens per key id) and then read ``totals`` (per first
        day of a period: the store's tokens per key id since that day): each budgeted key's
        base is the store's total, and what it holds of this instance's is no longer
        unconfirmed."""
        for state in self.states.values():
            budget = state.policy.budget
            if budget is None:
                continue
            period = self.period(budget.period)
            if period != state.budget_period or period not in totals:
                continue  # not admitted in this period yet: its first request reads the total
            state.unconfirmed = max(state.unconfirmed - flushed.get(state.id, 0), 0)
            state.budget_base = totals[period].get(state.id, 0)
