"""The launcher: check one shard's :class:`~llmgw.engines.spec.EngineSpec` against its
engine (from :mod:`llmgw.engines.registry`) and build the command that starts it.

What every caller goes through: the agent's runtimes (:func:`build_command`), the admin API
and the catalog (:func:`check_params`), the scheduler and the agent (:func:`dials_workers`) and
engine-check. The builders themselves live one module per engine (``vllm``, ``sglang``,
``llamacpp``, ``sim``) and share the types of :mod:`llmgw.engines.spec`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence

from llmgw.engines.disagg import check_role
from llmgw.engines.registry import engine_names, get_engine
from llmgw.engines.spec import EngineCommand, EngineModule, EngineSpec, Param, rendezvous_addr
from llmgw.errors import EngineError

__all__ = [
    "build_argv",
    "build_command",
    "check_params",
    "dials_workers",
    "engine_module",
    "self_argv",
    "sleep_args",
    "task_args",
]


def self_argv() -> list[str]:
    """How to run this very llmgw: the frozen binary itself, or this interpreter."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "llmgw"]


def engine_module(engine: str) -> EngineModule:
    """The module that builds ``engine``'s command; EngineError names the known ones."""
    return get_engine(engine).module()


def dials_workers(engine: str) -> bool:
    """Whether rank 0 of a multi-node replica of ``engine`` dials its workers (llama.cpp's
    ``rpc-server``: each worker binds an endpoint, StartShard's ``listen_addr``), rather
    than the workers dialling rank 0's ``dist_init_addr`` (sim, vLLM, SGLang). The scheduler
    orders such a replica's workers first and sends them their endpoints; the agent checks
    the port a shard binds against its ``multinode_ports``."""
    return get_engine(engine).dials_workers


def build_command(spec: EngineSpec) -> EngineCommand:
    """The command that starts ``spec``'s engine on 127.0.0.1:``spec.port``; EngineError
    when the spec cannot be run (unknown engine or parameter, bad rendezvous, no weights,
    several nodes for an engine without a multi-node form, a disaggregation role it cannot
    take)."""
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


def task_args(engine: str, tasks: Sequence[str]) -> list[str]:
    """The flags that run ``engine`` for ``tasks``, which go before a profile's own args:
    each task's ``TASK_FLAGS`` in the order of ``tasks``, a group another task already gave
    only once (vLLM's ``--runner pooling`` for embed and rerank). EngineError when one
    replica of the engine cannot do all of them, naming the fix."""
    row = get_engine(engine)
    if not row.can_serve_together(tasks):
        together = [" + ".join(sorted(s)) for s in row.task_sets]
        also = f" (it can do {' or '.join(together)} together)" if together else ""
        raise EngineError(
            f"one {engine} replica cannot do {' and '.join(tasks)} at once{also}; give each "
            "task a profile of its own and deploy them as two models (e.g. NAME and "
            "NAME-embed)"
        )
    flags = engine_module(engine).TASK_FLAGS
    groups: list[tuple[str, ...]] = []
    for task in tasks:
        group = flags.get(task, ())
        if group and group not in groups:
            groups.append(group)
    return [flag for group in groups for flag in group]


def sleep_args(engine: str, level: int) -> list[str]:
    """The flags that let ``engine`` sleep at ``level`` (before a profile's own args);
    EngineError naming the fix when it cannot."""
    row = get_engine(engine)
    if level not in row.sleep_levels:
        able = [n for n in engine_names() if get_engine(n).sleep_levels]
        if not row.sleep_levels:
            raise EngineError(
                f"engine {engine} cannot sleep (it scales by start and stop only); drop "
                f"'sleep', or deploy the model with one of {', '.join(able)}"
            )
        levels = " or ".join(str(n) for n in row.sleep_levels)
        raise EngineError(f"engine {engine} sleeps at level {levels}, not {level}")
    return list(engine_module(engine).SLEEP_FLAGS[level])


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
        if not get_engine(spec.engine).multi_node:
            raise EngineError(
                f"engine {spec.engine} has no multi-node form; run it with nodes 1, not "
                f"{spec.nodes}"
            )
        if not spec.dist_init_addr:
            raise EngineError(
                f"a {spec.nodes}-node replica needs dist_init_addr (rank 0's host:port)"
            )
        rendezvous_addr(spec.dist_init_addr, "dist_init_addr")
    if spec.kv_events_config and not get_engine(spec.engine).kv_events:
        with_events = ", ".join(n for n in engine_names() if get_engine(n).kv_events)
        raise EngineError(
            f"engine {spec.engine} publishes no KV cache events; run it without "
            f"kv_events_config, or use an engine that does ({with_events})"
        )
    check_role(spec.engine, get_engine(spec.engine).disagg_handover, spec)
