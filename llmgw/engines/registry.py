"""The one table of the engines llmgw can run: name -> builder module and capabilities.

Like uvicorn's protocol table, each entry names the module that builds the engine's command
by its dotted path, imported on first use (so the builders can import
:mod:`llmgw.engines.spec` without a cycle through here). Everything that needs the engine
list reads it here: the CLI's choices, the catalog's validation, the launcher, the
scheduler's rendezvous (who dials whom), engine installs, the agent's configuration and its
discovery of the engines on a node.

Adding an engine: write its builder module (see :class:`~llmgw.engines.spec.EngineModule`)
and add a row to :data:`ENGINES`; set a capability only when the builder implements it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

from llmgw.engines.spec import EngineModule
from llmgw.errors import EngineError

__all__ = [
    "AVAILABLE_ENGINES",
    "ENGINES",
    "Engine",
    "engine_names",
    "get_engine",
    "installable_engines",
    "multi_node_engines",
]


@dataclass(frozen=True)
class Engine:
    """One engine llmgw can run, and what it can do.

    ``multi_node``: the builder has a form that spreads one replica over several nodes (the
    catalog refuses ``nodes`` > 1 and the launcher a multi-node spec otherwise).
    ``dials_workers``: rank 0 dials its workers (llama.cpp's ``rpc-server``): each worker
    binds an endpoint on its own node, at the replica's port, and rank 0 is started once
    they are up. False: the workers dial rank 0's ``dist_init_addr``, which rank 0 binds.
    Either way the scheduler picks the replica's one port inside the ``multinode_ports`` of
    all its nodes (:mod:`llmgw.contracts.ports`).
    ``builtin``: the engine is this llmgw (``llmgw engine sim``): nothing to install or
    configure, no weights and no GPUs needed. ``installable``: ``llmgw ctl engines install``
    can put it on a node. ``program_setting``: the agent.yaml key under ``engines.NAME``
    that names its program (None: it takes no settings).

    How the agent's discovery finds the engine when agent.yaml names no program:
    ``on_path``: it looks for the builder's ``PROGRAM`` on PATH (False for sglang, whose
    program is the Python that has SGLang: the first python3 on PATH rarely is; for sim, built
    in). Then it runs the program with each of ``probes`` in turn until one exits 0; the
    first probe's output is the version.

    ``archive_program``: for an installable engine, the path an install archive holds the
    program at, matched against the end of each member's path (``("bin", "python")``: a
    Python environment's interpreter); ``archive_holds`` says it in words for a refusal.
    """

    name: str
    builder: str
    multi_node: bool
    dials_workers: bool = False
    builtin: bool = False
    installable: bool = False
    program_setting: str | None = None
    on_path: bool = False
    probes: tuple[tuple[str, ...], ...] = (("--version",), ("--help",))
    archive_program: tuple[str, ...] = ()
    archive_holds: str = ""

    def module(self) -> EngineModule:
        """The module that builds this engine's command."""
        return cast(EngineModule, importlib.import_module(self.builder))


ENGINES: Mapping[str, Engine] = MappingProxyType(
    {
        engine.name: engine
        for engine in (
            Engine("sim", "llmgw.engines.sim", multi_node=True, builtin=True),
            Engine(
                "vllm",
                "llmgw.engines.vllm",
                multi_node=True,
                installable=True,
                program_setting="bin",
                on_path=True,
                archive_program=("vllm",),
                archive_holds="a file named 'vllm'",
            ),
            Engine(
                "sglang",
                "llmgw.engines.sglang",
                multi_node=True,
                installable=True,
                program_setting="python",
                # Importing sglang is the check: the Python may run without having it.
                probes=(("-c", "import sglang, sys; print(sglang.__version__)"),),
                archive_program=("bin", "python"),
                archive_holds="a Python environment's bin/python (with sglang installed in it)",
            ),
            Engine(
                "llamacpp",
                "llmgw.engines.llamacpp",
                multi_node=True,
                dials_workers=True,
                installable=True,
                program_setting="bin",
                on_path=True,
                archive_program=("llama-server",),
                archive_holds="a file named 'llama-server'",
            ),
        )
    }
)
"""Every engine llmgw can run, ``sim`` (built in) first. The others must be on the node,
which discovery checks."""


AVAILABLE_ENGINES: tuple[str, ...] = tuple(ENGINES)
"""The names of :data:`ENGINES`, ``sim`` first: the choices the CLI offers."""


def engine_names() -> tuple[str, ...]:
    """The known engine names, ``sim`` (built in) first."""
    return AVAILABLE_ENGINES


def installable_engines() -> tuple[str, ...]:
    """The engines an install order may name, sorted."""
    return tuple(sorted(name for name, engine in ENGINES.items() if engine.installable))


def multi_node_engines() -> tuple[str, ...]:
    """The engines with a multi-node form, sorted."""
    return tuple(sorted(name for name, engine in ENGINES.items() if engine.multi_node))


def get_engine(name: str) -> Engine:
    """The engine called ``name``; EngineError names the known ones."""
    engine = ENGINES.get(name)
    if engine is None:
        raise EngineError(
            f"engine {name!r} is not one llmgw can run (it knows "
            f"{', '.join(ENGINES)}); deploy the model with one of those engines"
        )
    return engine
