"""``llmgw ctl deploy MODEL --replicas N|MIN-MAX`` and the options of scaling by demand: the
body the admin API gets, what the operator reads, and the refusals made before anything is
sent."""

from __future__ import annotations

from typing import Any

from tests.unit.cli.ctl.fakeapi import FakeAPI


def _answer(method: str, path: str, body: Any) -> dict[str, Any]:
    replicas = body.get("replicas")
    scaling = replicas if isinstance(replicas, dict) else None
    return {
        "name": body["name"],
        "profile": "default",
        "engine": "sim",
        "gpus": 1,
        "nodes": 1,
        "replicas": scaling["min"] if scaling else (replicas or 1),
        "ready": 0,
        "scaling": scaling,
    }


def test_a_range_with_its_options_is_a_scaling_policy() -> None:
    api = FakeAPI(_answer)
    result = api.ctl(
        "deploy", "m", "--replicas", "0-8", "--target-inflight", "16", "--ttft-slo", "2s",
        "--scale-down-after", "5m", "--cold-start-timeout", "1m", "--sleep-after", "30s",
        "--priority", "high",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert api.calls == [
        (
            "POST",
            "/api/models",
            {
                "name": "m",
                "replicas": {
                    "min": 0,
                    "max": 8,
                    "target_inflight": 16,
                    "ttft_slo": 2.0,
                    "scale_down_after": 300.0,
                    "cold_start_timeout": 60.0,
                    "sleep_after": 30.0,
                    "priority": "high",
                },
            },
        )
    ]
    assert "deployed m: 0-8 replicas by demand (0 now)" in result.output


def test_a_count_is_sent_as_a_count() -> None:
    api = FakeAPI(_answer)
    result = api.ctl("deploy", "m", "--replicas", "3")
    assert result.exit_code == 0, result.output
    assert api.calls == [("POST", "/api/models", {"name": "m", "replicas": 3})]
    assert "deployed m: 3 replicas of profile default" in result.output


def test_refusals_name_what_to_give_and_send_nothing() -> None:
    for args, words in (
        (("--replicas", "many"), "give a whole number from 0 to 1000, or MIN-MAX"),
        (("--replicas", "1001"), "give a whole number from 0 to 1000"),
        (("--replicas", "0-x"), "give MIN-MAX as two whole numbers, e.g. 0-8"),
        (("--target-inflight", "4"), "--target-inflight goes with --replicas MIN-MAX"),
        (("--replicas", "2", "--priority", "low"), "give --replicas as MIN-MAX (e.g. 0-2)"),
        (("--replicas", "0-2", "--ttft-slo", "soon"), "--ttft-slo"),
    ):
        api = FakeAPI(_answer)
        result = api.ctl("deploy", "m", *args)
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output, (args, result.output)
        assert api.calls == [], args


def test_prefetch_goes_into_a_range_policy() -> None:
    api = FakeAPI(_answer)
    result = api.ctl("deploy", "m", "--replicas", "0-4", "--prefetch")
    assert result.exit_code == 0, result.output
    assert api.calls == [
        ("POST", "/api/models", {"name": "m", "replicas": {"min": 0, "max": 4, "prefetch": True}})
    ]
    assert "deployed m: 0-4 replicas by demand (0 now) (weights kept warm where it may go)" in (
        result.output
    )


def test_a_fixed_count_with_prefetch_is_sent_as_equal_bounds() -> None:
    # What an operator means by --replicas 2 --prefetch: two replicas, weights kept warm.
    api = FakeAPI(_answer)
    result = api.ctl("deploy", "m", "--replicas", "2", "--prefetch")
    assert result.exit_code == 0, result.output
    assert api.calls == [
        ("POST", "/api/models", {"name": "m", "replicas": {"min": 2, "max": 2, "prefetch": True}})
    ]
    assert "deployed m: 2 replicas (weights kept warm where it may go)" in result.output


def test_no_prefetch_turns_it_off() -> None:
    api = FakeAPI(_answer)
    assert api.ctl("deploy", "m", "--replicas", "2", "--no-prefetch").exit_code == 0
    assert api.ctl("deploy", "m", "--replicas", "0-4", "--no-prefetch").exit_code == 0
    assert [c[2]["replicas"] for c in api.calls] == [2, {"min": 0, "max": 4, "prefetch": False}]


def test_prefetch_without_replicas_is_refused_and_sends_nothing() -> None:
    api = FakeAPI(_answer)
    result = api.ctl("deploy", "m", "--prefetch")
    assert result.exit_code == 2, result.output
    assert "--prefetch goes with --replicas MIN-MAX (e.g. --replicas 0-8) or N" in result.output
    assert api.calls == []


def test_target_tokens_goes_into_a_range_policy_and_is_refused_without_one() -> None:
    api = FakeAPI(_answer)
    result = api.ctl("deploy", "m", "--replicas", "0-8", "--target-tokens", "32000")
    assert result.exit_code == 0, result.output
    assert api.calls == [
        (
            "POST",
            "/api/models",
            {"name": "m", "replicas": {"min": 0, "max": 8, "target_tokens": 32000}},
        )
    ]
    for args, words in (
        (("--target-tokens", "100"), "--target-tokens goes with --replicas MIN-MAX"),
        (("--replicas", "2", "--target-tokens", "100"), "give --replicas as MIN-MAX (e.g. 0-2)"),
        (("--replicas", "0-2", "--target-tokens", "0"), "--target-tokens"),
        (("--replicas", "0-2", "--target-tokens", "many"), "'many' is not a valid integer"),
    ):
        api = FakeAPI(_answer)
        result = api.ctl("deploy", "m", *args)
        assert result.exit_code == 2, (args, result.output)
        assert words in result.output, (args, result.output)
        assert api.calls == [], args
