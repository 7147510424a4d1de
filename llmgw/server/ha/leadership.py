"""Who leads (DESIGN §8): one leader, the others standbys. The role is one :class:`Role`;
the way to the leadership one :class:`Leadership`, of two kinds.

- :class:`FileLock` (SQLite): an exclusive lock on ``STATE/leader.lock``, held for the life
  of the leader's process; a second control plane on the same state (a warm standby on the
  same machine or a shared volume) waits for it, then bumps the epoch (fencing the old
  leader) and leads.
- :class:`~llmgw.server.ha.lease.LeaseKeeper` (PostgreSQL): a lease in the database that
  the instances sharing it take, renew and lose.
"""

from __future__ import annotations

import asyncio
import enum
import os
from pathlib import Path
from typing import Protocol

from llmgw.server.ha.standby import read_leader
from llmgw.server.store import Store
from llmgw.server.store.lock import try_lock

__all__ = ["FileLock", "Leadership", "Role", "await_lock"]


class Role(enum.StrEnum):
    """This process's role (what /healthz says)."""

    STARTING = "starting"
    LEADER = "leader"
    STANDBY = "standby"


class Leadership(Protocol):
    """The leadership as the role machine sees it, whichever its kind."""

    # True when the instances share the database (PostgreSQL): a standby serves the gateway
    # from it, and its :8080 socket is handed between roles.
    shared: bool
    # The epoch this process leads under (0 before it first led).
    epoch: int

    def try_take(self) -> bool:
        """Take the leadership if it is free; True when this process now leads."""
        ...

    async def take(self) -> None:
        """Wait until this process leads."""
        ...

    def begin(self, store: Store) -> int:
        """Lead on *store*: fence its writes by this leadership's epoch, which is returned."""
        ...

    async def keep(self) -> str:
        """Hold the leadership until it is lost; why it was."""
        ...

    def end(self) -> None:
        """Stop fencing the store's writes (the leadership was lost or is given up)."""
        ...

    def release(self) -> None:
        """Give the leadership up (a clean stop): a standby takes it next."""
        ...

    def leader_addresses(self) -> tuple[str, str]:
        """The leader's stream and HTTP addresses ("" when not known)."""
        ...

    def cluster_epoch(self) -> int:
        """The epoch the cluster is led under, whoever leads (a standby's /healthz)."""
        ...


async def await_lock(state_dir: Path, *, interval: float = 1.0) -> int:
    """Wait until this process holds the state directory's lock (the leader's process
    ended); the locked file descriptor."""
    while True:
        await asyncio.sleep(interval)
        fd = try_lock(state_dir)
        if fd is not None:
            return fd


class FileLock:
    """The :class:`Leadership` of SQLite: the state directory's lock, never lost while the
    process lives (a standby on the same state answers 503 naming the leader)."""

    shared = False

    def __init__(self, state_dir: Path, *, interval: float = 1.0) -> None:
        self.state_dir = state_dir
        self.interval = interval
        self.epoch = 0
        self._fd: int | None = None

    def try_take(self) -> bool:
        self._fd = try_lock(self.state_dir)
        return self._fd is not None

    async def take(self) -> None:
        self._fd = await await_lock(self.state_dir, interval=self.interval)

    def begin(self, store: Store) -> int:
        self.epoch = store.bump_epoch()
        return self.epoch

    async def keep(self) -> str:
        await asyncio.Event().wait()  # held until the process ends
        return ""

    def end(self) -> None:
        """Nothing to undo: the lock goes with the process (:meth:`release`)."""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def leader_addresses(self) -> tuple[str, str]:
        """As the leader recorded them in the store (read-only)."""
        return read_leader(self.state_dir / "llmgw.db")

    def cluster_epoch(self) -> int:
        """This process's (a standby on SQLite serves no /healthz of its own)."""
        return self.epoch
