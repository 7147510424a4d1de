"""What ``llmgw ctl`` tables look like: padded columns, ``-`` for nothing, relative times."""

from __future__ import annotations

import pytest

from llmgw.cli.ctl import output
from llmgw.cli.ctl.output import ago, echo_json, table, until

NOW = 1_000_000.0


@pytest.fixture(autouse=True)
def frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output.time, "time", lambda: NOW)


def test_table_pads_all_but_the_last_column() -> None:
    assert table(["A", "LONGER"], [["xyz", None], ["", "1"]]) == "A    LONGER\nxyz  -\n     1"


@pytest.mark.parametrize(
    ("ts", "cell"),
    [
        (None, "-"),
        (0, "-"),
        (NOW - 42, "42s ago"),
        (NOW + 5, "0s ago"),  # a clock a little ahead is not "in the future"
        (NOW - 300, "5m ago"),
        (NOW - 3 * 3600, "3h ago"),
    ],
)
def test_ago(ts: float | None, cell: str) -> None:
    assert ago(ts) == cell


@pytest.mark.parametrize(
    ("ts", "cell"),
    [
        (None, "-"),
        (NOW, "expired"),
        (NOW + 1800, "in 30m"),
        (NOW + 5 * 3600, "in 5h"),
        (NOW + 20 * 86400, "in 20d"),
    ],
)
def test_until(ts: float | None, cell: str) -> None:
    assert until(ts) == cell


def test_json_is_sorted_and_indented(capsys: pytest.CaptureFixture[str]) -> None:
    echo_json({"b": 1, "a": [None]})
    assert capsys.readouterr().out == '{\n  "a": [\n    null\n  ],\n  "b": 1\n}\n'
