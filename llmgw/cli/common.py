"""What every CLI module shares: the one place an LlmgwError becomes an exit, and aligned tables.

An ``LlmgwError`` that leaves a command is reported by the group that invoked it: ``error:
MESSAGE`` on stderr and the error's ``exit_code``. The root ``llmgw`` group is a
``ReportingGroup`` and so are its sub-groups (``ctl``, ``ctl cert``, ``agent``, ``engine``),
so a group run on its own (tests, ``python -c``) reports the same way; a command that is also
run on its own outside any group (``engine-check``) is a ``ReportingCommand``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import click

from llmgw.errors import LlmgwError

__all__ = [
    "ReportingCommand",
    "ReportingGroup",
    "echo_json",
    "table",
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


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))
