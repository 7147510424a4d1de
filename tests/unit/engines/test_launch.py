"""The command line the agent builds to start an engine."""

from __future__ import annotations

import sys

import pytest

from llmgw.engines import launch
from llmgw.engines.launch import build_argv, self_argv
from llmgw.engines.registry import AVAILABLE_ENGINES
from llmgw.errors import EngineError


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def test_sim_argv_binds_loopback_port_and_model() -> None:
    argv = build_argv("sim", model="m-1", port=40123, params={})
    assert argv[: len(self_argv())] == self_argv()
    assert argv[len(self_argv()) : len(self_argv()) + 2] == ["engine", "sim"]
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--port") == "40123"
    assert _flag(argv, "--model") == "m-1"
    assert all(isinstance(a, str) for a in argv)


def test_sim_params_map_to_flags() -> None:
    argv = build_argv(
        "sim",
        model="m",
        port=1,
        params={"seed": "7", "ttft_ms": "12.5", "tps": "100", "max_tokens": "16"},
    )
    assert _flag(argv, "--seed") == "7"
    assert _flag(argv, "--ttft-ms") == "12.5"
    assert _flag(argv, "--tps") == "100"
    assert _flag(argv, "--max-tokens") == "16"


def test_extra_args_come_last() -> None:
    argv = build_argv("sim", model="m", port=1, params={"seed": "1"}, extra_args=("--x", "y"))
    assert argv[-2:] == ["--x", "y"]


def test_unknown_param_names_it() -> None:
    with pytest.raises(EngineError) as info:
        build_argv("sim", model="m", port=1, params={"temperature": "0.5"})
    message = str(info.value)
    assert "temperature" in message
    for known in ("seed", "ttft_ms", "tps", "max_tokens"):
        assert known in message


@pytest.mark.parametrize(
    ("key", "value"),
    [("seed", "abc"), ("seed", "1.5"), ("max_tokens", "many"), ("tps", "fast"), ("ttft_ms", "")],
)
def test_badly_typed_param_names_it(key: str, value: str) -> None:
    with pytest.raises(EngineError) as info:
        build_argv("sim", model="m", port=1, params={key: value})
    assert key in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("engine", ["tgi", "", "SIM"])
def test_unavailable_engine_names_available_ones(engine: str) -> None:
    with pytest.raises(EngineError) as info:
        build_argv(engine, model="m", port=1, params={})
    message = str(info.value)
    assert repr(engine) in message
    for name in AVAILABLE_ENGINES:
        assert name in message


def test_self_argv_runs_this_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(sys, "frozen", raising=False)
    assert self_argv() == [sys.executable, "-m", "llmgw"]


def test_self_argv_frozen_is_the_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", "/opt/llmgw/llmgw")
    assert self_argv() == ["/opt/llmgw/llmgw"]
    argv = launch.build_argv("sim", model="m", port=5, params={})
    assert argv[:3] == ["/opt/llmgw/llmgw", "engine", "sim"]
