"""What every CLI module shares: turning our errors into exits, and aligned tables."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import click

from llmgw.errors import LlmgwError

__all__ = ["echo_json", "reports_errors", "table"]

F = TypeVar("F", bound=Callable[..., Any])


def reports_errors(func: F) -> F:
    """Turn the LlmgwError a command raises into a clean exit (message on stderr, exit_code)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except LlmgwError as e:
            click.echo(f"error: {e}", err=True)
            raise click.exceptions.Exit(e.exit_code) from e

    return cast(F, wrapper)


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
