"""``llmgw up``: the command's defaults are UpOptions' own, and its options reach the cluster."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.cli import up as up_cli
from llmgw.cli.local_cluster import UpOptions, server_config


def started_with(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> UpOptions:
    started: list[UpOptions] = []

    async def run_up(opts: UpOptions, say: Callable[[str], None]) -> None:
        started.append(opts)

    monkeypatch.setattr(up_cli, "run_up", run_up)
    monkeypatch.setattr(up_cli, "_setup_up_logging", lambda state_dir, verbose: None)
    result = CliRunner().invoke(up_cli.up, args)
    assert result.exit_code == 0, result.output
    (opts,) = started
    return opts


def test_up_without_options_starts_the_default_cluster(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    opts = started_with(monkeypatch, ["--state-dir", str(tmp_path)])
    assert opts == UpOptions(state_dir=tmp_path)


def test_up_options_reach_the_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = ["--state-dir", str(tmp_path), "--port", "0", "--enroll-port", "0", "--replicas", "2"]
    opts = started_with(monkeypatch, args)
    assert opts == UpOptions(state_dir=tmp_path, http_port=0, enroll_port=0, replicas=2)


def test_up_keeps_its_control_plane_on_loopback(tmp_path: Path) -> None:
    cfg = server_config(UpOptions(state_dir=tmp_path))
    for listen in (cfg.http_listen, cfg.grpc_listen, cfg.enroll_listen):
        assert listen.startswith("127.0.0.1:"), listen
    assert not cfg.cleartext_exposed  # no warning, no notice on the login page
    # Shared on purpose (--host 0.0.0.0) without TLS: the control plane says so.
    assert server_config(UpOptions(state_dir=tmp_path, host="0.0.0.0")).cleartext_exposed
