"""Build the command that starts an engine for one shard: its argv, its environment, and
whether it serves the OpenAI API (rank 0) or only joins a multi-node replica (a worker).

One module per engine (``vllm``, ``sglang``, ``llamacpp``; the built-in ``sim`` is here),
chosen through :data:`_BUILDERS`. Engines listen on 127.0.0.1 only; the one exception is
the rendezvous of a multi-node replica (``dist_init_addr``, or llama.cpp's RPC workers),
which the other nodes must reach. GPUs are handed over in ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, cast

from llmgw.errors import EngineError

__all__ = [
    "AVAILABLE_ENGINES",
    "LOOPBACK",
    "MODEL_PATH",
    "EngineCommand",
    "EngineModule",
    "EngineSpec",
    "Param",
    "build_argv",
    "build_command",
    "check_params",
    "engine_module",
    "gpu_env",
    "param_flags",
    "self_argv",
    "split_hostport",
    "weights",
    "worker_port_base",
]

LOOPBACK = "127.0.0.1"
"""Where every engine's HTTP server listens; the agent's data plane is the only way in."""

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class EngineSpec:
    """What one shard runs: the engine, the model it serves under its llmgw name, and where.

    ``source`` is the weights (a path on the node, or for vLLM/SGLang a Hugging Face repo
    id); ``params["model_path"]`` stands in for it until the catalog sends ``source``.
    ``binary`` is the engine's program as discovery found it (``""``: its default name on
    PATH). ``nodes`` > 1 makes a multi-node replica: rank 0 serves, the others are workers,
    all meeting at ``dist_init_addr`` (``host:port``, bound by rank 0). The workers of an
    engine whose rank 0 dials them (llama.cpp, :func:`worker_port_base`) bind an endpoint
    instead: rank 0 gets every worker's ``host:port`` in ``peers`` (rank order), a worker
    the one it binds in ``listen_addr`` (when that is empty, ``peers[rank - 1]``).
    """

    engine: str
    model: str
    port: int
    source: str = ""
    binary: str = ""
    gpus: tuple[str, ...] = ()
    nodes: int = 1
    rank: int = 0
    dist_init_addr: str = ""
    params: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    extra_args: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    listen_addr: str = ""

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1

    @property
    def worker(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class EngineCommand:
    """How to start one shard's engine. ``serves`` is False for the workers of a multi-node
    replica: they answer no HTTP and are healthy while they run (``health_path`` empty)."""

    argv: list[str]
    env: dict[str, str]
    serves: bool
    health_path: str = "/health"


@dataclass(frozen=True)
class Param:
    """A model parameter an engine takes: the engine flag it becomes and its value's type
    (``int``, ``float`` or ``str``), within ``minimum``/``maximum`` when they are set."""

    flag: str
    kind: type[int] | type[float] | type[str]
    minimum: float | None = None
    maximum: float | None = None
    sample: str = "1"  # a valid value, for engine-check's widest command


MODEL_PATH = "model_path"
"""The parameter that names the weights until StartShard's ``source`` is filled in."""


class EngineModule(Protocol):
    """What each engine module offers: its builder and what engine-check needs to know."""

    NAME: str
    PROGRAM: str  # the default program, looked up on PATH
    HELP_ARGS: tuple[str, ...]  # after the program: print every flag
    VERSION_ARGS: tuple[str, ...]  # after the program: print the version
    PARAMS: Mapping[str, Param]
    WORKER_PORT: int | None  # see worker_port_base

    def prefix(self, binary: str) -> list[str]:
        """The argv up to the engine's own flags (program and subcommand)."""
        ...

    def build(self, spec: EngineSpec) -> EngineCommand: ...


# The registry: engine name -> module. Imported on first use, so that each engine module can
# import this one for the types above.
_MODULES: Mapping[str, str] = MappingProxyType(
    {
        "sim": __name__,
        "vllm": "llmgw.engines.vllm",
        "sglang": "llmgw.engines.sglang",
        "llamacpp": "llmgw.engines.llamacpp",
    }
)

AVAILABLE_ENGINES: tuple[str, ...] = tuple(_MODULES)
"""Engines llmgw can build a command for (``sim`` is built in; the others must be on the
node, which discovery checks)."""


def self_argv() -> list[str]:
    """How to run this very llmgw: the frozen binary itself, or this interpreter."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "llmgw"]


def engine_module(engine: str) -> EngineModule:
    """The module that builds ``engine``'s command; EngineError names the known ones."""
    name = _MODULES.get(engine)
    if name is None:
        raise EngineError(
            f"engine {engine!r} is not one llmgw can run (it knows "
            f"{', '.join(AVAILABLE_ENGINES)}); deploy the model with one of those engines"
        )
    if name == __name__:
        return cast(EngineModule, _Sim)
    return cast(EngineModule, importlib.import_module(name))


def worker_port_base(engine: str) -> int | None:
    """The first port a worker's endpoint binds, for an engine whose rank 0 dials its
    workers (llama.cpp's ``rpc-server``: 50052, its default); None for the engines whose
    workers dial rank 0's ``dist_init_addr``. The scheduler picks the port of each replica
    from here upwards, as it picks rank 0's dist-init port from 29500."""
    return engine_module(engine).WORKER_PORT


def build_command(spec: EngineSpec) -> EngineCommand:
    """The command that starts ``spec``'s engine on 127.0.0.1:``spec.port``; EngineError
    when the spec cannot be run (unknown engine or parameter, bad rendezvous, no weights)."""
    module = engine_module(spec.engine)
    _check_shape(spec)
    check_params(spec.engine, spec.params)
    return module.build(spec)


