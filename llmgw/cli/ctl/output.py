"""How ``llmgw ctl`` prints: tables with aligned columns and their time cells, or JSON for
scripts (``--json``)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import click

__all__ = ["ago", "count", "echo_json", "table", "until", "wants_json"]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; the last column is not padded."""
    cells = [[str(h) for h in headers]] + [
        ["-" if c is None else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.ljust(widths[i]) if i < len(row) - 1 else c for i, c in enumerate(row)]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def count(n: int) -> str:
    """A table cell for a count, its thousands apart: ``1,234,567``."""
    return f"{n:,}"


def ago(ts: float | None) -> str:
    """A table cell for a past time: ``42s ago``, ``5m ago``, ``3h ago``; ``-`` for none."""
    if not ts:
        return "-"
    secs = max(0, time.time() - ts)
    if secs < 120:
        return f"{secs:.0f}s ago"
    if secs < 7200:
        return f"{secs / 60:.0f}m ago"
    return f"{secs / 3600:.0f}h ago"


def until(ts: float | None) -> str:
    """A table cell for a future time: ``in 30m``, ``in 5h``, ``in 20d``, ``expired``; ``-``."""
    if not ts:
        return "-"
    secs = ts - time.time()
    if secs <= 0:
        return "expired"
    if secs < 7200:
        return f"in {secs / 60:.0f}m"
    if secs < 3 * 86400:
        return f"in {secs / 3600:.0f}h"
    return f"in {secs / 86400:.0f}d"


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def wants_json() -> bool:
    """Whether ``--json`` was given, before or after the subcommand: for the commands that
    need no control plane and so take no ``Ctl`` (``cert init-ca``, ``engine-check``)."""
    ctx = click.get_current_context(silent=True)
    obj = None if ctx is None else ctx.obj
    return bool(getattr(obj, "as_json", False))
