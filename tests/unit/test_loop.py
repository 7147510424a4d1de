"""llmgw.loop: which event loop a process runs, LLMGW_EVENT_LOOP, the start-up line, and that
every long-running process goes through it."""

from __future__ import annotations

import ast
import asyncio
import logging
import sys
from pathlib import Path

import pytest

from llmgw import loop
from llmgw.errors import ConfigError
from tests.ci import unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def uvloop_installed() -> None:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        unavailable("uvloop is not installed; pip install uvloop (a dependency on Linux)")


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError


async def _running_loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_chosen_where_it_is_installed(
    uvloop_installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(loop.ENV, raising=False)
    for setting in (None, "", "auto", "uvloop", " UVLoop "):
        chosen = loop.choose(setting)
        assert chosen.name == "uvloop", setting
        assert chosen.factory is not None
    assert loop.run(_running_loop_module(), process="test").startswith("uvloop")


def test_asyncio_when_asked_for(uvloop_installed: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(loop.ENV, "asyncio")
    chosen = loop.choose()
    assert (chosen.name, chosen.factory, chosen.reason) == (
        "asyncio",
        None,
        "LLMGW_EVENT_LOOP=asyncio",
    )
    assert loop.run(_running_loop_module(), process="test").startswith("asyncio")


def test_asyncio_when_uvloop_is_missing_unless_uvloop_is_asked_for(no_uvloop: None) -> None:
    chosen = loop.choose("auto")
    assert (chosen.name, chosen.reason) == ("asyncio", "uvloop is not installed")
    with pytest.raises(ConfigError) as err:
        loop.choose("uvloop")
    assert str(err.value).startswith(
        "LLMGW_EVENT_LOOP: uvloop is asked for but cannot be imported ("
    )
    assert str(err.value).endswith(
        "); install it ('pip install uvloop', Linux and macOS only), or unset the variable"
    )


def test_an_unknown_setting_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError) as err:
        loop.choose("trio")
    assert str(err.value) == (
        "LLMGW_EVENT_LOOP: unknown event loop 'trio'; set it to one of auto, uvloop, asyncio "
        "(asyncio to debug with asyncio's own loop), or unset it"
    )
    assert err.value.exit_code == 2


def test_a_refused_setting_leaves_no_coroutine_unawaited(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.raises(ConfigError):
        loop.run(_running_loop_module(), process="test", setting="trio")
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


def test_the_start_up_line_names_the_process_and_the_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="llmgw.loop"):
        loop.run(_running_loop_module(), process="agent", setting="asyncio")
    (line,) = [r for r in caplog.records if r.name == "llmgw.loop"]
    assert line.getMessage() == "event loop: asyncio"
    fields = line.__dict__["fields"]
    assert fields["process"] == "agent" and fields["loop"] == "asyncio"
    assert fields["version"] and fields["reason"] == "LLMGW_EVENT_LOOP=asyncio"


def test_no_process_runs_asyncio_run_itself() -> None:
    # Every long-running process (server, up, agent, the sim engine, the Docker proxy) goes
    # through llmgw.loop.run, so that each runs on uvloop and says so.
    found = []
    for path in sorted((ROOT / "llmgw").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("run", "Runner", "new_event_loop")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "asyncio"
                and path.name != "loop.py"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"use llmgw.loop.run instead of asyncio's: {found}"
    callers = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "llmgw").rglob("*.py")
        if "run_loop(" in path.read_text()
    }
    assert callers == {
        "llmgw/cli/server.py",
        "llmgw/cli/up.py",
        "llmgw/cli/agent/docker_proxy.py",
        "llmgw/agent/service.py",
        "llmgw/sim/server.py",
    }
