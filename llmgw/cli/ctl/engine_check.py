"""``llmgw ctl engine-check ENGINE``: check that an engine understands every flag llmgw may
pass it, against the engine's own ``--help`` (run here, or given)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from llmgw.cli.common import Duration, ReportingCommand
from llmgw.cli.ctl.output import echo_json, table, wants_json
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG
from llmgw.engines.check import AgentEngines, CheckReport, FoundEngine, check_engine
from llmgw.engines.registry import AVAILABLE_ENGINES
from llmgw.errors import EngineError

__all__ = ["engine_check"]


def _help_text(value: str) -> str:
    """The text of ``--help-output``: a file, ``-`` for stdin, or the help text itself."""
    if value == "-":
        return sys.stdin.read()
    if "\n" in value:
        return value
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"cannot read {value}: {exc}") from None
    raise click.BadParameter(
        f"{value!r} is not a file, and one line is not a help text; give the file that holds "
        "the engine's --help output (or '-' to read it from stdin)"
    )


def render(report: CheckReport) -> str:
    """The table a user sees: each flag, the commands that use it, ok or missing."""
    rows = [
        (check.flag, ", ".join(check.used_by), "ok" if check.documented else "MISSING")
        for check in report.flags
    ]
    lines = [
        f"engine {report.engine}, version {report.version}",
        f"help: {report.source} ({report.help_lines} lines)",
        "",
        table(("FLAG", "USED BY", "HELP"), rows),
    ]
    lines += [f"not checked: {note}" for note in report.skipped]
    return "\n".join(lines)


@click.command("engine-check", cls=ReportingCommand)
@click.argument("engine", type=click.Choice(AVAILABLE_ENGINES))
@click.option(
    "--help-output",
    "help_output",
    metavar="FILE_OR_TEXT",
    help="The engine's help text (a file, '-' for stdin, or the text) instead of running "
    "the engine here; the version is then unknown.",
)
@click.option(
    "--binary",
    metavar="PROGRAM",
    help="The engine's program (llama-server, vllm, the Python with SGLang). Default: what "
    "the agent config names, else the default name on PATH.",
)
@click.option(
    "--agent-config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_AGENT_CONFIG",
    help="agent.yaml whose engines.* settings find the engine (env: LLMGW_AGENT_CONFIG; "
    "default /etc/llmgw/agent.yaml when it exists).",
)
@click.option(
    "--timeout",
    type=Duration(minimum=1),
    default="2m",
    show_default=True,
    help="How long to wait for the engine's --help and --version (at least 1s).",
)
def engine_check(
    engine: str,
    help_output: str | None,
    binary: str | None,
    agent_config: Path | None,
    timeout: float,
) -> None:
    """Check that ENGINE documents every flag llmgw may pass it.

    Builds the widest commands llmgw produces for ENGINE (rank 0 of a multi-node replica
    with every parameter, and a worker) and looks for each flag in the engine's --help, as
    a whole word. Exits 1 listing the missing flags.
    """
    if agent_config is None and binary is None and help_output is None:
        agent_config = DEFAULT_AGENT_CONFIG if DEFAULT_AGENT_CONFIG.is_file() else None
    text = None if help_output is None else _help_text(help_output)
    agent = None
    if agent_config is not None:
        config_path = agent_config

        def find() -> list[FoundEngine]:
            # Imported here: the agent's modules are needed only to find the engine the way
            # the agent would, not to check a given help text.
            from llmgw.agent.config import load_agent_config
            from llmgw.agent.discovery import engine_candidates

            return list(engine_candidates(load_agent_config(config_path)))

        agent = AgentEngines(agent_config, find)
    report = check_engine(engine, help_text=text, binary=binary, agent=agent, timeout=timeout)
    if wants_json():
        echo_json({**dataclasses.asdict(report), "missing": report.missing})
    else:
        click.echo(render(report))
    for warning in report.warnings:
        click.echo(f"warning: {warning}", err=True)
    missing = report.missing
    if missing:
        raise EngineError(
            f"{engine} does not document {len(missing)} of the {len(report.flags)} flags llmgw "
            f"may pass it: {', '.join(missing)} (engine version: {report.version}); upgrade "
            "the engine to one that has them, or deploy its models with another engine"
        )
    if not wants_json():
        click.echo(f"ok: all {len(report.flags)} flags are documented")
