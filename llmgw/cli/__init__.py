"""The ``llmgw`` command: one program, three roles (control plane, agent, operator CLI)."""

from __future__ import annotations

import click

from llmgw import __version__
from llmgw.cli.agent import agent
from llmgw.cli.ctl import ctl
from llmgw.cli.engine import engine
from llmgw.cli.server import server
from llmgw.cli.up import up

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", message="llmgw %(version)s")
def main() -> None:
    """llmgw: a fleet manager and OpenAI-compatible gateway for LLM inference on GPU machines."""


main.add_command(up)
main.add_command(server)
main.add_command(agent)
main.add_command(ctl)
main.add_command(engine)
