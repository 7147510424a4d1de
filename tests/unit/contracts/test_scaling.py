"""A deployment's replicas: a fixed count or a scaling policy, one parser for ctl, the admin
API, the console and the catalog."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.contracts.scaling import ScalingPolicy, parse_replicas, policy_of
from llmgw.errors import ConfigError


def test_a_whole_number_is_a_fixed_count() -> None:
    assert parse_replicas(0) == 0
    assert parse_replicas(1000) == 1000


@pytest.mark.parametrize("value", [-1, 1001, True, 1.5, "2", None, [1, 2]])
def test_other_counts_are_refused_with_the_forms_taken(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^replicas: must be a whole number"):
        parse_replicas(value)


def test_a_policy_with_its_defaults() -> None:
    policy = parse_replicas({"min": 0, "max": 8})
    assert policy == ScalingPolicy(min=0, max=8)
    assert isinstance(policy, ScalingPolicy)
    assert (policy.target_inflight, policy.scale_down_after, policy.cold_start_timeout) == (
        8,
        300.0,
        300.0,
    )
    assert policy.ttft_slo is None


def test_a_policy_with_every_key_and_durations_in_llmgws_syntax() -> None:
    policy = parse_replicas(
        {
            "min": 1,
            "max": 4,
            "target_inflight": 16,
            "ttft_slo": "2s",
            "scale_down_after": "90s",
            "cold_start_timeout": "1m",
        }
    )
    assert policy == ScalingPolicy(1, 4, 16, 2.0, 90.0, 60.0)
    assert parse_replicas(policy.to_json()) == policy  # stored and read back as it was


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"max": 8}, "needs both min and max"),
        ({"min": 3, "max": 2}, r"min \(3\) is above max \(2\)"),
        ({"min": 0, "max": 0}, r"replicas\.max: must be a whole number from 1"),
        ({"min": 0, "max": 2, "target_inflight": 0}, r"replicas\.target_inflight"),
        ({"min": 0, "max": 2, "ttft_slo": "0s"}, r"replicas\.ttft_slo: must be more than 0 s"),
        ({"min": 0, "max": 2, "scale_down_after": "soon"}, r"replicas\.scale_down_after"),
        ({"min": 0, "max": 2, "burst": 3}, r"unknown key 'burst'; a scaling policy takes min"),
    ],
)
def test_a_policy_that_cannot_be_followed_is_refused_naming_the_key(
    value: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_replicas(value)


def test_what_demand_asks_for_within_the_bounds() -> None:
    policy = ScalingPolicy(min=0, max=4, target_inflight=10)
    assert [policy.wanted(d) for d in (0, 1, 10, 11, 35, 400)] == [0, 1, 1, 2, 4, 4]
    assert ScalingPolicy(min=2, max=4).wanted(0) == 2


def test_the_stored_json_reads_back() -> None:
    assert policy_of({}) is None
    assert policy_of({"min": 0, "max": 3}) == ScalingPolicy(0, 3)
    assert "0-3 by demand (8 in flight each)" == ScalingPolicy(0, 3).describe()
    assert "TTFT p90 <= 2s" in ScalingPolicy(0, 3, ttft_slo=2.0).describe()


def test_a_catalog_model_says_how_many_replicas_it_runs() -> None:
    from llmgw.contracts.catalog import parse_catalog

    catalog = parse_catalog(
        {
            "models": {
                "chat": {
                    "replicas": {"min": 0, "max": 4, "priority": "high", "sleep_after": "5m"},
                    "profiles": {"default": {"engine": "sim"}},
                },
                "fixed": {"replicas": 2, "profiles": {"default": {"engine": "sim"}}},
                "silent": {"profiles": {"default": {"engine": "sim"}}},
            }
        },
        source="catalog.yaml",
    )
    chat = catalog.models["chat"]
    assert chat.replicas == ScalingPolicy(0, 4, priority="high", sleep_after=300.0)
    assert chat.to_dict()["replicas"]["max"] == 4
    assert catalog.models["fixed"].replicas == 2
    assert catalog.models["silent"].replicas is None
    assert "replicas" not in catalog.models["silent"].to_dict()
    with pytest.raises(
        ConfigError, match=r"^catalog.yaml: models\.chat\.replicas: min \(5\) is above max"
    ):
        parse_catalog(
            {
                "models": {
                    "chat": {
                        "replicas": {"min": 5, "max": 4},
                        "profiles": {"default": {"engine": "sim"}},
                    }
                }
            },
            source="catalog.yaml",
        )


def test_prefetch_is_off_by_default_and_stored_only_when_on() -> None:
    off = parse_replicas({"min": 0, "max": 4})
    on = parse_replicas({"min": 0, "max": 4, "prefetch": True})
    assert isinstance(off, ScalingPolicy) and isinstance(on, ScalingPolicy)
    assert (off.prefetch, on.prefetch) == (False, True)
    assert "prefetch" not in off.to_json()
    assert on.to_json()["prefetch"] is True
    assert policy_of(on.to_json()) == on
    assert on.describe() == "0-4 by demand (8 in flight each, prefetch)"
    assert parse_replicas({"min": 0, "max": 4, "prefetch": False}) == off


def test_a_fixed_count_asks_for_prefetch_as_equal_bounds() -> None:
    # What `ctl deploy --replicas 2 --prefetch` sends: the count cannot move, the weights
    # are kept warm.
    policy = parse_replicas({"min": 2, "max": 2, "prefetch": True})
    assert isinstance(policy, ScalingPolicy)
    assert (policy.wanted(0), policy.wanted(100), policy.prefetch) == (2, 2, True)


@pytest.mark.parametrize("value", ["yes", 1, "true", None])
def test_prefetch_that_is_not_a_boolean_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^replicas\.prefetch: must be true or false") as exc:
        parse_replicas({"min": 0, "max": 4, "prefetch": value})
    assert repr(value) in str(exc.value)


def test_the_catalogs_replicas_map_takes_prefetch_and_refuses_a_bad_one() -> None:
    from llmgw.contracts.catalog import parse_catalog

    def catalog(replicas: object) -> object:
        data = {"models": {"m": {"replicas": replicas, "profiles": {"default": {"engine": "sim"}}}}}
        return parse_catalog(data, source="catalog.yaml")

    parsed: Any = catalog({"min": 0, "max": 2, "prefetch": True})
    assert parsed.models["m"].replicas == ScalingPolicy(0, 2, prefetch=True)
    with pytest.raises(ConfigError, match=r"models\.m\.replicas\.prefetch: must be true or false"):
        catalog({"min": 0, "max": 2, "prefetch": "on"})


# ------------------------------------------- target_tokens: pools scaled by their tokens


def test_target_tokens_is_kept_described_and_read_back() -> None:
    policy = parse_replicas({"min": 0, "max": 8, "target_inflight": 16, "target_tokens": 32000})
    assert isinstance(policy, ScalingPolicy)
    assert policy.target_tokens == 32000
    assert policy.to_json()["target_tokens"] == 32000
    assert parse_replicas(policy.to_json()) == policy
    assert policy.describe() == "0-8 by demand (16 in flight or 32000 tokens each)"
    without = parse_replicas({"min": 0, "max": 8})
    assert isinstance(without, ScalingPolicy)
    assert without.target_tokens is None
    assert "target_tokens" not in without.to_json()
    assert "tokens" not in without.describe()


def test_wanted_is_the_larger_of_requests_and_tokens_within_the_bounds() -> None:
    policy = ScalingPolicy(min=0, max=8, target_inflight=10, target_tokens=1000)
    assert policy.wanted(0, 0) == 0
    assert policy.wanted(3, 0) == 1  # requests alone
    assert policy.wanted(3, 4500) == 5  # few requests, many tokens: the tokens ask more
    assert policy.wanted(25, 500) == 3  # many requests, few tokens: the requests ask more
    assert policy.wanted(1, 1_000_000) == 8  # the max holds
    assert (policy.by_requests(3), policy.by_tokens(4500), policy.asked(1, 1_000_000)) == (
        1,
        5,
        1000,
    )
    # Without target_tokens the tokens ask nothing: requests alone, as before.
    plain = ScalingPolicy(min=1, max=8, target_inflight=10)
    assert plain.wanted(3, 10**9) == 1
    assert plain.by_tokens(10**9) == 0


@pytest.mark.parametrize("value", [0, -5, 1.5, "1000", True, 100_000_001, [1]])
def test_a_bad_target_tokens_is_refused_naming_the_key_and_the_fix(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_replicas({"min": 0, "max": 2, "target_tokens": value})
    message = str(info.value)
    assert message.startswith("replicas.target_tokens: must be a whole number from 1 to")
    assert "or left out to scale by requests alone" in message
    assert repr(value) in message


def test_a_stored_policy_with_target_tokens_is_read() -> None:
    policy = policy_of({"min": 1, "max": 3, "target_tokens": 5})
    assert policy is not None and policy.target_tokens == 5
