"""An LlmgwError leaving any command is reported in one place (``llmgw.cli.common``): ``error:
MESSAGE`` on stderr, nothing on stdout (``--json`` too), the error's exit code; for a ctl, an
agent and a server command through ``llmgw``, and for groups and commands run on their own."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from llmgw.cli import COMMANDS, main
from llmgw.cli.common import Duration, ReportingCommand, ReportingGroup
from llmgw.errors import ConfigError, LlmgwError, NotFound


def test_a_ctl_command_error_is_one_line_on_stderr_and_nothing_on_stdout_with_json() -> None:
    for json_flag in ([], ["--json"]):
        out = CliRunner().invoke(
            main, ["ctl", "--server", "http://127.0.0.1:9", "--token", "t", *json_flag, "nodes"]
        )
        assert out.exit_code == 1
        assert out.stdout == ""
        assert out.stderr.startswith("error: cannot reach a control plane; tried:\n")
        assert isinstance(out.exception, SystemExit)


def test_an_agent_subcommand_error_keeps_its_exit_code(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LLMGW_JOIN_TOKEN", raising=False)
    args = ["agent", "join", "--node-id", "n1", "--enroll-url", "https://127.0.0.1:1"]
    out = CliRunner().invoke(main, [*args, "--ca-hash", "sha256:00"])
    assert out.exit_code == 2
    assert (out.stdout, out.stderr) == (
        "",
        "error: no join token: set LLMGW_JOIN_TOKEN or run in a terminal to be prompted; "
        "never pass it as an argument\n",
    )


def test_a_server_config_error_names_file_and_key(tmp_path: Path) -> None:
    cfg = tmp_path / "server.yaml"
    cfg.write_text("htp_listen: 127.0.0.1:8080\n")
    out = CliRunner().invoke(main, ["server", "--config", str(cfg)])
    assert out.exit_code == 2
    assert out.stdout == ""
    assert out.stderr.startswith(
        f"error: {cfg}: htp_listen: unknown key 'htp_listen'; did you mean 'http_listen'?"
    )
    assert out.stderr.count("\n") == 1


def _tree() -> ReportingGroup:
    """root -> sub (made by root.group()) -> fails; root -> broken (a group callback that fails)."""

    @click.group(cls=ReportingGroup)
    def root() -> None:
        pass

    @root.group()
    def sub() -> None:
        pass

    @sub.command()
    @click.option("--code", type=int, default=1)
    def fails(code: int) -> None:
        click.echo("partial output")
        error = ConfigError("bad key", key="k", file="f.yaml") if code == 2 else NotFound("gone")
        raise error

    @root.group(invoke_without_command=True)
    def broken() -> None:
        raise LlmgwError("the group itself failed; fix it")

    return root


def test_the_group_reports_errors_of_commands_and_groups_below_it() -> None:
    root = _tree()
    assert isinstance(root.commands["sub"], ReportingGroup)  # @group.group() keeps the class
    out = CliRunner().invoke(root, ["sub", "fails"])
    assert (out.exit_code, out.stdout, out.stderr) == (1, "partial output\n", "error: gone\n")
    out = CliRunner().invoke(root, ["sub", "fails", "--code", "2"])
    assert (out.exit_code, out.stderr) == (2, "error: f.yaml: k: bad key\n")
    out = CliRunner().invoke(root, ["broken"])
    assert (out.exit_code, out.stderr) == (1, "error: the group itself failed; fix it\n")
    # A sub-group run on its own reports the same way.
    out = CliRunner().invoke(root.commands["sub"], ["fails"])
    assert (out.exit_code, out.stderr) == (1, "error: gone\n")


def test_other_exceptions_are_not_swallowed() -> None:
    @click.group(cls=ReportingGroup)
    def root() -> None:
        pass

    @root.command()
    def crash() -> None:
        raise RuntimeError("a bug")

    out = CliRunner().invoke(root, ["crash"])
    assert isinstance(out.exception, RuntimeError)


def test_a_reporting_command_reports_on_its_own() -> None:
    @click.command(cls=ReportingCommand)
    def alone() -> None:
        raise ConfigError("no such thing; give another")

    out = CliRunner().invoke(alone, [])
    assert (out.exit_code, out.stdout, out.stderr) == (
        2,
        "",
        "error: no such thing; give another\n",
    )


def _groups(group: click.Group, path: str) -> list[tuple[str, click.Group]]:
    found = [(path, group)]
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found += _groups(command, f"{path} {name}")
    return found


def test_every_group_of_llmgw_reports_errors() -> None:
    """So that a group run on its own (tests, scripts) says what its commands say via llmgw."""
    groups = [("llmgw", main)]
    for name, lazy in COMMANDS.items():
        command = lazy.load()
        if isinstance(command, click.Group):
            groups += _groups(command, f"llmgw {name}")
    assert {path for path, _ in groups} >= {"llmgw ctl", "llmgw ctl cert", "llmgw agent"}
    assert [path for path, g in groups if not isinstance(g, ReportingGroup)] == []


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90.0), ("500ms", 0.5), ("5m", 300.0), ("2d", 172800.0), (7, 7.0)]
)
def test_duration_reads_the_one_syntax(text: object, seconds: float) -> None:
    assert Duration().convert(text, None, None) == seconds


def test_duration_refusals_say_what_is_accepted() -> None:
    with pytest.raises(click.BadParameter, match="a duration like 500ms, 30s, 5m, 2h or 30d"):
        Duration().convert("soon", None, None)
    with pytest.raises(click.BadParameter, match=r"must be at least 1s; got '500ms'"):
        Duration(minimum=1).convert("500ms", None, None)
    with pytest.raises(click.BadParameter, match="must be a whole number of seconds"):
        Duration(whole=True).convert("1.5", None, None)


def test_a_whole_duration_is_an_int() -> None:
    value = Duration(whole=True).convert("1h", None, None)
    assert value == 3600 and isinstance(value, int)


CTL = ["ctl", "--server", "http://127.0.0.1:9", "--token", "t"]


@pytest.mark.parametrize(
    "args",
    [
        [*CTL, "drain", "n1", "--timeout", "soon"],
        [*CTL, "update", "n1", "--version", "1.0", "--ttl", "90.5"],
        [*CTL, "engines", "install", "n1", "vllm", "1.0", "--url=x", "--sha256=0", "--timeout=1y"],
        [*CTL, "join-command", "--node", "n1", "--ttl", "-5m"],
        ["engine", "sim", "--join-timeout", "forever"],
    ],
)
def test_duration_options_refuse_before_doing_anything(args: list[str]) -> None:
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2, out.output
    assert "Invalid value for '--" in out.stderr
    assert "a duration like 500ms" in out.stderr or "whole number of seconds" in out.stderr
