"""A profile's ``sleep: {level: N}``: accepted for the engines that sleep at that level,
stored and read back, its flags put before the profile's args, and every refusal naming
the key and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.contracts.catalog import parse_catalog, parse_profile, profile_sleep_level
from llmgw.errors import ConfigError

VLLM = {"engine": "vllm", "source": "llama-3-8b", "gpus": 1}


def parsed(**given: Any) -> Any:
    catalog = parse_catalog({"models": {"m": {"profiles": {"p": given}}}}, source="catalog.yaml")
    return catalog.models["m"].profiles["p"]


@pytest.mark.parametrize(
    ("given", "level", "flags"),
    [
        ({**VLLM, "sleep": {"level": 1}}, 1, ("--enable-sleep-mode",)),
        ({**VLLM, "sleep": {"level": 2}}, 2, ("--enable-sleep-mode",)),
        (
            {"engine": "sglang", "source": "x", "gpus": 1, "sleep": {"level": 1}},
            1,
            ("--enable-memory-saver", "--enable-weights-cpu-backup"),
        ),
        ({"engine": "sim", "sleep": {"level": 2}}, 2, ("--enable-sleep-mode",)),
    ],
)
def test_a_sleep_level_is_kept_and_gives_the_engine_its_flags(
    given: dict[str, Any], level: int, flags: tuple[str, ...]
) -> None:
    profile = parsed(**given, args=["--seed-x"]) if given["engine"] == "sim" else parsed(**given)
    assert profile.sleep_level == level
    assert profile.engine_args[: len(flags)] == flags
    stored = profile.to_dict()
    assert stored["sleep"] == {"level": level}
    assert profile_sleep_level(stored) == level
    assert parse_profile(stored, model="m", profile="p", source="stored") == profile


def test_no_sleep_is_not_stored_and_reads_as_0() -> None:
    stored = parsed(**VLLM).to_dict()
    assert "sleep" not in stored
    assert profile_sleep_level(stored) == 0
    assert profile_sleep_level(None) == 0
    # A stored level the engine does not sleep at (written by another llmgw) reads as none.
    assert profile_sleep_level({"engine": "llamacpp", "sleep": {"level": 1}}) == 0
    assert profile_sleep_level({"engine": "vllm", "sleep": {"level": True}}) == 0


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"engine": "llamacpp", "source": "x.gguf", "gpus": 1, "sleep": {"level": 1}},
            "models.m.profiles.p.sleep: engine llamacpp cannot sleep (it scales by start and "
            "stop only); drop 'sleep', or deploy the model with one of",
        ),
        (
            {"engine": "sglang", "source": "x", "gpus": 1, "sleep": {"level": 2}},
            "engine sglang sleeps at level 1, not 2",
        ),
        ({**VLLM, "sleep": {"level": 3}}, "engine vllm sleeps at level 1 or 2, not 3"),
        ({**VLLM, "sleep": {}}, "sleep.level: is missing: give 1"),
        ({**VLLM, "sleep": {"level": "1"}}, "sleep.level: must be a whole number"),
        ({**VLLM, "sleep": {"level": 1, "after": "5m"}}, "after"),
        ({**VLLM, "sleep": 1}, "sleep"),
        (
            {**VLLM, "gpus": 1, "nodes": 2, "sleep": {"level": 1}},
            "a replica of 2 nodes cannot sleep",
        ),
    ],
)
def test_refusals_name_the_key_and_the_fix(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        parsed(**given)
    assert message in str(caught.value)
