"""Each key's limits in memory: the token buckets, requests in flight, the budget of its period,
and what a refusal says (status, OpenAI's type and code, the rate-limit headers)."""

from __future__ import annotations

import calendar
from dataclasses import replace

import pytest

from llmgw.contracts.keypolicy import Budget, KeyPolicy
from llmgw.server.gateway.limits import Grant, KeyLimits, Refusal, format_reset
from llmgw.server.store.rows import ApiKey
from tests.unit.clock import Clock

DAY = calendar.timegm((2026, 12, 2, 0, 0, 0))


def key(policy: KeyPolicy, name: str = "alice", key_id: str = "k1") -> ApiKey:
    return ApiKey(
        id=key_id,
        name=name,
        prefix="sk-llmgw-abc",
        hash="h-" + key_id,
        created_at=0.0,
        revoked_at=None,
        policy=policy,
    )


def limits(clock: Clock, wall: Clock | None = None, **kw: object) -> KeyLimits:
    return KeyLimits(clock=clock, wall=wall or Clock(DAY + 3600), **kw)  # type: ignore[arg-type]


def granted(result: Grant | Refusal) -> Grant:
    assert isinstance(result, Grant), result
    return result


def refused(result: Grant | Refusal) -> Refusal:
    assert isinstance(result, Refusal), result
    return result


def test_no_policy_admits_everything() -> None:
    lim = limits(Clock())
    k = key(KeyPolicy())
    grants = [granted(lim.admit(k, 10**9)) for _ in range(1000)]
    assert lim.states["k1"].inflight == 1000
    for g in grants:
        g.settle(5, 0.0)
    assert lim.states["k1"].inflight == 0
    assert lim.states["k1"].headers() == {}


def test_rpm_refuses_the_request_that_crosses_it_and_refills() -> None:
    clock = Clock()
    lim = limits(clock)
    k = key(KeyPolicy(rpm=3))
    for _ in range(3):
        granted(lim.admit(k, 1)).settle(1, clock.t)
    r = refused(lim.admit(k, 1))
    assert (r.status, r.type, r.code) == (429, "requests", "rate_limit_exceeded")
    assert r.headers["x-ratelimit-limit-requests"] == "3"
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert r.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert r.headers["Retry-After"] == "20"  # one request every 20 s at 3 RPM
    assert "'alice'" in r.message and "--rpm" in r.message
    clock.t += 19.9
    refused(lim.admit(k, 1))
    clock.t += 0.2
    granted(lim.admit(k, 1))
    refused(lim.admit(k, 1))


def test_tpm_debits_the_estimate_and_settles_on_the_real_tokens() -> None:
    clock = Clock()
    lim = limits(clock)
    k = key(KeyPolicy(tpm=100))
    g = granted(lim.admit(k, 80))
    assert lim.states["k1"].headers()["x-ratelimit-remaining-tokens"] == "20"
    r = refused(lim.admit(k, 30))  # 20 left, 30 asked
    assert (r.type, r.code) == ("tokens", "rate_limit_exceeded")
    assert r.headers["x-ratelimit-remaining-tokens"] == "20"
    assert r.headers["Retry-After"] == "6"  # 10 tokens at 100/min
    g.settle(10, clock.t)  # it cost 10, not 80: 70 back
    assert lim.states["k1"].headers()["x-ratelimit-remaining-tokens"] == "90"
    granted(lim.admit(k, 30)).settle(200, clock.t)  # cost far more: the bucket owes
    state = lim.states["k1"]
    assert state.tokens is not None and state.tokens.level == pytest.approx(-110)
    assert state.headers()["x-ratelimit-remaining-tokens"] == "0"
    refused(lim.admit(k, 1))
    clock.t += 67  # 111.67 tokens refilled
    granted(lim.admit(k, 1))


def test_an_estimate_over_the_whole_bucket_waits_for_a_full_one() -> None:
    clock = Clock()
    lim = limits(clock)
    k = key(KeyPolicy(tpm=100))
    granted(lim.admit(k, 500)).settle(None, clock.t)  # full bucket: admitted, owes 400
    refused(lim.admit(k, 500))
    clock.t += 300  # refilled to 100 (capped)
    granted(lim.admit(k, 500))


def test_max_concurrent_counts_until_settled() -> None:
    clock = Clock()
    lim = limits(clock)
    k = key(KeyPolicy(max_concurrent=2))
    a, b = granted(lim.admit(k, 1)), granted(lim.admit(k, 1))
    r = refused(lim.admit(k, 1))
    assert (r.status, r.code) == (429, "concurrency_limit_exceeded")
    assert r.headers["Retry-After"] == "1"
    a.settle(1, clock.t)
    c = granted(lim.admit(k, 1))
    b.settle(1, clock.t)
    c.settle(None, clock.t)
    assert lim.states["k1"].inflight == 0


def test_a_refused_request_takes_nothing() -> None:
    clock = Clock()
    lim = limits(clock)
    k = key(KeyPolicy(rpm=2, tpm=100, max_concurrent=5))
    granted(lim.admit(k, 90))
    refused(lim.admit(k, 50))  # tokens: the request bucket is untouched
    state = lim.states["k1"]
    assert state.requests is not None and state.requests.level == pytest.approx(1)
    assert state.inflight == 1


