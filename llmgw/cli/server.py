"""``llmgw server``: the control plane.

``llmgw server [--config FILE]`` runs it (what the systemd unit runs); the group's verbs
act on a control plane's state without running it (``migrate``: SQLite to PostgreSQL).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import click

from llmgw.cli.common import ReportingGroup
from llmgw.contracts.paths import DEFAULT_SERVER_CONFIG
from llmgw.log import setup_logging
from llmgw.server.app import ControlPlane
from llmgw.server.config import load_server_config

__all__ = ["server"]


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_SERVER_CONFIG",
    help=f"server.yaml (env: LLMGW_SERVER_CONFIG; default {DEFAULT_SERVER_CONFIG} when it exists).",
)
@click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), help="Override state_dir."
)
@click.option(
    "--log-level",
    default="info",
    envvar="LLMGW_LOG_LEVEL",
    help="debug, info, warning (env: LLMGW_LOG_LEVEL).",
)
@click.pass_context
def server(
    ctx: click.Context, config_path: Path | None, state_dir: Path | None, log_level: str
) -> None:
    """Run the control plane: gateway :8080, enrolment, agent stream :7443.

    With a command, act on a control plane's state instead of running it."""
    setup_logging(log_level)
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None and DEFAULT_SERVER_CONFIG.exists():
        config_path = DEFAULT_SERVER_CONFIG
    overrides = {"state_dir": str(state_dir)} if state_dir else None
    cfg = load_server_config(config_path, overrides=overrides)

    async def main() -> None:
        cp = ControlPlane(cfg)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await cp.start()
        try:
            await stop.wait()
        finally:
            await cp.stop()

    asyncio.run(main())
