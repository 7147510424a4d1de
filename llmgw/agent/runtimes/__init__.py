"""Shard runtimes, chosen by name: ``process`` (children of the agent)."""

from __future__ import annotations

from llmgw.agent.runtimes.base import Handle, Launch, Runtime
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.errors import ConfigError

__all__ = ["Handle", "Launch", "ProcessRuntime", "Runtime", "get_runtime"]

_RUNTIMES: dict[str, type[Runtime]] = {"process": ProcessRuntime}


def get_runtime(name: str) -> Runtime:
    try:
        return _RUNTIMES[name]()
    except KeyError:
        raise ConfigError(
            f"unknown runtime {name!r}; choose one of {', '.join(sorted(_RUNTIMES))}",
            key="runtime",
        ) from None
