"""The one engine table: its names, its capabilities, and that each capability is one the
builder really has (and is enforced where it is not)."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest

from llmgw.cli.engine import engine as engine_group
from llmgw.engines import registry
from llmgw.engines.launch import build_command, dials_workers, engine_module
from llmgw.engines.registry import (
    AVAILABLE_ENGINES,
    ENGINES,
    engine_names,
    get_engine,
    installable_engines,
    multi_node_engines,
)
from llmgw.engines.spec import EngineSpec
from llmgw.errors import EngineError


def test_engine_names_sim_first() -> None:
    assert engine_names() == AVAILABLE_ENGINES == ("sim", "vllm", "sglang", "llamacpp")


@pytest.mark.parametrize("engine", AVAILABLE_ENGINES)
def test_each_row_names_its_own_builder(engine: str) -> None:
    module = engine_module(engine)
    assert module.NAME == engine
    assert callable(module.build) and callable(module.prefix)
    assert "model_path" not in module.PARAMS or module.PARAMS["model_path"].flag == ""


def test_capabilities() -> None:
    assert installable_engines() == ("llamacpp", "sglang", "vllm")
    assert multi_node_engines() == ("llamacpp", "sglang", "sim", "vllm")
    assert [name for name, e in ENGINES.items() if e.builtin] == ["sim"]
    # Only llama.cpp's rank 0 dials its workers (rpc-server endpoints); the others' workers
    # dial rank 0. The port is the scheduler's, from the nodes' multinode_ports, not theirs.
    assert {name: dials_workers(name) for name in ENGINES} == {
        "sim": False,
        "vllm": False,
        "sglang": False,
        "llamacpp": True,
    }
    assert {name: e.program_setting for name, e in ENGINES.items()} == {
        "sim": None,
        "vllm": "bin",
        "sglang": "python",
        "llamacpp": "bin",
    }
    # Discovery looks on PATH for llama-server and vllm, never for sglang's python3.
    assert {name: engine_module(name).PROGRAM for name, e in ENGINES.items() if e.on_path} == {
        "vllm": "vllm",
        "llamacpp": "llama-server",
    }
    version, help_ = ("--version",), ("--help",)
    assert {name: e.probes for name, e in ENGINES.items()} == {
        "sim": (version, help_),
        "vllm": (version, help_),
        "sglang": (("-c", "import sglang, sys; print(sglang.__version__)"),),
        "llamacpp": (version, help_),
    }


@pytest.mark.parametrize("engine", multi_node_engines())
def test_multi_node_engines_build_both_ranks(engine: str) -> None:
    """multi_node is true only where the builder has the form: rank 0 serves, a worker
    does not."""
    base = EngineSpec(
        engine=engine,
        model="m",
        port=40000,
        source="/models/m.gguf",
        gpus=("GPU-a",),
        nodes=2,
        dist_init_addr="10.0.0.1:29500",
        peers=("10.0.0.2:50052",),
    )
    assert build_command(base).serves
    assert not build_command(replace(base, rank=1)).serves


def test_unknown_engine_names_the_known_ones() -> None:
    with pytest.raises(EngineError) as info:
        get_engine("tgi")
    assert "'tgi'" in str(info.value)
    for name in AVAILABLE_ENGINES:
        assert name in str(info.value)


def test_an_engine_without_a_multi_node_form_is_refused_several_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    single = {
        name: replace(e, multi_node=False) if name == "sim" else e for name, e in ENGINES.items()
    }
    monkeypatch.setattr(registry, "ENGINES", MappingProxyType(single))
    assert "sim" not in multi_node_engines()
    spec = EngineSpec(engine="sim", model="m", port=40000, nodes=2, dist_init_addr="h:1")
    with pytest.raises(EngineError, match="engine sim has no multi-node form"):
        build_command(spec)
    assert build_command(replace(spec, nodes=1)).serves  # one node is still fine


@pytest.mark.parametrize("name", [n for n, e in ENGINES.items() if e.builtin])
def test_a_built_in_engine_is_a_command_of_llmgw_engine(name: str) -> None:
    """A built-in engine's builder runs ``llmgw engine NAME``: the CLI must have it."""
    assert engine_module(name).prefix("/opt/llmgw") == ["/opt/llmgw", "engine", name]
    assert name in engine_group.commands


def test_llmgw_engine_has_only_built_in_engines() -> None:
    assert set(engine_group.commands) == {n for n, e in ENGINES.items() if e.builtin}


@pytest.mark.parametrize("name", installable_engines())
def test_an_installable_engine_says_what_its_archive_holds(name: str) -> None:
    """An install locates the program by ``archive_program`` and refuses naming
    ``archive_holds``: a row without them could never be installed."""
    engine = get_engine(name)
    assert engine.archive_program and all(engine.archive_program)
    assert engine.archive_holds