def build_argv(
    engine: str,
    *,
    model: str,
    port: int,
    params: Mapping[str, str],
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv of a single-node ``engine`` serving ``model`` on 127.0.0.1:``port``, without
    GPUs or a known binary: :func:`build_command` of the plain :class:`EngineSpec`."""
    spec = EngineSpec(
        engine=engine, model=model, port=port, params=params, extra_args=tuple(extra_args)
    )
    return build_command(spec).argv


def check_params(engine: str, params: Mapping[str, str]) -> None:
    """Raise EngineError naming the first parameter ``engine`` does not take or whose value
    is not valid; what the admin API can check before a model is deployed."""
    table = engine_module(engine).PARAMS
    for key, value in params.items():
        param = table.get(key)
        if param is None:
            raise EngineError(
                f"{engine} engine has no parameter {key!r}; it takes {', '.join(sorted(table))}"
            )
        _check_value(engine, key, str(value), param)


def _check_value(engine: str, key: str, value: str, param: Param) -> None:
    if param.kind is str:
        if not value or value != value.strip() or "\x00" in value:
            raise EngineError(
                f"{engine} engine parameter {key}={value!r} must be a non-empty string "
                "without surrounding white space"
            )
        return
    try:
        number = param.kind(value)
    except ValueError:
        raise EngineError(
            f"{engine} engine parameter {key}={value!r} is not a valid {param.kind.__name__}"
        ) from None
    assert isinstance(number, int | float)
    if not math.isfinite(number):
        raise EngineError(f"{engine} engine parameter {key}={value!r} must be a finite number")
    if param.minimum is not None and number < param.minimum:
        raise EngineError(
            f"{engine} engine parameter {key}={value!r} must be at least {param.minimum:g}"
        )
    if param.maximum is not None and number > param.maximum:
        raise EngineError(
            f"{engine} engine parameter {key}={value!r} must be at most {param.maximum:g}"
        )


def split_hostport(value: str, what: str) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` (``[v6]:port`` too); EngineError says what is wrong."""
    host, sep, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise EngineError(
            f"{what} {value!r} is not host:port (e.g. 10.0.0.1:29500, [fd00::1]:29500)"
        )
    return host, int(port_text)


def _check_shape(spec: EngineSpec) -> None:
    if not spec.model:
        raise EngineError("the model name is empty; every shard serves a named model")
    if not 0 < spec.port < 65536:
        raise EngineError(f"port {spec.port} is not in 1..65535")
    if spec.nodes < 1:
        raise EngineError(f"nodes must be at least 1, got {spec.nodes}")
    if not 0 <= spec.rank < spec.nodes:
        raise EngineError(f"rank {spec.rank} is not in 0..{spec.nodes - 1} (nodes={spec.nodes})")
    if spec.multi_node:
        if not spec.dist_init_addr:
            raise EngineError(
                f"a {spec.nodes}-node replica needs dist_init_addr (rank 0's host:port)"
            )
        split_hostport(spec.dist_init_addr, "dist_init_addr")


def gpu_env(spec: EngineSpec) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` of the shard's GPUs: empty hides every GPU from a shard
    that was given none, so it never lands on another shard's."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(spec.gpus)}


def weights(spec: EngineSpec) -> str:
    """The weights: ``source``, else ``params["model_path"]``; "" when neither is set."""
    return spec.source or spec.params.get(MODEL_PATH, "")


def param_flags(spec: EngineSpec, table: Mapping[str, Param]) -> list[str]:
    """The flags of ``spec.params`` in the order ``table`` lists them (``model_path`` is the
    weights, not a flag)."""
    argv: list[str] = []
    for key, param in table.items():
        if key in spec.params and param.flag:
            argv += [param.flag, str(spec.params[key])]
    return argv


# --------------------------------------------------------------------------- sim


class _Sim:
    """The built-in engine: this llmgw, ``llmgw engine sim``. Its multi-node form takes the
    same rendezvous as the real engines (``--nodes --rank --dist-init-addr``)."""

    NAME = "sim"
    PROGRAM = ""
    HELP_ARGS = ("engine", "sim", "--help")
    WORKER_PORT: int | None = None
    VERSION_ARGS = ("--version",)
    PARAMS: Mapping[str, Param] = MappingProxyType(
        {
            "seed": Param("--seed", int, minimum=-(2**63), sample="7"),
            "ttft_ms": Param("--ttft-ms", float, minimum=0, sample="10"),
            "tps": Param("--tps", float, minimum=0, sample="100"),
            "max_tokens": Param("--max-tokens", int, minimum=1, sample="16"),
        }
    )

    @staticmethod
    def prefix(binary: str) -> list[str]:
        return [*([binary] if binary else self_argv()), "engine", "sim"]

    @staticmethod
    def build(spec: EngineSpec) -> EngineCommand:
        argv = _Sim.prefix(spec.binary)
        argv += ["--host", LOOPBACK, "--port", str(spec.port), "--model", spec.model]
        # Parameters in the order they were given, as before multi-node existed.
        for key, value in spec.params.items():
            argv += [_Sim.PARAMS[key].flag, str(value)]
        if spec.multi_node:
            argv += ["--nodes", str(spec.nodes), "--rank", str(spec.rank)]
            argv += ["--dist-init-addr", spec.dist_init_addr]
        argv += spec.extra_args
        env = gpu_env(spec) if spec.gpus else {}
        if spec.worker:
            return EngineCommand(argv=argv, env=env, serves=False, health_path="")
        return EngineCommand(argv=argv, env=env, serves=True)
