"""llmgw.bodies' budget and limits, and the size helpers of llmgw.configfile, in memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw import bodies
from llmgw.bodies import BodyBudget, BodyTooLarge
from llmgw.configfile import Checker, format_size, parse_size
from llmgw.errors import ConfigError

MIB = 1024 * 1024


def test_budget_takes_up_to_its_capacity_and_no_more() -> None:
    budget = BodyBudget(10)
    assert budget.take(6)
    assert not budget.take(5)  # refused whole: nothing taken
    assert budget.used == 6
    assert budget.take(4)
    assert not budget.take(1)
    budget.give(10)
    assert budget.used == 0
    assert budget.take(10)


def test_an_emptied_budget_trims_only_after_holding_much(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(bodies, "_malloc_trim", lambda: trims.append(1))
    budget = BodyBudget(256 * MIB, trim_after=64 * MIB)
    for _ in range(3):  # small bodies come and go: never a trim
        assert budget.take(MIB)
        budget.give(MIB)
    assert trims == []
    assert budget.take(40 * MIB) and budget.take(40 * MIB)
    budget.give(40 * MIB)
    assert trims == []  # not empty yet
    budget.give(40 * MIB)
    assert trims == [1]
    assert budget.take(MIB)
    budget.give(MIB)
    assert trims == [1]  # the high mark was reset by the trim


def test_malloc_helpers_run_here() -> None:
    bodies._malloc_trim()  # no error, glibc or not
    assert isinstance(bodies.return_large_buffers(), bool)


def test_too_large_messages() -> None:
    assert str(BodyTooLarge(8 * MIB, 9_000_000)) == (
        "the request body is 9000000 bytes; the limit is 8 MiB"
    )
    assert str(BodyTooLarge(1000, None)) == "the request body is over the limit of 1000 bytes"


@pytest.mark.parametrize(
    ("text", "size"),
    [(1024, 1024), ("8MiB", 8 * MIB), ("512 KiB", 512 * 1024), ("1GiB", 1024**3), ("10b", 10)],
)
def test_parse_size(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("8MB", "ambiguous; use binary units, e.g. 8MiB"),
        ("8 parsecs", "unknown unit 'parsecs'"),
        (True, "a size like 8MiB"),
        (1.5, "a size like 8MiB"),
        ("0.5B", "not a whole number of bytes"),
    ],
)
def test_parse_size_refusals(text: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(8 * MIB) == "8 MiB"
    assert format_size(1024**3) == "1 GiB"
    assert format_size(1536) == "1536 bytes"
    assert format_size(3 * 1024) == "3 KiB"


CHECK = Checker(file="test.yaml", base_dir=Path("/"))


def test_body_limits_default_when_absent() -> None:
    assert bodies.parse_body_limits(CHECK, {}) == {
        "max_request_body": bodies.DEFAULT_MAX_REQUEST_BODY,
        "max_inflight_body_bytes": bodies.DEFAULT_MAX_INFLIGHT_BODY_BYTES,
        "max_response_body": bodies.DEFAULT_MAX_RESPONSE_BODY,
        "upstream_idle_timeout": bodies.DEFAULT_UPSTREAM_IDLE_TIMEOUT,
    }


@pytest.mark.parametrize(
    ("value", "seconds"), [("500ms", None), (90, 90.0), ("5m", 300.0), ("1d", 86400.0)]
)
def test_body_limits_read_the_idle_timeout_in_the_one_duration_syntax(
    value: object, seconds: float | None
) -> None:
    top = {"upstream_idle_timeout": value}
    if seconds is None:
        with pytest.raises(ConfigError, match="from 1 s to 1 d"):
            bodies.parse_body_limits(CHECK, top)
    else:
        assert bodies.parse_body_limits(CHECK, top)["upstream_idle_timeout"] == seconds


def test_body_limits_refuse_a_budget_below_one_request() -> None:
    top = {"max_request_body": "8MiB", "max_inflight_body_bytes": "4MiB"}
    with pytest.raises(ConfigError, match="less than max_request_body"):
        bodies.parse_body_limits(CHECK, top)
