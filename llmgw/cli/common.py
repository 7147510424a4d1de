"""What every command of the CLI shares: the one place an LlmgwError becomes an exit, and
the one parameter type for durations.

An ``LlmgwError`` that leaves a command is reported by the group that invoked it: ``error:
MESSAGE`` on stderr and the error's ``exit_code``. The root ``llmgw`` group is a
``ReportingGroup`` and so are its sub-groups (``ctl``, ``ctl cert``, ``agent``, ``engine``),
so a group run on its own (tests, ``python -c``) reports the same way; a command that is also
run on its own outside any group (``engine-check``) is a ``ReportingCommand``.

An option that takes a time is a :class:`Duration`: llmgw's one duration syntax
(:mod:`llmgw.durations`: ``90``, ``500ms``, ``30s``, ``5m``, ``2h``, ``30d``), as in the
configuration files.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from llmgw.durations import format_duration, parse_duration
from llmgw.errors import ConfigError, LlmgwError

__all__ = ["Duration", "ReportingCommand", "ReportingGroup"]


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


class Duration(click.ParamType):
    """Seconds, given in llmgw's one duration syntax (``90``, ``500ms``, ``30s``, ``5m``,
    ``2h``, ``30d``), at least ``minimum``; ``whole``: a whole number of seconds, as an int
    (for what the control plane takes only so). A default may be given the same way
    (``default="30m"``), which ``--help`` then shows as written."""

    name = "duration"

    def __init__(self, *, minimum: float = 0.0, whole: bool = False) -> None:
        self.minimum = minimum
        self.whole = whole

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            seconds = parse_duration(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)
        if seconds < self.minimum:
            self.fail(
                f"must be at least {format_duration(self.minimum)}; got {value!r}", param, ctx
            )
        if self.whole:
            if seconds != int(seconds):
                self.fail(f"must be a whole number of seconds; got {value!r}", param, ctx)
            return int(seconds)
        return seconds
