"""Build the command line that starts an engine for one shard, on a loopback port."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence

from llmgw.errors import EngineError

__all__ = ["AVAILABLE_ENGINES", "build_argv", "self_argv"]

# Engines this agent can start without anything installed on the node.
AVAILABLE_ENGINES = ("sim",)

_SIM_PARAMS: dict[str, type[int] | type[float]] = {
    "seed": int,
    "ttft_ms": float,
    "tps": float,
    "max_tokens": int,
}
_SIM_MINIMUM = {"seed": -(2**63), "ttft_ms": 0, "tps": 0, "max_tokens": 1}


def self_argv() -> list[str]:
    """How to run this very llmgw: the frozen binary itself, or this interpreter."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "llmgw"]


def _sim_argv(model: str, port: int, params: Mapping[str, str], extra: Sequence[str]) -> list[str]:
    argv = [*self_argv(), "engine", "sim", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model", model]
    for key, value in params.items():
        kind = _SIM_PARAMS.get(key)
        if kind is None:
            raise EngineError(
                f"sim engine has no parameter {key!r}; it takes {', '.join(sorted(_SIM_PARAMS))}"
            )
        try:
            number = kind(value)
        except ValueError:
            raise EngineError(
                f"sim engine parameter {key}={value!r} is not a valid {kind.__name__}"
            ) from None
        if not math.isfinite(number) or number < _SIM_MINIMUM[key]:
            raise EngineError(
                f"sim engine parameter {key}={value!r} must be a finite number of at least "
                f"{_SIM_MINIMUM[key]}"
            )
        argv += ["--" + key.replace("_", "-"), str(value)]
    return [*argv, *extra]


def build_argv(
    engine: str,
    *,
    model: str,
    port: int,
    params: Mapping[str, str],
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv for ``engine`` serving ``model`` on 127.0.0.1:``port``."""
    if engine == "sim":
        return _sim_argv(model, port, params, extra_args)
    raise EngineError(
        f"engine {engine!r} is not available on this node (available: "
        f"{', '.join(AVAILABLE_ENGINES)}); deploy the model with one of those engines"
    )
