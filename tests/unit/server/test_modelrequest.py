"""A request's Charge: the key's grant settled once, on what the outcome comes to."""

from __future__ import annotations

from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.server.gateway.limits import Grant, KeyLimits
from llmgw.server.gateway.metering import Estimate
from llmgw.server.gateway.modelrequest import Charge
from llmgw.server.store.rows import ApiKey


def key(policy: KeyPolicy) -> ApiKey:
    return ApiKey("k1", "alice", "llmgw-ab", "h", 0.0, None, policy=policy)


def test_settle_charges_the_grant_what_the_engine_reported() -> None:
    limits = KeyLimits(clock=lambda: 0.0)
    k = key(KeyPolicy(tpm=1000, max_concurrent=2))
    grant = limits.admit(k, 300)
    assert isinstance(grant, Grant)
    charge = Charge(grant, Estimate(100, 200))
    state = limits.state(k)
    assert (state.inflight, state.reserved) == (1, 300)
    charge.outcome.handed = True
    charge.outcome.engine_status = 200
    charge.outcome.prompt, charge.outcome.completion = 40, 10
    charge.outcome.reported = True
    outcome = charge.settle(0.0)
    assert (outcome.prompt, outcome.completion) == (40, 10)
    assert (state.inflight, state.reserved) == (0, 0)
    assert state.tokens is not None and state.tokens.level == 1000 - 50


def test_rate_headers_only_for_a_key_with_a_rate_limit() -> None:
    limits = KeyLimits(clock=lambda: 0.0)
    plain = limits.admit(key(KeyPolicy()), 10)
    assert isinstance(plain, Grant)
    assert Charge(plain, Estimate(10, 0)).rate_headers() is None
    limited = limits.admit(key(KeyPolicy(rpm=60)), 10)
    assert isinstance(limited, Grant)
    headers = Charge(limited, Estimate(10, 0)).rate_headers()
    assert headers is not None and headers["x-ratelimit-limit-requests"] == "60"
