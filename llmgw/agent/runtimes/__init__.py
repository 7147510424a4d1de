"""Shard runtimes, chosen by name: ``process`` (engines as processes of the node) and
``docker`` (engines as containers of the local Docker daemon)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.agent.runtimes.base import Handle, Launch, Runtime, ShardRecord
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.errors import ConfigError

if TYPE_CHECKING:
    from llmgw.agent.runtimes.docker import DockerRuntime

__all__ = [
    "RUNTIME_NAMES",
    "DockerRuntime",
    "Handle",
    "Launch",
    "ProcessRuntime",
    "Runtime",
    "ShardRecord",
    "get_runtime",
]

RUNTIME_NAMES = ("docker", "process")


def get_runtime(
    name: str, *, docker_network: str | None = None, docker_host: str | None = None
) -> Runtime:
    """The runtime called ``name``; ``docker_network`` is the docker runtime's network
    (agent.yaml's ``docker.network``; None: Docker's default bridge), ``docker_host`` its
    daemon's socket (``docker.host``; None: DOCKER_HOST, else dockerd's own)."""
    if name == "process":
        return ProcessRuntime()
    if name == "docker":
        # Imported here: the docker SDK costs every other command about 70 ms to load.
        from llmgw.agent.runtimes.docker import DockerRuntime

        return DockerRuntime(base_url=docker_host, network=docker_network)
    raise ConfigError(
        f"unknown runtime {name!r}; choose one of {', '.join(RUNTIME_NAMES)}", key="runtime"
    )


def __getattr__(name: str) -> object:
    if name == "DockerRuntime":
        from llmgw.agent.runtimes.docker import DockerRuntime

        return DockerRuntime
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
