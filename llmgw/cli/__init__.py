"""The ``llmgw`` command: one program, three roles (control plane, agent, operator CLI).

The subcommands are imported when they are used, not when the program starts: ``llmgw
--version`` and ``llmgw --help`` load none of grpc, aiohttp or cryptography (the frozen
one-folder build must answer ``--version`` within 0.4 s). ``llmgw --help`` lists each
command with the summary recorded in ``COMMANDS`` below; a unit test holds those summaries
equal to the commands' own help texts.

An LlmgwError that leaves any command is reported once, by this group (a
:class:`llmgw.cli.common.LazyGroup`, which is a ``ReportingGroup``): ``error: MESSAGE`` on
stderr and the error's exit code.
"""

from __future__ import annotations

import os

import click

from llmgw import __version__
from llmgw.cli.common import LazyCommand, LazyGroup

__all__ = ["COMMANDS", "main"]

# gRPC's fork handlers serve programs that fork and go on using gRPC in the child; llmgw only
# forks to exec another program, and with them on, every such fork while gRPC is busy prints
# "fork_posix.cc ... skipping fork() handlers" (before 'llmgw up''s banner). Read by gRPC's
# core when it starts, so set before any subcommand imports grpc; an operator's value wins.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


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


@click.group(
    cls=LazyGroup,
    lazy=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, "--version", "-V", message="llmgw %(version)s")
def main() -> None:
    """llmgw: a fleet manager and OpenAI-compatible gateway for LLM inference on GPU machines."""
