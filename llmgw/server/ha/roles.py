"""The role machine (DESIGN §8): lead when the leadership is free, else stand by until it is;
step down to a standby when it is lost (PostgreSQL). What each role starts and stops is the
control plane's (:class:`RoleParts`); when, and the one :class:`Role` read, are here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

from llmgw.errors import StoreError
from llmgw.log import kv
from llmgw.server.ha.leadership import Leadership, Role
from llmgw.server.store import Store

__all__ = ["RoleParts", "Roles"]

log = logging.getLogger("llmgw.server")


class RoleParts(Protocol):
    """What the control plane runs in each role."""

    async def lead(self) -> None:
        """Start the leader's parts (the leadership just taken)."""
        ...

    async def stop_leading(self) -> None:
        """Stop the leader's parts (the store stays open)."""
        ...

    async def stand_by(self) -> None:
        """Serve as a standby."""
        ...

    async def stop_standing_by(self) -> None:
        """Stop what the standby served (before leading, or at the end)."""
        ...


class Roles:
    """This process's role and its changes."""

    def __init__(self, leadership: Leadership, parts: RoleParts, *, instance: str) -> None:
        self.leadership = leadership
        self.parts = parts
        self.instance = instance
        self.role = Role.STARTING
        self._keeping: asyncio.Task[None] | None = None
        self._stepping: asyncio.Task[None] | None = None
        self._promotion: asyncio.Task[None] | None = None
        self._nodes = 0  # nodes connected to the leader, as a standby last read them
        self._staying = False  # take no leadership from now on (:meth:`stay`)
        self._waiting = False  # the promotion is waiting for the leadership (not yet taken)

    async def start(self) -> None:
        if self.leadership.try_take():
            await self._lead()
        else:
            await self._stand_by()

    async def _lead(self) -> None:
        self.role = Role.LEADER
        await self.parts.lead()
        self._keeping = asyncio.create_task(self._keep(), name="lease")

    async def _keep(self) -> None:
        reason = await self.leadership.keep()
        self._stepping = asyncio.create_task(self._step_down(reason), name="step-down")

    async def _step_down(self, reason: str) -> None:
        """Another instance leads now: stop the leader's parts (their writes are fenced
        already) and serve as a standby."""
        log.warning(
            "another instance leads now; stepping down",
            extra=kv(instance=self.instance, epoch=self.leadership.epoch, reason=reason),
        )
        self.leadership.end()
        await self.parts.stop_leading()
        await self._stand_by()

    async def _stand_by(self) -> None:
        self.role = Role.STANDBY
        await self.parts.stand_by()
        if not self._staying:
            self._waiting = True  # from now: the task may not have run yet
            self._promotion = asyncio.create_task(self._await_leadership(), name="promotion")

    async def _await_leadership(self) -> None:
        try:
            await self.leadership.take()
        finally:
            self._waiting = False
        log.warning("the leader is gone; taking over", extra=kv(instance=self.instance))
        await self.parts.stop_standing_by()
        await self._lead()

    async def stay(self) -> None:
        """Take no leadership from now on (an instance draining before its stop): a standby
        stops waiting for it, and a leader that loses it later stands by without waiting
        for it again. A take-over already under way (the leadership taken) ends as a
        leader, whose stop then releases it: cut halfway, the lease would be held by
        nobody's parts until it lapsed."""
        self._staying = True
        task = self._promotion
        if task is not None and self._waiting:
            self._promotion = None
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        """Stop the role's parts and the changes under way (the leadership is the
        caller's to release, after its last write)."""
        for task in (self._stepping, self._promotion, self._keeping):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.role is Role.LEADER:
            await self.parts.stop_leading()
        else:
            await self.parts.stop_standing_by()

    def health(self, store: Store) -> dict[str, object]:
        """What /healthz says of this instance among several: its role, the leader, and the
        database when it is away. A standby says the cluster's epoch and connected nodes
        (the leader's, from the database; the last read while it is away), not its own."""
        out: dict[str, object] = {"role": str(self.role), "instance": self.instance}
        out["epoch"] = self.leadership.epoch
        if self.role is not Role.LEADER:
            out["leader"] = self.leadership.leader_addresses()[1]
            out["epoch"] = self.leadership.cluster_epoch()
            with contextlib.suppress(StoreError):
                self._nodes = store.count_connected_nodes()
            out["nodes"] = self._nodes
        down = getattr(store.database, "unreachable_since", None)
        if down is not None:
            out["database"] = (
                f"unreachable since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(down))}; "
                "scheduling and admin writes pause, the gateway serves from what it knows"
            )
        return out
