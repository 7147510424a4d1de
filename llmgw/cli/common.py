"""The one place an LlmgwError becomes an exit, for every command of the CLI.

An ``LlmgwError`` that leaves a command is reported by the group that invoked it: ``error:
MESSAGE`` on stderr and the error's ``exit_code``. The root ``llmgw`` group is a
``ReportingGroup`` and so are its sub-groups (``ctl``, ``ctl cert``, ``agent``, ``engine``),
so a group run on its own (tests, ``python -c``) reports the same way; a command that is also
run on its own outside any group (``engine-check``) is a ``ReportingCommand``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from llmgw.errors import LlmgwError

__all__ = ["ReportingCommand", "ReportingGroup"]


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
