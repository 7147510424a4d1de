"""What every shard runtime offers the agent: start an engine, wait for it, stop it."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.errors import ShardError

__all__ = ["Handle", "Launch", "Runtime", "ShardRecord", "SidecarRecord", "open_shard_log"]


def open_shard_log(path: Path) -> BinaryIO:
    """``path`` (its directory made, 0700, when missing) open for appending, unbuffered: the
    file an engine's output goes to, whatever runs it. ShardError when it cannot be opened."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        return open(path, "ab", buffering=0)
    except OSError as exc:
        raise ShardError(
            f"cannot open the shard log {path}: {exc.strerror}; "
            "check the state directory's owner and free space"
        ) from exc


@dataclass(frozen=True)
class Launch:
    """Everything a runtime needs to start one engine process."""

    shard_id: str
    argv: tuple[str, ...]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    # For container runtimes; the process runtime ignores them.
    image: str | None = None  # the engine's image, e.g. llmgw-sim:0.1
    labels: dict[str, str] = field(default_factory=dict)  # llmgw.cluster/node/replica/shard
    gpus: tuple[str, ...] = ()  # GPU UUIDs or indices handed to the container; () means none
    container_port: int = 0  # the port the engine listens on inside; 0 means ``port``
    # In the host's network namespace rather than behind a published port: a shard of a
    # multi-node replica, whose rendezvous binds (or dials) the node's own address. The
    # engine then listens on the host's 127.0.0.1:``port`` itself.
    host_network: bool = False
    # The process runtime: argv starts bubblewrap, which runs the engine in its sandbox
    # (llmgw.agent.sandbox); the pid is bwrap's, and a stop signals the engine past it.
    sandboxed: bool = False


@dataclass
class Handle:
    """A started engine; ``ref`` is runtime-specific (a process, a container id)."""

    shard_id: str
    pid: int
    port: int
    ref: object = None
    start_time: int | None = None
    """The process's start time (clock ticks since boot), so that a reused pid is never adopted."""
    container_id: str | None = None
    """The container the engine runs in, for runtimes that use containers."""
    sandboxed: bool = False
    """``pid`` is bubblewrap's, the engine runs under it (:attr:`Launch.sandboxed`)."""


@dataclass(frozen=True)
class SidecarRecord:
    """What the state directory keeps of one sidecar of a shard: how to run and check it,
    and its process (pid and start time), so that a restarted agent can take it back."""

    name: str
    argv: tuple[str, ...]
    health_url: str = ""
    timeout_s: float = 0.0
    ready_after_s: float = 0.0
    pid: int = 0
    start_time: int | None = None
    sandboxed: bool = False


@dataclass(frozen=True)
class ShardRecord:
    """What the state directory keeps of one shard: enough to find its engine again after an
    agent restart (pid and start time, or container id) and to start it afresh."""

    shard_id: str
    replica_id: str
    model: str
    engine: str
    rank: int = 0
    params: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    pid: int = 0
    start_time: int | None = None
    port: int = 0
    container_id: str | None = None
    state: str = ""
    # The rest of the StartShard order, so that an adopted shard is the one that was ordered.
    nodes: int = 1
    dist_init_addr: str = ""
    gpus: tuple[str, ...] = ()
    source: str = ""
    gpu_memory_mib: int = 0
    profile: str = ""
    sidecars: tuple[SidecarRecord, ...] = ()
    worker_addrs: tuple[str, ...] = ()
    listen_addr: str = ""
    log_offset: int = 0
    """Where this engine's output starts in the shard's log (it is appended to across runs)."""
    kv_events: bool = False
    """The order asked for the engine's KV cache events."""
    kv_events_endpoint: str = ""
    """The ``ipc://`` socket the engine publishes them to, which an adopting agent dials
    again ("": none)."""
    kv_events_port: int = 0
    """An older agent's: the loopback TCP port its engine publishes them to (read, never
    written; such a shard is restarted on adoption)."""
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)
    """The order's sandbox (the profile's ``sandbox`` key)."""
    sandboxed: bool = False
    """``pid`` is the bubblewrap that runs the engine in its sandbox."""
    sleep_level: int = 0
    """Asleep (or falling asleep, waking): the level its engine sleeps at."""
    disagg_role: str = ""
    """The order's disaggregation role ("": aggregated), so an adopted shard keeps its pool."""
    transfer_addr: str = ""
    """The order's KV transfer address (with a role)."""
    bootstrap_port: int = 0
    """An SGLang prefill: the loopback port of its bootstrap server, which an adopting agent
    relays the transfer address to again (0: none)."""


class Runtime(abc.ABC):
    """A way of running engines: child processes, containers."""

    name: str = ""

    @abc.abstractmethod
    async def start(self, launch: Launch) -> Handle:
        """Start the engine; raise ShardError when it cannot even be started."""

    @abc.abstractmethod
    async def wait(self, handle: Handle) -> int | None:
        """Wait for the engine to end and return its exit code (negative: killed by signal);
        None when it cannot be known (an engine adopted from a previous agent)."""

    @abc.abstractmethod
    async def stop(self, handle: Handle, grace: float) -> None:
        """Ask the engine to stop; kill it after ``grace`` seconds."""

    @abc.abstractmethod
    def alive(self, handle: Handle) -> bool:
        """Whether the engine is still running."""

    @abc.abstractmethod
    async def adopt(self, record: ShardRecord) -> Handle | None:
        """Take over the engine a previous agent started for ``record``; None when it is gone
        (or its pid or container now belongs to something else)."""
