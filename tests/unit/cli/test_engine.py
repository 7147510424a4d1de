"""``llmgw engine sim``: the command's defaults are the engine's own."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from llmgw.cli import engine as engine_cli
from llmgw.sim.config import SimConfig


def test_sim_without_options_runs_the_engines_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[SimConfig] = []
    monkeypatch.setattr(engine_cli, "run", started.append)
    result = CliRunner().invoke(engine_cli.engine, ["sim"])
    assert result.exit_code == 0, result.output
    assert started == [SimConfig()]


def test_sim_options_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[SimConfig] = []
    monkeypatch.setattr(engine_cli, "run", started.append)
    args = ["sim", "--port", "0", "--model", "m", "--join-timeout", "90", "--tps", "5"]
    result = CliRunner().invoke(engine_cli.engine, args)
    assert result.exit_code == 0, result.output
    assert started == [SimConfig(port=0, model="m", join_timeout_s=90.0, tps=5.0)]
