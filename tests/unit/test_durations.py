"""Unit tests of llmgw.durations: the one duration syntax."""

from __future__ import annotations

import pytest

from llmgw.durations import format_duration, parse_duration
from llmgw.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (60, 60.0),
        (1.5, 1.5),
        (0, 0.0),
        ("60", 60.0),
        ("60s", 60.0),
        ("500ms", 0.5),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("2.5h", 9000.0),
        ("30d", 30 * 86400.0),  # valid everywhere now, catalog.yaml included
        (" 12h ", 43200.0),
        (".5s", 0.5),
    ],
)
def test_durations(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value", ["s", "1 h", "1w", "1.s", "-1s", "soon", "", True, None, [1], "1e3s", "inf"]
)
def test_bad_durations_name_the_accepted_forms(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(value)
    message = str(info.value)
    assert "a duration like 500ms, 30s, 5m, 2h or 30d" in message
    assert repr(value) in message
    assert info.value.key is None


@pytest.mark.parametrize("value", [-1, -0.5, float("inf"), float("nan")])
def test_negative_and_infinite_numbers_are_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="0 s or more"):
        parse_duration(value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (86400, "1d"),
        (30 * 86400, "30d"),
        (3600, "1h"),
        (5400, "90m"),
        (90, "90s"),
        (0.25, "250ms"),
        (1.5, "1500ms"),
        (0.0001, "0.0001s"),
    ],
)
def test_format_duration_reads_back(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


def test_format_duration_refuses_what_is_no_duration() -> None:
    with pytest.raises(ValueError):
        format_duration(-1)
