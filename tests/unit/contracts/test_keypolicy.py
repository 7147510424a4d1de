"""The key policy's words for people and the usage queries' days: a policy summarised for a
table and an event, what changed between two, and a usage bound read as a day or a duration
back from now (a bad one refused naming both forms)."""

from __future__ import annotations

import pytest

from llmgw.contracts.keypolicy import (
    Budget,
    KeyPolicy,
    describe_changes,
    policy_changes,
    policy_from_json,
    usage_day_from,
)
from llmgw.errors import ConfigError

T0 = 1_796_205_600.0  # 2026-12-02 10:00 UTC


@pytest.mark.parametrize(
    ("policy", "summary"),
    [
        (KeyPolicy(), "unlimited"),
        (KeyPolicy(priority="normal", models=("a",)), "models a"),
        (KeyPolicy(models=("a", "b", "c", "d")), "4 models"),
        (
            KeyPolicy(
                rpm=60,
                tpm=2_000_000,
                max_concurrent=2,
                budget=Budget(10**8, "month"),
                priority="low",
            ),
            "rpm 60, tpm 2M, 2 at once, budget 100M/month, priority low",
        ),
    ],
)
def test_a_policy_in_a_few_words(policy: KeyPolicy, summary: str) -> None:
    assert policy.summary() == summary


def test_the_expiry_is_said_only_when_asked() -> None:
    policy = KeyPolicy(rpm=5, expires_at=T0)
    assert policy.summary() == "rpm 5"
    assert policy.summary(expiry=True) == "rpm 5, expires 2026-12-02 10:00 UTC"
    assert KeyPolicy(expires_at=T0).summary(expiry=True) == "expires 2026-12-02 10:00 UTC"


def test_what_changed_between_two_policies() -> None:
    old = KeyPolicy(models=("a",), rpm=60)
    new = policy_from_json(
        {"models": None, "rpm": "1k", "budget": "5M/day", "expires": "1d"}, base=old, now=T0
    )
    changes = policy_changes(old, new)
    assert changes == {
        "models": (["a"], []),
        "rpm": (60, 1000),
        "budget": (None, "5M/day"),
        "expires_at": (None, T0 + 86400),
    }
    assert describe_changes(changes) == (
        "models a -> all, rpm 60 -> 1k, budget none -> 5M/day, "
        "expires never -> 2026-12-03 10:00 UTC"
    )
    assert policy_changes(new, new) == {}


@pytest.mark.parametrize(
    ("value", "day"),
    [
        ("2026-11-01", "2026-11-01"),
        (" 2026-11-01 ", "2026-11-01"),
        ("0d", "2026-12-02"),
        ("7d", "2026-11-25"),
        ("10h", "2026-12-02"),
        ("11h", "2026-12-01"),
        ("86400", "2026-12-01"),
    ],
)
def test_a_usage_bound_is_a_day_or_a_duration_back(value: str, day: str) -> None:
    assert usage_day_from(value, T0) == day


@pytest.mark.parametrize("value", ["yesterday", "2026-13-01", "2026-02-30", "-1d", "1w", ""])
def test_a_bad_usage_bound_names_both_forms(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        usage_day_from(value, T0, "until")
    assert str(info.value) == (
        "until must be a day YYYY-MM-DD (UTC) or a duration back from now such as 7d, 30d or "
        f"12h; got {value!r}"
    )


def test_a_duration_past_any_calendar_is_refused_too() -> None:
    with pytest.raises(ConfigError, match="since must be a day YYYY-MM-DD"):
        usage_day_from("99999999999d", T0)


@pytest.mark.parametrize(
    ("given", "resume"),
    [(False, False), ("off", False), (" OFF ", False), ("on", True), ("true", True), (None, True)],
)
def test_resume_takes_a_boolean_or_its_words_and_null_gives_it_back_to_the_profile(
    given: object, resume: bool
) -> None:
    base = KeyPolicy(resume=not resume)
    assert policy_from_json({"resume": given}, base=base).resume is resume


@pytest.mark.parametrize("given", ["maybe", "", 0, 1, [], {"max_resumes": 2}])
def test_a_bad_resume_is_refused_saying_what_each_value_does(given: object) -> None:
    with pytest.raises(ConfigError) as info:
        policy_from_json({"resume": given})
    message = str(info.value)
    assert message.startswith("resume must be true (the model's profile decides) or false")
    assert repr(given) in message


def test_a_pool_named_in_models_is_refused_naming_its_model() -> None:
    # Requests name a disaggregated model; the gateway hands them to both its pools.
    with pytest.raises(ConfigError, match=r"'m#decode' is the decode pool of .* model m; name m"):
        policy_from_json({"models": ["a", "m#decode"]}, base=KeyPolicy(), now=T0)
    assert policy_from_json({"models": "a,m"}, base=KeyPolicy(), now=T0).models == ("a", "m")
