"""The command a banner or a hint prints for llmgw itself: what the user can type in the shell
they started it from (``make run`` starts ``.venv/bin/llmgw``, which is not on the PATH)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from llmgw.cli import common
from llmgw.cli.common import typed_command


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    program = tmp_path / "repo" / ".venv" / "bin" / "llmgw"
    program.parent.mkdir(parents=True)
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.chdir(tmp_path / "repo")
    return program


def test_make_runs_llmgw_is_typed_as_its_path(venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [".venv/bin/llmgw", "up"])
    monkeypatch.setattr(common.shutil, "which", lambda _name: None)
    assert typed_command() == ".venv/bin/llmgw"


def test_the_llmgw_on_the_path_is_typed_as_llmgw(
    venv: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "argv", [str(venv), "up"])
    monkeypatch.setattr(common.shutil, "which", lambda _name: str(venv))
    assert typed_command() == "llmgw"


def test_another_llmgw_on_the_path_is_not_this_one(
    venv: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "argv", [".venv/bin/llmgw", "up"])
    monkeypatch.setattr(common.shutil, "which", lambda _name: "/usr/bin/llmgw")
    assert typed_command() == ".venv/bin/llmgw"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # started from elsewhere: the whole path
    monkeypatch.setattr(sys, "argv", [str(venv), "up"])
    assert typed_command() == str(venv)


def test_python_dash_m_llmgw(venv: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/x/llmgw/__main__.py", "up"])
    monkeypatch.setattr(sys, "executable", str(venv.parent / "python"))
    assert typed_command() == ".venv/bin/python -m llmgw"
