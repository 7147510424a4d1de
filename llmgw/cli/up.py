"""``llmgw up``: a whole cluster on this machine. Its options default to
:class:`llmgw.cli.local_cluster.UpOptions`' own defaults."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from llmgw.cli.local_cluster import UpOptions, run_up
from llmgw.client import default_up_state_dir
from llmgw.log import LogfmtFormatter
from llmgw.loop import run as run_loop

__all__ = ["up"]


def _setup_up_logging(state_dir: Path, verbose: bool) -> None:
    """Full logs to a file; only warnings on the terminal unless --verbose."""
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for h in list(root.handlers):
        root.removeHandler(h)
    fh = logging.FileHandler(logs / "server.log")
    fh.setFormatter(LogfmtFormatter())
    root.addHandler(fh)
    sh = logging.StreamHandler()
    sh.setFormatter(LogfmtFormatter())
    sh.setLevel(logging.INFO if verbose else logging.WARNING)
    root.addHandler(sh)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


@click.command()
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="LLMGW_STATE_DIR",
    help="Where the cluster keeps its CA, database and logs (env: LLMGW_STATE_DIR; default ~/.local/share/llmgw).",
)
@click.option(
    "--host",
    default=UpOptions.host,
    show_default=True,
    help="Address of the gateway; 0.0.0.0 to share it.",
)
@click.option(
    "--port",
    "http_port",
    default=UpOptions.http_port,
    show_default=True,
    type=int,
    help="Gateway port (0 picks one).",
)
@click.option(
    "--grpc-port",
    default=UpOptions.grpc_port,
    show_default=True,
    type=int,
    help="Agent stream port (0 picks one).",
)
@click.option(
    "--agent-port",
    default=UpOptions.agent_port,
    show_default=True,
    type=int,
    help="The local agent's data-plane port (0 picks one).",
)
@click.option(
    "--enroll-port",
    default=UpOptions.enroll_port,
    show_default=True,
    type=int,
    help="Enrolment port, for joining more nodes (0 picks one).",
)
@click.option(
    "--replicas",
    default=None,
    type=click.IntRange(1, 16),
    help="Replicas of llmgw-sim (default 1; a state directory in use keeps its count, which the console or ctl may have changed, unless this is given).",
)
@click.option(
    "--ttft-ms",
    default=None,
    type=float,
    help="Simulated time to first token (default 0; a state directory in use keeps its setting unless this is given).",
)
@click.option(
    "--tps",
    default=None,
    type=float,
    help="Simulated tokens per second (default 0: no delay; a state directory in use keeps its setting unless this is given).",
)
@click.option(
    "-v", "--verbose", is_flag=True, help="Show info logs on the terminal (always in STATE/logs)."
)
def up(
    state_dir: Path | None,
    host: str,
    http_port: int,
    grpc_port: int,
    agent_port: int,
    enroll_port: int,
    replicas: int | None,
    ttft_ms: float | None,
    tps: float | None,
    verbose: bool,
) -> None:
    """Start a one-machine cluster and print the OpenAI base URL; Ctrl-C stops it all."""
    state = (state_dir or default_up_state_dir()).expanduser().absolute()
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    _setup_up_logging(state, verbose)
    click.echo(f"starting llmgw in {state} ...")
    opts = UpOptions(
        state_dir=state,
        host=host,
        http_port=http_port,
        grpc_port=grpc_port,
        agent_port=agent_port,
        enroll_port=enroll_port,
        replicas=replicas,
        ttft_ms=ttft_ms,
        tps=tps,
    )
    run_loop(run_up(opts, say=lambda line: click.echo(line)), process="up")
