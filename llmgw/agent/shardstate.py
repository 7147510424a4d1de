"""The states of a shard on a node, as the agent reports and records them (its own module so
that :mod:`llmgw.agent.sleeping` and :mod:`llmgw.agent.shards` both read it)."""

from __future__ import annotations

import enum

__all__ = ["ShardState"]


class ShardState(enum.StrEnum):
    """Where a shard is, as the agent reports it (``ShardStatus.state``'s SHARD_* values)
    and records it in shards.json; a member equals its string."""

    STARTING = "starting"
    """Its sidecars or engine were started; not yet healthy (a worker: not yet joined)."""
    READY = "ready"
    FAILED = "failed"
    """It ended without being told to, or could not be started; ``reason`` says why."""
    EXITED = "exited"
    """It was stopped as ordered."""
    FALLING_ASLEEP = "falling_asleep"
    """Its engine is giving its GPU memory back (:mod:`llmgw.agent.sleeping`)."""
    ASLEEP = "asleep"
    """Its engine runs without its GPU memory; it serves nothing until woken."""
    WAKING = "waking"
    """Its engine is taking its GPU memory back; ready once it has."""
