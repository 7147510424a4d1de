"""The ``llmgw`` command: one program, three roles (control plane, agent, operator CLI).

The subcommands are imported when they are used, not when the program starts: ``llmgw
--version`` and ``llmgw --help`` load none of grpc, aiohttp or cryptography (the frozen
one-folder build must answer ``--version`` within 0.4 s). ``llmgw --help`` lists each
command with the summary recorded in ``COMMANDS`` below; a unit test holds those summaries
equal to the commands' own help texts.

An LlmgwError that leaves any command is reported once, by this group (``LazyGroup`` is a
``ReportingGroup``): ``error: MESSAGE`` on stderr and the error's exit code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

from llmgw import __version__
from llmgw.cli.common import ReportingGroup

__all__ = ["COMMANDS", "LazyCommand", "LazyGroup", "main"]


@dataclass(frozen=True)
class LazyCommand:
    """How to import a subcommand, and the help text ``--help`` shows before it is imported."""

    importer: Callable[[], object]
    summary: str

    def load(self) -> click.Command:
        command = self.importer()
        if not isinstance(command, click.Command):
            raise TypeError(f"{command!r} is not a click command")
        return command


# Plain import statements (not importlib with a module name), so that PyInstaller's analysis
# of this file finds every subcommand module and freezes it.
def _up() -> object:
    from llmgw.cli.up import up

    return up


def _server() -> object:
    from llmgw.cli.server import server

    return server


def _agent() -> object:
    from llmgw.cli.agent import agent

    return agent


def _ctl() -> object:
    from llmgw.cli.ctl import ctl

    return ctl


def _engine() -> object:
    from llmgw.cli.engine import engine

    return engine


COMMANDS: dict[str, LazyCommand] = {
    "up": LazyCommand(
        _up, "Start a one-machine cluster and print the OpenAI base URL; Ctrl-C stops it all."
    ),
    "server": LazyCommand(
        _server, "Run the control plane: gateway :8080, enrolment, agent stream :7443."
    ),
    "agent": LazyCommand(_agent, "Run the node agent (systemd Type=notify)."),
    "ctl": LazyCommand(_ctl, "Operate a cluster: nodes, models, replicas, API keys, certificates."),
    "engine": LazyCommand(_engine, "Built-in inference engines."),
}


class LazyGroup(ReportingGroup):
    """A group whose subcommands are imported on first use (see ``COMMANDS``); the
    LlmgwError of any command below it is reported here, once (see ``llmgw.cli.common``)."""

    def __init__(self, *args: Any, lazy: dict[str, LazyCommand], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = lazy

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


@click.group(
    cls=LazyGroup,
    lazy=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", "-V", message="llmgw %(version)s")
def main() -> None:
    """llmgw: a fleet manager and OpenAI-compatible gateway for LLM inference on GPU machines."""
