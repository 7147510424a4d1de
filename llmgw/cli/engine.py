"""``llmgw engine``: engines built into llmgw, so a node needs nothing else to run them."""

from __future__ import annotations

import click

from llmgw.cli.common import reports_errors
from llmgw.engines import sim as sim_engine

__all__ = ["engine"]


@click.group()
def engine() -> None:
    """Built-in inference engines."""


@engine.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind (engines stay on loopback).",
)
@click.option(
    "--port", default=8000, show_default=True, type=int, help="Port to bind; 0 picks one."
)
@click.option("--model", default="llmgw-sim", show_default=True, help="The served model name.")
@click.option(
    "--seed",
    default=0,
    show_default=True,
    type=int,
    help="Default seed; a request's 'seed' overrides it.",
)
@click.option(
    "--ttft-ms",
    default=0.0,
    show_default=True,
    type=float,
    help="Time to first token, milliseconds.",
)
@click.option(
    "--tps",
    default=0.0,
    show_default=True,
    type=float,
    help="Tokens per second after the first; 0 = no delay.",
)
@click.option(
    "--max-tokens", default=32, show_default=True, type=int, help="Default max_tokens of a request."
)
@reports_errors
def sim(
    host: str, port: int, model: str, seed: int, ttft_ms: float, tps: float, max_tokens: int
) -> None:
    """A simulated OpenAI-compatible engine with deterministic output."""
    cfg = sim_engine.SimConfig(
        host=host,
        port=port,
        model=model,
        seed=seed,
        ttft_ms=ttft_ms,
        tps=tps,
        max_tokens=max_tokens,
    )
    sim_engine.run(cfg)
