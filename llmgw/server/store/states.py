"""The states a node, a replica and a shard can be in, a node's health, the kinds of join
token, and where a desired engine install on a node stands.

One place for these names: the store's CHECK constraints are generated from them, the
scheduler and the admin API compare against them. Members are :class:`enum.StrEnum`, so a
member equals its string (``ShardState.READY == "ready"``) and is stored and serialised as it.

A node has two separate facts: its **state** (:class:`NodeState`, its life cycle: pending,
approved, revoked; draining is a flag beside it), which operators change, and its **health**
(:class:`NodeHealth`: healthy, degraded, offline), which the node's own reports decide and
which is never stored: it is read from whether its stream is up and the reasons its last
inventory gives (llmgw.contracts.inventory). An approved, draining node can be degraded;
a degraded node stays approved and keeps the work it can do.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from llmgw.contracts.inventory import degraded_reasons

__all__ = [
    "SLEEP_STATES",
    "InstallState",
    "NodeHealth",
    "NodeState",
    "ReplicaState",
    "ShardState",
    "TokenKind",
    "health_change",
    "node_health",
    "sql_check",
]


class NodeState(enum.StrEnum):
    """Whether a node's stream is let in and its GPUs used."""

    PENDING = "pending"
    """Enrolled, waiting for an operator to approve it by fingerprint."""
    APPROVED = "approved"
    REVOKED = "revoked"


class NodeHealth(enum.StrEnum):
    """Whether a node can do what it is configured to, as its own reports say."""

    HEALTHY = "healthy"
    """Connected, and its last inventory gives no reason to be degraded."""
    DEGRADED = "degraded"
    """Connected, but it cannot run something it is configured to (a GPU driver, an engine,
    a fabric, dockerd): placement keeps it from that, and only from that."""
    OFFLINE = "offline"
    """Its stream is down (or it was lost): it takes no new work until it is back."""


def node_health(connected: bool, degraded: bool) -> NodeHealth:
    """The health of a node whose stream is up or not, and whose last inventory gave
    reasons to be degraded or not."""
    if not connected:
        return NodeHealth.OFFLINE
    return NodeHealth.DEGRADED if degraded else NodeHealth.HEALTHY


def health_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> tuple[str, str] | None:
    """The event (kind, message) a new inventory of a connected node is worth, or None when
    its reasons are the same: ``node_degraded`` with every reason when they appear or change,
    ``node_healthy`` when the last one is gone."""
    before = degraded_reasons(old)
    after = degraded_reasons(new)
    if before == after:
        return None
    if not after:
        gone = "; ".join(r.message for r in before)
        return "node_healthy", f"no longer degraded (was: {gone})"
    return "node_degraded", "; ".join(r.message for r in after)


class ReplicaState(enum.StrEnum):
    """A model replica, as the state of its shards sums it up."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"
    FALLING_ASLEEP = "falling_asleep"
    """Its engine gives its GPU memory back (a SleepShard order); routed no more."""
    ASLEEP = "asleep"
    """Its engine runs without its GPU memory: not routed, not restarted, woken on order."""
    WAKING = "waking"
    """Its engine takes its GPU memory back; routed again once ready."""


class ShardState(enum.StrEnum):
    """One process of a replica on one node."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    EXITED = "exited"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FALLING_ASLEEP = "falling_asleep"
    ASLEEP = "asleep"
    WAKING = "waking"


SLEEP_STATES: frozenset[str] = frozenset(
    {ShardState.FALLING_ASLEEP, ShardState.ASLEEP, ShardState.WAKING}
)
"""A replica or shard whose engine runs but serves nothing: it sleeps, or is between
sleeping and awake (the same names in both enums)."""


class TokenKind(enum.StrEnum):
    """What a one-time join token may be spent on."""

    JOIN = "join"
    REKEY = "rekey"


class InstallState(enum.StrEnum):
    """A desired engine build on one node (llmgw.server.fleet.installs)."""

    INSTALLING = "installing"
    """Ordered; the node has not answered yet."""
    INSTALLED = "installed"
    """The node installed it and ran it (or found it installed and running)."""
    FAILED = "failed"


def sql_check(column: str, states: type[enum.StrEnum]) -> str:
    """``CHECK (column IN ('a', 'b'))`` for a state column, from the enum's members."""
    names = ", ".join(f"'{member.value}'" for member in states)
    return f"CHECK ({column} IN ({names}))"
