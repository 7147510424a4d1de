"""What every shard runtime offers the agent: start an engine, wait for it, stop it."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Handle", "Launch", "Runtime"]


@dataclass(frozen=True)
class Launch:
    """Everything a runtime needs to start one engine process."""

    shard_id: str
    argv: tuple[str, ...]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Handle:
    """A started engine; ``ref`` is runtime-specific (a process, a container id)."""

    shard_id: str
    pid: int
    port: int
    ref: object = None


class Runtime(abc.ABC):
    """A way of running engines: child processes, containers."""

    name: str = ""

    @abc.abstractmethod
    async def start(self, launch: Launch) -> Handle:
        """Start the engine; raise ShardError when it cannot even be started."""

    @abc.abstractmethod
    async def wait(self, handle: Handle) -> int:
        """Wait for the engine to end and return its exit code (negative: killed by signal)."""

    @abc.abstractmethod
    async def stop(self, handle: Handle, grace: float) -> None:
        """Ask the engine to stop; kill it after ``grace`` seconds."""

    @abc.abstractmethod
    def alive(self, handle: Handle) -> bool:
        """Whether the engine is still running."""
