"""What an engine builder is given and gives back: the :class:`EngineSpec` of one shard in,
the :class:`EngineCommand` that starts its engine out, the :class:`Param` table of the
parameters it takes, and the helpers every builder shares.

An engine is a module (``vllm``, ``sglang``, ``llamacpp``, ``sim``) that satisfies
:class:`EngineModule`; :mod:`llmgw.engines.registry` names them and
:mod:`llmgw.engines.launch` checks a spec and calls its builder. Engines listen on
127.0.0.1 only; the exceptions are the rendezvous of a multi-node replica
(``dist_init_addr``, or llama.cpp's RPC workers) and a disaggregated shard's KV transfer side
channel (``transfer_addr``), which the other nodes must reach. An SGLang prefill's bootstrap
server stays on loopback too (``bootstrap_port``), the agent relaying ``transfer_addr`` to it
(:mod:`llmgw.engines.disagg`). GPUs are handed over in ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from llmgw.errors import ConfigError, EngineError
from llmgw.netaddr import parse_hostport

__all__ = [
    "LOOPBACK",
    "MODEL_PATH",
    "EngineCommand",
    "EngineModule",
    "EngineSpec",
    "Param",
    "gpu_env",
    "kv_events_flags",
    "param_flags",
    "rendezvous_addr",
    "weights",
]

LOOPBACK = "127.0.0.1"
"""Where every engine's HTTP server listens; the agent's data plane is the only way in."""

MODEL_PATH = "model_path"
"""The parameter that names the weights until StartShard's ``source`` is filled in."""

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class EngineSpec:
    """What one shard runs: the engine, the model it serves under its llmgw name, and where.

    ``source`` is the weights (a path on the node, or for vLLM/SGLang a Hugging Face repo
    id); ``params["model_path"]`` stands in for it until the catalog sends ``source``.
    ``binary`` is the engine's program as discovery found it (``""``: its default name on
    PATH). ``nodes`` > 1 makes a multi-node replica: rank 0 serves, the others are workers,
    all meeting at ``dist_init_addr`` (``host:port``, bound by rank 0). The workers of an
    engine whose rank 0 dials them (llama.cpp, the registry's ``dials_workers``) bind an
    endpoint instead: rank 0 gets every worker's ``host:port`` in ``peers`` (rank order), a
    worker the one it binds in ``listen_addr`` (when that is empty, ``peers[rank - 1]``).
    ``kv_events_config``: the ``--kv-events-config`` JSON
    (:func:`llmgw.engines.kvevents.events_config`) that makes an engine with KV events (the
    registry's ``kv_events``) publish them; "" publishes none.
    ``disagg_role``: "" (aggregated), ``prefill`` or ``decode``: the pool of a disaggregated
    model the shard is in; ``transfer_addr`` (``host:port``) is where its engine binds its KV
    transfer side channel, ``fabric_devices`` the node's fabric adapters (agent.yaml's
    ``fabrics``) it moves the KV cache over (:mod:`llmgw.engines.disagg`). ``bootstrap_port``:
    an SGLang prefill's bootstrap server's loopback port (the agent picks it and relays
    ``transfer_addr`` to it); 0 for every other shard.
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
    kv_events_config: str = ""
    disagg_role: str = ""
    transfer_addr: str = ""
    fabric_devices: tuple[str, ...] = ()
    bootstrap_port: int = 0

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


class EngineModule(Protocol):
    """What each engine module offers: its builder and what engine-check needs to know."""

    NAME: str
    PROGRAM: str  # the default program, looked up on PATH ("": this llmgw)
    HELP_ARGS: tuple[str, ...]  # after the program: print every flag
    VERSION_ARGS: tuple[str, ...]  # after the program: print the version
    # The environment engine-check adds when it runs those two: what lets the engine print
    # them on any machine (vLLM refuses both where it finds no GPU).
    CHECK_ENV: Mapping[str, str]
    PARAMS: Mapping[str, Param]
    # The flags that run the engine for a task (a catalog profile's ``task``), before the
    # profile's own args; a task it runs in its default mode has none.
    TASK_FLAGS: Mapping[str, tuple[str, ...]]
    # The flags that let the engine sleep at each level (the registry's ``sleep_levels``),
    # before the profile's own args; empty for an engine that cannot sleep.
    SLEEP_FLAGS: Mapping[int, tuple[str, ...]]

    def prefix(self, binary: str) -> list[str]:
        """The argv up to the engine's own flags (program and subcommand)."""
        ...

    def build(self, spec: EngineSpec) -> EngineCommand: ...


def rendezvous_addr(value: str, what: str) -> tuple[str, int]:
    """``(host, port)`` of a multi-node rendezvous address (``host:port``, ``[v6]:port``),
    read by :func:`llmgw.netaddr.parse_hostport`; EngineError says what is wrong."""
    try:
        return parse_hostport(value)
    except ConfigError as exc:
        raise EngineError(
            f"{what} {value!r} is not host:port (e.g. 10.0.0.1:29500, [fd00::1]:29500): "
            f"{exc.message}"
        ) from None


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


def kv_events_flags(spec: EngineSpec) -> list[str]:
    """``--kv-events-config JSON`` when the shard publishes its KV cache events, else none
    (vLLM, SGLang and the sim spell the flag alike). Workers publish none: rank 0's
    scheduler owns the prefix cache."""
    if not spec.kv_events_config or spec.worker:
        return []
    return ["--kv-events-config", spec.kv_events_config]
