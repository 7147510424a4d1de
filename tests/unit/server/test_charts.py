"""The console's SVG line charts (llmgw.server.console.charts): valid XML, every text escaped, no
style attribute, nice ticks, gaps, the legend and the x axis in minutes ago."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from llmgw.server.console.charts import Line, line_chart, nice_ticks

NS = "{http://www.w3.org/2000/svg}"
NOW = 1_800_000_000.0


def _points(values: list[float | None]) -> list[tuple[float, float | None]]:
    step = 3600 / len(values)
    return [(NOW - 3600 + (i + 1) * step, v) for i, v in enumerate(values)]


def _chart(values: list[float | None], title: str = "m", **kw: object) -> ET.Element:
    svg = line_chart(title, [Line("p50", _points(values))], unit="ms", now=NOW, **kw)  # type: ignore[arg-type]
    return ET.fromstring(svg)


@pytest.mark.parametrize(
    ("top", "ticks"),
    [
        (0.0, [0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (1.0, [0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (7.3, [0, 2, 4, 6, 8]),
        (10.0, [0, 2, 4, 6, 8, 10]),
        (23.0, [0, 5, 10, 15, 20, 25]),
        (480.0, [0, 100, 200, 300, 400, 500]),
        (0.037, [0, 0.01, 0.02, 0.03, 0.04]),
        (1234.0, [0, 500, 1000, 1500]),
    ],
)
def test_ticks_are_1_2_5_times_a_power_of_ten(top: float, ticks: list[float]) -> None:
    assert nice_ticks(top) == ticks


def test_a_model_name_is_escaped_everywhere() -> None:
    name = '<script>alert("x")</script>&\x00'
    svg = line_chart(name, [Line(name, _points([1.0, 2.0]))], unit="<b>", now=NOW)
    assert "<script>" not in svg and "<b>" not in svg
    root = ET.fromstring(svg)  # parses: the NUL XML cannot hold was dropped
    assert root.find(f"{NS}title").text == '<script>alert("x")</script>&'  # type: ignore[union-attr]
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert '<script>alert("x")</script>&' in texts and "<b>" in texts
    assert root.get("aria-label") == '<script>alert("x")</script>&'


def test_valid_svg_without_style_or_script() -> None:
    root = _chart([1.0, 2.0, None, 3.0])
    assert root.tag == f"{NS}svg"
    assert root.get("viewBox") == "0 0 480 200"
    for element in root.iter():
        assert "style" not in element.attrib
        assert element.tag not in (f"{NS}script", f"{NS}style")
    wide = _chart([1.0], width=900, height=300)
    assert wide.get("viewBox") == "0 0 900 300" and wide.get("width") == "900"


def test_gaps_break_the_line() -> None:
    root = _chart([1.0, 2.0, None, None, 3.0, 4.0, 5.0, None, 6.0])
    paths = [p for p in root.iter(f"{NS}path") if p.get("class") == "line-0"]
    assert [p.get("d", "").count("L") for p in paths] == [1, 2]
    # A point alone between gaps is a dot.
    assert len([c for c in root.iter(f"{NS}circle") if c.get("class") == "line-0"]) == 1


def test_two_lines_with_a_legend_and_the_x_axis_in_minutes_ago() -> None:
    svg = line_chart(
        "ttft",
        [Line("p50", _points([0.1, 0.2])), Line("p99", _points([0.5, 0.9]))],
        unit="s",
        now=NOW,
    )
    root = ET.fromstring(svg)
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "p50" in texts and "p99" in texts
    # Every text is placed (x and y numbers), the second legend entry right of the first.
    placed = {
        t.text: (float(t.get("x", "")), float(t.get("y", ""))) for t in root.iter(f"{NS}text")
    }
    assert placed["p99"][0] > placed["p50"][0] and placed["p99"][1] == placed["p50"][1]
    assert {"now", "15 min ago", "30 min ago", "45 min ago", "60 min ago"} <= set(texts)
    strokes = {p.get("class"): p.get("stroke") for p in root.iter(f"{NS}path")}
    assert set(strokes) == {"line-0", "line-1"} and strokes["line-0"] != strokes["line-1"]
    # y ticks to 1 (the top value 0.9), the unit shown.
    assert {"0.0", "0.2", "1.0", "s"} <= set(texts)


def test_no_data_says_so() -> None:
    root = _chart([None, None])
    assert not list(root.iter(f"{NS}path"))
    assert "no data" in [t.text for t in root.iter(f"{NS}text")]


def test_points_outside_the_hour_are_left_out() -> None:
    svg = line_chart(
        "m", [Line("x", [(NOW - 7200, 5.0), (NOW - 60, 1.0), (NOW - 30, 1.0)])], unit="", now=NOW
    )
    root = ET.fromstring(svg)
    (path,) = root.iter(f"{NS}path")
    assert path.get("d", "").count("L") == 1
    # Nor do they raise the y axis: its top tick is that of 1.0.
    assert "5" not in [t.text for t in root.iter(f"{NS}text")]
    assert "1.0" in [t.text for t in root.iter(f"{NS}text")]
