"""What a user sees at the CLI edge: version, config refusals, agent start-up errors."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from llmgw import __version__
from llmgw.cli import main


def test_version_last_word_is_the_version() -> None:
    out = CliRunner().invoke(main, ["--version"])
    assert out.exit_code == 0
    assert out.output == f"llmgw {__version__}\n"


def test_agent_check_accepts_a_valid_file(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("server: cp-1:7443\nnode_id: gpu-01\n")
    out = CliRunner().invoke(main, ["agent", "--config", str(cfg), "--check"])
    assert out.exit_code == 0, out.output
    assert out.output == f"{cfg}: ok (node gpu-01, servers cp-1:7443)\n"


def test_agent_refuses_an_adapter_in_two_fabrics_naming_key_and_file(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        "server: cp-1\n"
        "fabrics:\n"
        "  - {name: ib-a, hcas: [mlx5_0, mlx5_1]}\n"
        "  - {name: ib-b, hcas: [mlx5_1, mlx5_2]}\n"
    )
    out = CliRunner().invoke(main, ["agent", "--config", str(cfg)])
    assert out.exit_code == 2
    assert out.stderr == (
        f"error: {cfg}: fabrics[1].hcas[0]: adapter mlx5_1 is listed under fabrics ib-a and "
        "ib-b; an adapter belongs to one fabric\n"
    )


def test_agent_typo_gets_a_suggestion(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("sever: cp-1\n")
    out = CliRunner().invoke(main, ["agent", "--config", str(cfg), "--check"])
    assert out.exit_code == 2
    assert "unknown key 'sever'; did you mean 'server'?" in out.stderr


def test_agent_without_identity_says_to_join_first(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(
        f"server: 127.0.0.1:1\nnode_id: n1\nstate_dir: {tmp_path / 'state'}\nlisten: 127.0.0.1:0\n"
    )
    out = CliRunner().invoke(main, ["agent", "--config", str(cfg)])
    assert out.exit_code == 1
    assert (
        f"the node's cert {tmp_path / 'state' / 'node.crt'} does not exist; join the node first"
        in out.stderr
    )


def test_missing_agent_config_is_named(tmp_path: Path) -> None:
    out = CliRunner().invoke(main, ["agent", "--config", str(tmp_path / "nope.yaml"), "--check"])
    assert out.exit_code == 2
    assert str(tmp_path / "nope.yaml") in out.stderr and "no such file" in out.stderr
