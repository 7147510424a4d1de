"""The states a node, a replica and a shard can be in, the kinds of join token, and where a
desired engine install on a node stands.

One place for these names: the store's CHECK constraints are generated from them, the
scheduler and the admin API compare against them. Members are :class:`enum.StrEnum`, so a
member equals its string (``ShardState.READY == "ready"``) and is stored and serialised as it.
"""

from __future__ import annotations

import enum

__all__ = ["InstallState", "NodeState", "ReplicaState", "ShardState", "TokenKind", "sql_check"]


class NodeState(enum.StrEnum):
    """Whether a node's stream is let in and its GPUs used."""

    PENDING = "pending"
    """Enrolled, waiting for an operator to approve it by fingerprint."""
    APPROVED = "approved"
    REVOKED = "revoked"


class ReplicaState(enum.StrEnum):
    """A model replica, as the state of its shards sums it up."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    STOPPING = "stopping"


class ShardState(enum.StrEnum):
    """One process of a replica on one node."""

    PENDING = "pending"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    EXITED = "exited"
    STOPPING = "stopping"
    STOPPED = "stopped"


class TokenKind(enum.StrEnum):
    """What a one-time join token may be spent on."""

    JOIN = "join"
    REKEY = "rekey"


class InstallState(enum.StrEnum):
    """A desired engine build on one node (llmgw.server.installs)."""

    INSTALLING = "installing"
    """Ordered; the node has not answered yet."""
    INSTALLED = "installed"
    """The node installed it and ran it (or found it installed and running)."""
    FAILED = "failed"


def sql_check(column: str, states: type[enum.StrEnum]) -> str:
    """``CHECK (column IN ('a', 'b'))`` for a state column, from the enum's members."""
    names = ", ".join(f"'{member.value}'" for member in states)
    return f"CHECK ({column} IN ({names}))"
