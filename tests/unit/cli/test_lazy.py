"""llmgw.cli.common.LazyGroup: the ``llmgw`` group imports its subcommands on first use
(``--version`` and ``--help`` load none of the heavy libraries), and so does ``llmgw agent``
its node commands; every command still answers under its name, and ``--help`` lists the same
lines before and after the commands load."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from llmgw import __version__
from llmgw.cli import COMMANDS, main
from llmgw.cli.agent import NODE_COMMANDS, agent
from llmgw.cli.common import LazyCommand, LazyGroup

HEAVY = ("grpc", "aiohttp", "cryptography")

# Runs the CLI in a fresh interpreter and prints what it imported, as JSON, after the output.
PROBE = """
import json, sys
from llmgw.cli import main
try:
    main(sys.argv[1:], prog_name="llmgw")
except SystemExit as exit:
    code = exit.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def fresh_run(*args: str) -> tuple[str, int, set[str]]:
    """(output before the probe's line, exit code, modules imported) of llmgw ARGS."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    output, _, probe = result.stdout.rstrip("\n").rpartition("\n")
    found = json.loads(probe)
    return output, found["code"], set(found["modules"])


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in HEAVY)


@pytest.mark.parametrize("args", [("--version",), ("-V",), ("--help",), ("-h",)])
def test_version_and_help_import_no_heavy_library(args: tuple[str, ...]) -> None:
    output, code, modules = fresh_run(*args)
    assert code == 0
    assert heavy_in(modules) == []
    # Only the error reporting every command shares (click and llmgw.errors), no command.
    assert [m for m in modules if m.startswith("llmgw.cli.")] == ["llmgw.cli.common"]
    if args[0] in ("--version", "-V"):
        assert output == f"llmgw {__version__}"
    else:
        assert output.startswith("Usage: llmgw [OPTIONS] COMMAND [ARGS]...")


def test_a_subcommand_imports_its_module_only() -> None:
    """The probe sees what loading one command pulls in: its own module, not the others'."""
    output, code, modules = fresh_run("engine", "--help")
    assert code == 0 and "Built-in inference engines." in output
    assert "llmgw.cli.engine" in modules
    assert "llmgw.cli.agent" not in modules and "llmgw.cli.server" not in modules


LAZY_GROUPS = [(main, COMMANDS), (agent, NODE_COMMANDS)]


@pytest.mark.parametrize(("group", "lazy_commands"), LAZY_GROUPS, ids=["llmgw", "agent"])
def test_every_command_loads_under_its_name_with_the_recorded_summary(
    group: click.Group, lazy_commands: dict[str, LazyCommand]
) -> None:
    """The recorded summaries are the commands' own help: --help lists what each would say."""
    ctx = click.Context(group)
    assert set(lazy_commands) <= set(group.list_commands(ctx))
    for name, lazy in lazy_commands.items():
        command = lazy.load()
        assert command.help is not None
        first = " ".join(command.help.split("\n\n")[0].split())
        assert first == lazy.summary, f"{name}: summary out of date"
        assert group.get_command(ctx, name) is command
        for limit in (20, 45, 200):
            recorded = click.Command(name, help=lazy.summary).get_short_help_str(limit)
            assert recorded == command.get_short_help_str(limit)


def test_help_lists_the_same_lines_before_and_after_the_commands_load() -> None:
    """Listing from summaries (nothing loaded) equals click's listing from the commands."""
    cold = LazyGroup("llmgw", lazy=COMMANDS)
    before = CliRunner().invoke(cold, ["--help"])
    ctx = click.Context(cold)
    for name in COMMANDS:
        cold.get_command(ctx, name)
    assert set(cold.commands) == set(COMMANDS)
    after = CliRunner().invoke(cold, ["--help"])
    assert before.exit_code == after.exit_code == 0
    assert before.output == after.output
    eager = click.Group("llmgw", commands={n: c.load() for n, c in COMMANDS.items()})
    assert CliRunner().invoke(eager, ["--help"]).output == after.output


def test_agent_help_lists_the_same_lines_before_and_after_its_node_commands_load() -> None:
    eager = {n: c for n, c in agent.commands.items() if n not in NODE_COMMANDS}
    cold = LazyGroup("agent", lazy=NODE_COMMANDS, commands=eager, params=agent.params)
    before = CliRunner().invoke(cold, ["--help"])
    ctx = click.Context(cold)
    for name in NODE_COMMANDS:
        cold.get_command(ctx, name)
    assert set(cold.commands) == {*eager, *NODE_COMMANDS}
    after = CliRunner().invoke(cold, ["--help"])
    assert before.exit_code == after.exit_code == 0
    assert before.output == after.output
    assert "join" in before.output and "docker-proxy" in before.output


def test_subcommands_of_the_loaded_groups_work_through_main() -> None:
    """Whatever the cli/agent/ and cli/ctl/ packages define is reached through the lazily
    loaded group."""
    for name in ("agent", "ctl"):
        group = COMMANDS[name].load()
        assert isinstance(group, click.Group)
        for sub in group.list_commands(click.Context(group)):
            out = CliRunner().invoke(main, [name, sub, "--help"], prog_name="llmgw")
            assert out.exit_code == 0, (name, sub, out.output)
            assert out.output.startswith(f"Usage: llmgw {name} {sub} ")


def test_unknown_command_is_refused_without_loading_anything() -> None:
    output = subprocess.run(
        [sys.executable, "-c", PROBE, "bogus"], capture_output=True, text=True, timeout=60
    )
    assert "No such command 'bogus'." in output.stderr
    found = json.loads(output.stdout.strip().splitlines()[-1])
    assert found["code"] == 2
    assert heavy_in(set(found["modules"])) == []


def test_a_lazy_entry_that_is_not_a_command_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"^'up' is not a click command$"):
        LazyCommand(lambda: "up", "x").load()