def test_budget_from_the_store_then_local_then_confirmed() -> None:
    clock, wall = Clock(), Clock(DAY + 3600)
    read: list[tuple[str, str]] = []

    def spent(key_id: str, since: str) -> int:
        read.append((key_id, since))
        return 900

    lim = limits(clock, wall, budget_spent=spent)
    k = key(KeyPolicy(budget=Budget(1000, "day")))
    g = granted(lim.admit(k, 10))
    assert read == [("k1", "2026-12-02")]
    g.settle(150, clock.t)  # 900 + 150 >= 1000
    r = refused(lim.admit(k, 10))
    assert (r.status, r.type, r.code) == (429, "insufficient_quota", "insufficient_quota")
    assert "1k/day" in r.message and "2026-12-02" in r.message
    assert r.headers["Retry-After"] == str(86400 - 3600)
    # A flush stored those 150 and read the store's total back: nothing counted twice.
    lim.confirm({"k1": 150}, {"2026-12-02": {"k1": 1050}})
    state = lim.states["k1"]
    assert (state.budget_base, state.unconfirmed) == (1050, 0)
    refused(lim.admit(k, 10))
    assert len(read) == 1  # read once per period


def test_budget_resets_when_its_period_ends() -> None:
    clock, wall = Clock(), Clock(DAY + 86399)
    totals = {"2026-12-02": 5000, "2026-12-03": 0}
    lim = limits(clock, wall, budget_spent=lambda _k, since: totals[since])
    k = key(KeyPolicy(budget=Budget(1000, "day")))
    refused(lim.admit(k, 1))
    wall.t += 2  # 00:00:01 UTC the next day
    granted(lim.admit(k, 1))


def test_monthly_budget_counts_from_the_first_of_the_month() -> None:
    seen: list[str] = []
    wall = Clock(calendar.timegm((2026, 12, 31, 23, 0, 0)))
    lim = limits(Clock(), wall, budget_spent=lambda _k, since: seen.append(since) or 0)
    k = key(KeyPolicy(budget=Budget(10, "month")))
    granted(lim.admit(k, 1)).settle(10, 0.0)
    r = refused(lim.admit(k, 1))
    assert seen == ["2026-12-01"]
    assert r.headers["Retry-After"] == "3600"  # until 2027-01-01 00:00 UTC
    wall.t += 3600
    granted(lim.admit(k, 1))
    assert seen[-1] == "2027-01-01"


def test_a_policy_update_resizes_the_buckets_keeping_what_was_used() -> None:
    clock = Clock()
    lim = limits(clock)
    k = key(KeyPolicy(rpm=10))
    for _ in range(8):
        granted(lim.admit(k, 1))
    k2 = replace(k, policy=KeyPolicy(rpm=5))
    granted(lim.admit(k2, 1))  # 2 were left: still 2 of 5
    granted(lim.admit(k2, 1))
    r = refused(lim.admit(k2, 1))
    assert r.headers["x-ratelimit-limit-requests"] == "5"
    k3 = replace(k, policy=KeyPolicy(rpm=120))
    r = refused(lim.admit(k3, 1))  # the level is kept (none left), the capacity raised
    assert r.headers["x-ratelimit-limit-requests"] == "120"
    assert r.headers["Retry-After"] == "1"  # two a second now
    clock.t += 0.5
    granted(lim.admit(k3, 1))


def test_each_instance_enforces_its_share() -> None:
    clock = Clock()
    instances = [3]
    lim = limits(clock, instances=lambda: instances[0])
    k = key(KeyPolicy(rpm=10, max_concurrent=4))
    grants = [granted(lim.admit(k, 1)) for _ in range(2)]  # max_concurrent 4/3 -> 2
    r = refused(lim.admit(k, 1))
    assert r.code == "concurrency_limit_exceeded" and "2 on this gateway instance" in r.message
    for g in grants:
        g.settle(1, clock.t)
    granted(lim.admit(k, 1)).settle(1, clock.t)  # rpm 10/3 -> 4 per instance
    granted(lim.admit(k, 1)).settle(1, clock.t)
    r = refused(lim.admit(k, 1))
    assert r.headers["x-ratelimit-limit-requests"] == "4"
    instances[0] = 1
    lim.reshare()
    assert lim.states["k1"].headers()["x-ratelimit-limit-requests"] == "10"


def test_forget_drops_revoked_keys_not_in_flight() -> None:
    lim = limits(Clock())
    busy = granted(lim.admit(key(KeyPolicy(), key_id="a"), 1))
    granted(lim.admit(key(KeyPolicy(), key_id="b"), 1)).settle(1, 0.0)
    lim.forget(set())
    assert set(lim.states) == {"a"}
    busy.settle(1, 0.0)
    lim.forget(set())
    assert lim.states == {}


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0ms"),
        (0.0201, "21ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (59.9, "59.9s"),
        (60, "1m0s"),
        (361, "6m1s"),
        (3723, "1h2m3s"),
    ],
)
def test_reset_times_are_said_as_openai_says_them(seconds: float, text: str) -> None:
    assert format_reset(seconds) == text


def test_requests_in_flight_hold_their_estimates_against_the_budget() -> None:
    clock = Clock()
    lim = limits(clock, budget_spent=lambda _k, _since: 0)
    k = key(KeyPolicy(budget=Budget(1000, "day")))
    big = granted(lim.admit(k, 600))
    other = granted(lim.admit(k, 500))  # 600 held, under 1,000: admitted (it may overshoot)
    r = refused(lim.admit(k, 1))  # 1,100 held
    assert (r.status, r.code) == (429, "insufficient_quota")
    assert "has 2 requests in flight estimated at 1100 tokens" in r.message
    assert r.headers["Retry-After"] == "1"  # not the next period: they may cost less
    big.settle(100, clock.t)  # it cost 100: 500 held + 100 spent
    granted(lim.admit(k, 1)).settle(1, clock.t)
    other.settle(None, clock.t)  # no usage known: its estimate stands, and is spent
    state = lim.states["k1"]
    assert (state.reserved, state.unconfirmed, state.inflight) == (0, 601, 0)
    granted(lim.admit(k, 1)).settle(399, clock.t)  # 1,000 spent
    r = refused(lim.admit(k, 1))
    assert "has spent its budget" in r.message
