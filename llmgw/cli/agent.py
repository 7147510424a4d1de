"""``llmgw agent``: the node agent."""

from __future__ import annotations

from pathlib import Path

import click

from llmgw.agent.config import DEFAULT_AGENT_CONFIG, load_agent_config
from llmgw.agent.service import run_agent
from llmgw.cli.common import reports_errors
from llmgw.log import setup_logging

__all__ = ["agent"]


@click.group(invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_AGENT_CONFIG,
    show_default=True,
    envvar="LLMGW_AGENT_CONFIG",
    help="agent.yaml (env: LLMGW_AGENT_CONFIG).",
)
@click.option(
    "--log-level",
    default="info",
    envvar="LLMGW_LOG_LEVEL",
    help="debug, info, warning (env: LLMGW_LOG_LEVEL).",
)
@click.option("--check", is_flag=True, help="Validate the configuration and exit.")
@click.pass_context
@reports_errors
def agent(ctx: click.Context, config_path: Path, log_level: str, check: bool) -> None:
    """Run the node agent (systemd Type=notify)."""
    if ctx.invoked_subcommand is not None:
        return
    cfg = load_agent_config(config_path)
    if check:
        click.echo(f"{config_path}: ok (node {cfg.node_id}, servers {', '.join(cfg.servers)})")
        return
    setup_logging(log_level)
    run_agent(cfg)
