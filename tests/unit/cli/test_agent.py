"""The ``llmgw agent`` group (llmgw.cli.agent): the root helper's commands load nothing of
the agent or the control plane; the node commands load when named, and are listed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from llmgw.cli import agent as agent_cli
from llmgw.cli import main
from llmgw.contracts.paths import DEFAULT_AGENT_CONFIG

# Runs llmgw in a fresh interpreter and prints the llmgw modules it loaded, after the output.
PROBE = """
import json, sys
from llmgw.cli import main
try:
    main(sys.argv[1:], prog_name="llmgw")
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "modules": sorted(m for m in sys.modules if m.startswith("llmgw"))}))
"""

FORBIDDEN = ("llmgw.agent", "llmgw.server", "llmgw.engines", "llmgw.sim", "llmgw.http")


def loaded_by(*args: str) -> tuple[int, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.rstrip("\n").rpartition("\n")[2])
    return found["code"], found["modules"]


def forbidden_in(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]


@pytest.mark.parametrize("command", ["update-apply", "update-trust"])
def test_the_root_commands_load_nothing_of_the_agent_or_server(command: str) -> None:
    code, modules = loaded_by("agent", command, "--help")
    assert code == 0
    assert "llmgw.updater.apply" in modules and "llmgw.updater.trust" in modules
    assert forbidden_in(modules) == []


def test_a_root_command_that_runs_loads_nothing_more(tmp_path: Path) -> None:
    args = ["--spool", str(tmp_path / "spool"), "--state", str(tmp_path / "state")]
    code, modules = loaded_by("agent", "update-apply", *args, "--trust", str(tmp_path / "t"))
    assert code == 0  # no spool: nothing to do
    assert forbidden_in(modules) == []


def test_the_probe_sees_the_agent_when_a_command_loads_it() -> None:
    code, modules = loaded_by("agent", "join", "--help")
    assert code == 0
    assert "llmgw.agent.join" in modules and "llmgw.agent.join" in forbidden_in(modules)


def test_the_default_config_is_the_agents() -> None:
    (option,) = [p for p in agent_cli.agent.params if p.name == "config_path"]
    assert option.default == DEFAULT_AGENT_CONFIG


def test_agent_help_lists_the_node_commands_without_loading_the_agent() -> None:
    code, modules = loaded_by("agent", "--help")
    assert code == 0
    assert "llmgw.cli.agent.join" not in modules and "llmgw.cli.agent.docker_proxy" not in modules
    assert "llmgw.cli.agent.facts" not in modules
    assert forbidden_in(modules) == []


def test_the_node_commands_are_listed_and_load_when_named() -> None:
    group = agent_cli.agent
    names = ["docker-proxy", "inventory", "join", "render-facts", "update-apply", "update-trust"]
    assert group.list_commands(click.Context(group)) == names
    out = CliRunner().invoke(main, ["agent", "--help"], prog_name="llmgw")
    assert out.exit_code == 0
    rows = out.output.split("Commands:\n", 1)[1].splitlines()
    assert [row.split()[0] for row in rows if row.startswith("  ")] == names
    for name in ("join", "docker-proxy", "render-facts", "inventory"):
        out = CliRunner().invoke(main, ["agent", name, "--help"], prog_name="llmgw")
        assert out.exit_code == 0 and out.output.startswith(f"Usage: llmgw agent {name} ")


def _agent_yaml(tmp_path: Path, extra: str = "") -> Path:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("server: cp-1:7443\nnode_id: gpu-01\n" + extra)
    return cfg


def print_ports(cfg: Path) -> Result:
    """``llmgw agent --config CFG --check --print multinode_ports``, as the installer runs it."""
    return CliRunner().invoke(
        main, ["agent", "--config", str(cfg), "--check", "--print", "multinode_ports"]
    )


def test_check_prints_the_default_multinode_ports_alone(tmp_path: Path) -> None:
    cfg = _agent_yaml(tmp_path)
    out = print_ports(cfg)
    assert out.exit_code == 0, out.output
    # Only the range, as install-agent.sh reads it: no "ok" line, nothing on stderr.
    assert (out.stdout, out.stderr) == ("29500-29999\n", "")


def test_check_prints_the_configured_multinode_ports(tmp_path: Path) -> None:
    cfg = _agent_yaml(tmp_path, 'multinode_ports: " 40000-40099"\n')
    out = CliRunner().invoke(
        main, ["agent", "--config", str(cfg), "--print", "multinode_ports", "--check"]
    )
    assert out.exit_code == 0, out.output
    assert out.stdout == "40000-40099\n"


def test_check_without_print_says_ok_as_before(tmp_path: Path) -> None:
    cfg = _agent_yaml(tmp_path, "multinode_ports: 40000-40099\n")
    out = CliRunner().invoke(main, ["agent", "--config", str(cfg), "--check"])
    assert out.exit_code == 0, out.output
    assert out.stdout == f"{cfg}: ok (node gpu-01, servers cp-1:7443)\n"


def test_print_validates_the_whole_file_first(tmp_path: Path) -> None:
    # A broken key elsewhere: nothing on stdout, so a script never opens a stale range.
    cfg = _agent_yaml(tmp_path, "multinode_ports: 40000-40099\nruntime: podman\n")
    out = print_ports(cfg)
    assert out.exit_code == 2
    assert out.stdout == ""
    assert out.stderr.startswith(f"error: {cfg}: runtime: unknown runtime 'podman'")


def test_print_refuses_a_bad_range_naming_key_file_and_fix(tmp_path: Path) -> None:
    cfg = _agent_yaml(tmp_path, "multinode_ports: 29999-29500\n")
    out = print_ports(cfg)
    assert out.exit_code == 2
    assert out.stdout == ""
    assert out.stderr == (
        f"error: {cfg}: multinode_ports: 29999-29500 is reversed: it starts above where it "
        "ends; write the lower port first (29500-29999)\n"
    )


def test_print_goes_with_check_only(tmp_path: Path) -> None:
    cfg = _agent_yaml(tmp_path)
    out = CliRunner().invoke(main, ["agent", "--config", str(cfg), "--print", "multinode_ports"])
    assert out.exit_code == 2
    assert out.stdout == ""
    assert "--print goes with --check: llmgw agent --check --print KEY" in out.stderr


def test_print_knows_only_multinode_ports(tmp_path: Path) -> None:
    cfg = _agent_yaml(tmp_path)
    out = CliRunner().invoke(main, ["agent", "--config", str(cfg), "--check", "--print", "node_id"])
    assert out.exit_code == 2
    assert out.stdout == ""
    assert "'node_id' is not 'multinode_ports'" in out.stderr
