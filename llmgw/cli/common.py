"""What every command of the CLI shares: the one place an LlmgwError becomes an exit, the
one way a group imports its commands on first use, and the one parameter type for durations.

An ``LlmgwError`` that leaves a command is reported by the group that invoked it: ``error:
MESSAGE`` on stderr and the error's ``exit_code``. The root ``llmgw`` group is a
``ReportingGroup`` and so are its sub-groups (``ctl``, ``ctl cert``, ``agent``, ``engine``),
so a group run on its own (tests, ``python -c``) reports the same way; a command that is also
run on its own outside any group (``engine-check``) is a ``ReportingCommand``.

A group whose commands are costly to import (the root ``llmgw`` group, whose commands load
grpc, aiohttp or cryptography; ``llmgw agent``, whose root commands must not load the agent)
is a :class:`LazyGroup`: each such command is a :class:`LazyCommand`, imported when it is
named, and listed by ``--help`` from its recorded summary without importing it.

An option that takes a time is a :class:`Duration`: llmgw's one duration syntax
(:mod:`llmgw.durations`: ``90``, ``500ms``, ``30s``, ``5m``, ``2h``, ``30d``), as in the
configuration files.
"""

from __future__ import annotations

import contextlib
import shlex
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from llmgw.durations import format_duration, parse_duration
from llmgw.errors import ConfigError, LlmgwError

__all__ = [
    "Duration",
    "LazyCommand",
    "LazyGroup",
    "ReportingCommand",
    "ReportingGroup",
    "typed_command",
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


@dataclass(frozen=True)
class LazyCommand:
    """How to import a command, and the help text ``--help`` shows before it is imported (the
    first paragraph of the command's own help; a unit test holds the two equal).

    ``importer`` is a function with a plain import statement in it, not importlib with a
    module name, so that PyInstaller's analysis finds the command's module and freezes it."""

    importer: Callable[[], object]
    summary: str

    def load(self) -> click.Command:
        command = self.importer()
        if not isinstance(command, click.Command):
            raise TypeError(f"{command!r} is not a click command")
        return command


class LazyGroup(ReportingGroup):
    """A reporting group whose commands in ``lazy`` (name -> LazyCommand) are imported on
    first use; its other commands are added the usual way."""

    def __init__(
        self, *args: Any, lazy: Mapping[str, LazyCommand] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is not None or cmd_name not in self.lazy:
            return command
        command = self.lazy[cmd_name].load()
        self.add_command(command, cmd_name)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Click's listing, from the recorded summaries of the commands not loaded yet."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            # A command not imported yet is listed the way click lists one with its summary.
            command = self.commands.get(name) or click.Command(name, help=self.lazy[name].summary)
            if not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


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


def typed_command() -> str:
    """How the user can type this very llmgw in the shell they started it from: ``llmgw``
    when that is what their PATH finds, else its path (``.venv/bin/llmgw`` after ``make
    run``, whose venv is not activated), or ``PYTHON -m llmgw``; shell-quoted."""
    if getattr(sys, "frozen", False):
        me, module = Path(sys.executable), False
    else:
        me = Path(sys.argv[0] or "llmgw")
        module = me.name == "__main__.py"
        if module:
            me = Path(sys.executable)
    if not module:
        found = shutil.which("llmgw")
        with contextlib.suppress(OSError):
            if found and Path(found).resolve() == me.resolve():
                return "llmgw"
    here = Path.cwd()
    try:
        path = str(me.absolute().relative_to(here))
        path = path if "/" in path else f"./{path}"
    except ValueError:
        path = str(me.absolute())
    return f"{shlex.quote(path)} -m llmgw" if module else shlex.quote(path)
