"""``--json`` where users put it: after the subcommand (``ctl nodes --json``) as before it
(``ctl --json nodes``), on every ctl command, the offline ones included."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.testing import CliRunner

from tests.unit.cli.ctl.fakeapi import FakeAPI


def _leaves(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = []
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            found.extend(_leaves(command, (*path, name)))
        found.append((*path, name))
    return found


def test_every_ctl_command_takes_json_after_its_name() -> None:
    from llmgw.cli.ctl import ctl

    lacking = []
    for path in _leaves(ctl):
        command: click.Command = ctl
        for name in path:
            assert isinstance(command, click.Group)
            command = command.commands[name]
        if not any("--json" in p.opts for p in command.params):
            lacking.append(" ".join(path))
    assert lacking == []


def test_json_after_the_subcommand_prints_what_the_group_option_prints() -> None:
    nodes = [{"id": "gpu-1", "state": "approved", "health": "healthy", "degraded": []}]
    api = FakeAPI(
        lambda method, path, body: {"version": "0.1.0"} if path == "/api/status" else nodes
    )
    after = api.ctl("nodes", "--json")
    before = api.ctl("--json", "nodes")
    assert after.exit_code == 0, after.output
    assert json.loads(after.output) == nodes
    assert after.output == before.output


def test_offline_commands_print_json_too(tmp_path: Path) -> None:
    from llmgw.cli import main

    out = CliRunner().invoke(
        main, ["ctl", "cert", "init-ca", "--dir", str(tmp_path / "pki"), "--json"]
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["directory"] == str(tmp_path / "pki")
    assert data["ca_hash"].startswith("sha256:")
