"""What every CLI module shares: the one place an LlmgwError becomes an exit, and aligned
tables with their time cells.

An ``LlmgwError`` that leaves a command is reported by the group that invoked it: ``error:
MESSAGE`` on stderr and the error's ``exit_code``. The root ``llmgw`` group is a
``ReportingGroup`` and so are its sub-groups (``ctl``, ``ctl cert``, ``agent``, ``engine``),
so a group run on its own (tests, ``python -c``) reports the same way; a command that is also
run on its own outside any group (``engine-check``) is a ``ReportingCommand``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from llmgw.errors import LlmgwError

__all__ = [
    "ReportingCommand",
    "ReportingGroup",
    "ago",
    "echo_json",
    "table",
    "until",
]


@contextmanager
def _reported() -> Iterator[None]:
    """Turn an LlmgwError into a clean exit: the message on stderr, the error's exit code."""
    try:
        yield
    except LlmgwError as e:
        click.echo(f"error: {e}", err=True)
        raise click.exceptions.Exit(e.exit_code) from e


class ReportingGroup(click.Group):
    """A group that reports the LlmgwError of any command below it (see the module's doc).

    Groups created with ``@group.group()`` are of this class too."""

    group_class = type

    def invoke(self, ctx: click.Context) -> Any:
        with _reported():
            return super().invoke(ctx)


class ReportingCommand(click.Command):
    """A command that reports its own LlmgwError when it runs outside a ReportingGroup."""

    def invoke(self, ctx: click.Context) -> Any:
        with _reported():
            return super().invoke(ctx)


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
