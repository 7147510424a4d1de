"""The requests in flight on each shard of this node, as the data plane relays them: what a
shard retired make-before-break waits on before its engine stops (``StopShard.drain_s``)."""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["ShardTraffic"]


class ShardTraffic:
    """Per shard, the requests the data plane is relaying to its engine now."""

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._idle: dict[str, asyncio.Event] = {}

    def enter(self, shard_id: str) -> None:
        self._inflight[shard_id] = self._inflight.get(shard_id, 0) + 1
        event = self._idle.get(shard_id)
        if event is not None:
            event.clear()

    def leave(self, shard_id: str) -> None:
        left = self._inflight.get(shard_id, 0) - 1
        if left > 0:
            self._inflight[shard_id] = left
            return
        self._inflight.pop(shard_id, None)
        event = self._idle.get(shard_id)
        if event is not None:
            event.set()

    def inflight(self, shard_id: str) -> int:
        return self._inflight.get(shard_id, 0)

    async def idle(self, shard_id: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for no request to be in flight on the shard: True
        when none is, False when some still were at the timeout."""
        if not self._inflight.get(shard_id):
            return True
        event = self._idle.setdefault(shard_id, asyncio.Event())
        event.clear()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
            return not self._inflight.get(shard_id)
        finally:
            if self._idle.get(shard_id) is event and not self._inflight.get(shard_id):
                del self._idle[shard_id]
