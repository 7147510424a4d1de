"""Line charts rendered on the server as SVG strings, for the console's pages: no script and
no ``style`` attribute (the console's Content-Security-Policy is ``default-src 'self'``),
only SVG presentation attributes and classes that the console's stylesheet may restyle.

Pure functions: values in, text out. Every text (a title, a label, a unit: model names are
the operator's input) is escaped, and characters XML cannot hold are dropped.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PALETTE", "Line", "line_chart", "nice_ticks"]

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")
"""Each line's stroke, in order (classes ``line-0``, ``line-1``... restyle them)."""

# What XML 1.0 cannot hold, even escaped: C0 controls but tab, LF, CR; lone surrogates;
# U+FFFE and U+FFFF.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

_LEFT, _RIGHT, _TOP, _BOTTOM = 48, 10, 42, 24  # margins around the plot
_X_TICK_MIN = 15  # minutes between the x axis' labels


@dataclass(frozen=True)
class Line:
    """One line: its legend label and its points (UNIX seconds, value; None: a gap)."""

    label: str
    points: Sequence[tuple[float, float | None]]


def _text(value: str) -> str:
    return html.escape(_NOT_XML.sub("", value), quote=True)


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Ticks from 0 to at least ``top``, about ``count`` steps of 1, 2 or 5 x 10^n."""
    if not top > 0 or not math.isfinite(top):
        top = 1.0
    rough = top / count
    power = 10.0 ** math.floor(math.log10(rough))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= rough)
    steps = math.ceil(top / step - 1e-9)
    return [_round(i * step, step) for i in range(steps + 1)]


def _decimals(step: float) -> int:
    return max(0, -math.floor(math.log10(step) + 1e-9))


def _round(value: float, step: float) -> float:
    return round(value, _decimals(step))


def _label(value: float, step: float) -> str:
    return f"{value:.{_decimals(step)}f}"


def _num(value: float) -> str:
    return f"{value:.1f}"


def line_chart(
    title: str,
    lines: Sequence[Line],
    *,
    unit: str,
    now: float,
    span_s: float = 3600.0,
    width: int = 480,
    height: int = 200,
) -> str:
    """An SVG line chart of ``lines`` over the ``span_s`` seconds up to ``now``: y from 0
    with nice ticks labelled in ``unit``, x labelled in minutes ago, a legend of the lines.

    ``width`` x ``height`` is the viewBox (and the default size); the chart scales to any
    width the page gives it (the class ``chart``: a stylesheet's ``width: 100%``), so that
    at 480 its 11-unit text stays readable on a 390 px phone."""
    runs = [_runs(line.points, now - span_s, now) for line in lines]
    values = [v for line_runs in runs for run in line_runs for _t, v in run]
    ticks = nice_ticks(max(values, default=0.0))
    frame = _Frame(now - span_s, span_s, width, height, ticks[-1])
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="{_text(title)}" '
        'font-family="sans-serif" font-size="11">',
        f"<title>{_text(title)}</title>",
        f'<text class="chart-title" x="{_LEFT}" y="14" font-size="13" font-weight="bold">'
        f"{_text(title)}</text>",
        *_y_axis(frame, ticks, unit),
        *_x_axis(frame, now),
        *_plot(frame, runs),
    ]
    if not values:
        out.append(
            f'<text class="chart-empty" x="{_num(_LEFT + frame.plot_w / 2)}" '
            f'y="{_num(_TOP + frame.plot_h / 2)}" text-anchor="middle" fill="#71717a">no data</text>'
        )
    out.extend(_legend(lines))
    out.append("</svg>")
    return "\n".join(out)


@dataclass(frozen=True)
class _Frame:
    """Where a time and a value land in the chart: the plot inside the margins."""

    start: float
    span_s: float
    width: int
    height: int
    y_top: float

    @property
    def plot_w(self) -> int:
        return self.width - _LEFT - _RIGHT

    @property
    def plot_h(self) -> int:
        return self.height - _TOP - _BOTTOM

    def x_of(self, t: float) -> float:
        return _LEFT + (t - self.start) / self.span_s * self.plot_w

    def y_of(self, v: float) -> float:
        return _TOP + self.plot_h - v / self.y_top * self.plot_h


def _y_axis(frame: _Frame, ticks: list[float], unit: str) -> list[str]:
    """Grid lines and their labels, the unit above them."""
    step = ticks[1] - ticks[0]
    out = [f'<text class="chart-unit" x="4" y="{_TOP - 12}">{_text(unit)}</text>']
    for tick in ticks:
        y = _num(frame.y_of(tick))
        out.append(
            f'<line class="chart-grid" x1="{_LEFT}" y1="{y}" x2="{frame.width - _RIGHT}" '
            f'y2="{y}" stroke="#d4d4d8" stroke-width="1"/>'
        )
        out.append(
            f'<text class="chart-tick" x="{_LEFT - 4}" y="{y}" text-anchor="end" '
            f'dominant-baseline="middle">{_label(tick, step)}</text>'
        )
    return out


def _x_axis(frame: _Frame, now: float) -> list[str]:
    """Minutes ago, every 15 minutes of the span, "now" at the right; the axis line at 0."""
    out = []
    minutes = int(frame.span_s // 60)
    for ago in range(0, minutes + 1, _X_TICK_MIN):
        x = _num(frame.x_of(now - ago * 60))
        anchor = "end" if ago == 0 else "start" if ago == minutes else "middle"
        label = "now" if ago == 0 else f"{ago} min ago"
        out.append(
            f'<text class="chart-tick" x="{x}" y="{frame.height - 6}" text-anchor="{anchor}">'
            f"{label}</text>"
        )
    zero = _num(frame.y_of(0))
    out.append(
        f'<line class="chart-axis" x1="{_LEFT}" y1="{zero}" x2="{frame.width - _RIGHT}" '
        f'y2="{zero}" stroke="#71717a" stroke-width="1"/>'
    )
    return out


def _plot(frame: _Frame, runs: list[list[list[tuple[float, float]]]]) -> list[str]:
    """The lines, broken at each gap; a point alone between gaps as a dot."""
    out = []
    for n, line_runs in enumerate(runs):
        colour = PALETTE[n % len(PALETTE)]
        for run in line_runs:
            coords = [(_num(frame.x_of(t)), _num(frame.y_of(max(v, 0.0)))) for t, v in run]
            if len(coords) == 1:
                (x, y), *_ = coords
                out.append(f'<circle class="line-{n}" cx="{x}" cy="{y}" r="1.5" fill="{colour}"/>')
            else:
                d = "M" + " L".join(f"{x} {y}" for x, y in coords)
                out.append(
                    f'<path class="line-{n}" d="{d}" fill="none" stroke="{colour}" '
                    'stroke-width="1.5" stroke-linejoin="round"/>'
                )
    return out


def _legend(lines: Sequence[Line]) -> list[str]:
    """One row under the title: each line's colour and label."""
    out = []
    legend_x = _LEFT
    for n, line in enumerate(lines):
        colour = PALETTE[n % len(PALETTE)]
        out.append(
            f'<line class="line-{n}" x1="{legend_x}" y1="26" x2="{legend_x + 14}" y2="26" '
            f'stroke="{colour}" stroke-width="2"/>'
        )
        out.append(
            f'<text class="chart-legend" x="{legend_x + 18}" y="26" dominant-baseline="middle">'
            f"{_text(line.label)}</text>"
        )
        legend_x += 26 + 7 * len(line.label)
    return out


def _runs(
    points: Sequence[tuple[float, float | None]], start: float, end: float
) -> list[list[tuple[float, float]]]:
    """The runs of consecutive points with a value inside [start, end], split at gaps."""
    runs: list[list[tuple[float, float]]] = []
    run: list[tuple[float, float]] = []
    for t, v in points:
        if v is None or not math.isfinite(v) or not start <= t <= end:
            if run:
                runs.append(run)
                run = []
            continue
        run.append((t, v))
    if run:
        runs.append(run)
    return runs
