"""The rows of the state store: one frozen dataclass per table, built from a row, and
the checks a value passes before it is written to a column.

(A join token's row is :class:`llmgw.server.tokens.JoinToken`, with the rules of its use.)
They are plain values: the store reads them, callers compare and pass them around, and
nothing writes through them. State columns come back as the enums of
:mod:`llmgw.server.states`, which equal their strings.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmgw.contracts.catalog import DEFAULT_PROFILE
from llmgw.contracts.keypolicy import Budget, KeyPolicy, UsageRow
from llmgw.server.states import InstallState, NodeState, ReplicaState, ShardState, TokenKind
from llmgw.server.store.database import Row
from llmgw.server.tokens import JoinToken

__all__ = [
    "DEFAULT_PROFILE",
    "LOGIN_KINDS",
    "OPERATOR_ROLES",
    "ApiKey",
    "Certificate",
    "DesiredBuild",
    "Event",
    "Model",
    "Node",
    "NodeEngine",
    "NodeUpdate",
    "Operator",
    "Replica",
    "Shard",
    "StoredLogin",
    "check_operator_name",
    "check_state",
    "dump_json",
    "join_token_from_row",
    "policy_columns",
    "usage_from_row",
]


@dataclass(frozen=True)
class Node:
    id: str
    uid: str
    state: NodeState
    connected: bool
    dataplane_addr: str | None
    agent_version: str | None
    inventory: dict[str, Any]
    fingerprint: str | None
    draining: bool
    last_seen: float | None
    created_at: float
    lost: bool = False
    lost_at: float | None = None

    @classmethod
    def from_row(cls, row: Row, inventory: dict[str, Any] | None = None) -> Node:
        """The row as a Node; ``inventory``, when given, is the row's inventory already
        parsed (llmgw.server.store.nodes keeps them: shared, never to be changed)."""
        return cls(
            id=row["id"],
            uid=row["uid"],
            state=NodeState(row["state"]),
            connected=bool(row["connected"]),
            dataplane_addr=row["dataplane_addr"],
            agent_version=row["agent_version"],
            inventory=json.loads(row["inventory"]) if inventory is None else inventory,
            fingerprint=row["fingerprint"],
            draining=bool(row["draining"]),
            last_seen=row["last_seen"],
            created_at=row["created_at"],
            lost=bool(row["lost"]),
            lost_at=row["lost_at"],
        )


@dataclass(frozen=True)
class NodeUpdate:
    """A node's latest update order and what the node reported about it."""

    node_id: str
    counter: int
    version: str
    state: str
    message: str
    op_id: str
    order: bytes | None
    signature: bytes | None
    expires: float | None
    ordered_at: float | None
    updated_at: float

    @classmethod
    def from_row(cls, row: Row) -> NodeUpdate:
        return cls(
            node_id=row["node_id"],
            counter=int(row["counter"]),
            version=row["version"],
            state=row["state"],
            message=row["message"],
            op_id=row["op_id"],
            order=None if row["order_json"] is None else bytes(row["order_json"]),
            signature=None if row["signature"] is None else bytes(row["signature"]),
            expires=row["expires"],
            ordered_at=row["ordered_at"],
            updated_at=row["updated_at"],
        )


@dataclass(frozen=True)
class DesiredBuild:
    """One architecture's build of an engine desired for a scope."""

    scope: str
    engine: str
    version: str
    arch: str  # "" runs on any architecture
    url: str
    sha256: str
    updated_at: float

    @classmethod
    def from_row(cls, row: Row) -> DesiredBuild:
        return cls(
            scope=row["scope"],
            engine=row["engine"],
            version=row["version"],
            arch=row["arch"],
            url=row["url"],
            sha256=row["sha256"],
            updated_at=row["updated_at"],
        )


@dataclass(frozen=True)
class NodeEngine:
    """The install of a desired engine build on one node: the last one ordered there."""

    node_id: str
    engine: str
    version: str
    sha256: str
    state: InstallState
    error: str
    op_id: str
    updated_at: float

    @classmethod
    def from_row(cls, row: Row) -> NodeEngine:
        return cls(
            node_id=row["node_id"],
            engine=row["engine"],
            version=row["version"],
            sha256=row["sha256"],
            state=InstallState(row["state"]),
            error=row["error"],
            op_id=row["op_id"],
            updated_at=row["updated_at"],
        )


@dataclass(frozen=True)
class Model:
    """A model: its catalog ``profiles`` (name -> the profile's JSON), the ``profile``
    deployed, and that profile's ``engine`` and ``params`` (its params, plus its args as
    ``extra_args``), which is what starting a shard reads.

    A model stored without profiles (before the catalog, or by :meth:`Store.put_model`
    without them) has ``profiles == {}``: its engine and params are its only profile.
    """

    name: str
    engine: str
    params: dict[str, Any]
    replicas: int
    created_at: float
    updated_at: float
    profiles: dict[str, Any] = field(default_factory=dict)
    profile: str = DEFAULT_PROFILE

    @classmethod
    def from_row(cls, row: Row) -> Model:
        return cls(
            name=row["name"],
            engine=row["engine"],
            params=json.loads(row["params"]),
            replicas=row["replicas"],
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            profiles=json.loads(row["profiles"]),
            profile=row["profile"],
        )


@dataclass(frozen=True)
class Replica:
    id: str
    model: str
    state: ReplicaState
    created_at: float
    updated_at: float
    # The model's profile when it was placed (None: placed before llmgw recorded it).
    profile: str | None = None

    @classmethod
    def from_row(cls, row: Row) -> Replica:
        return cls(
            id=row["id"],
            model=row["model"],
            state=ReplicaState(row["state"]),
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            profile=row["profile"],
        )


@dataclass(frozen=True)
class Shard:
    id: str
    replica_id: str
    node_id: str
    rank: int
    state: ShardState
    port: int | None
    pid: int | None
    exit_code: int | None
    reason: str
    restarts: int
    op_id: str | None
    updated_at: float
    gpus: tuple[str, ...] = ()
    """UUIDs of the GPUs given to this shard."""
    dist_init_addr: str = ""
    """host:port where rank 0 of a multi-node replica waits for the other shards."""

    @classmethod
    def from_row(cls, row: Row) -> Shard:
        return cls(
            id=row["id"],
            replica_id=row["replica_id"],
            node_id=row["node_id"],
            rank=row["rank"],
            state=ShardState(row["state"]),
            port=row["port"],
            pid=row["pid"],
            exit_code=row["exit_code"],
            reason=row["reason"],
            restarts=row["restarts"],
            op_id=row["op_id"],
            updated_at=row["updated_at"],
            gpus=tuple(json.loads(row["gpus"])),
            dist_init_addr=row["dist_init_addr"],
        )


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    prefix: str
    hash: str
    created_at: float
    revoked_at: float | None
    policy: KeyPolicy = field(default_factory=KeyPolicy)
    updated_at: float | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_row(cls, row: Row) -> ApiKey:
        tokens, period = row["budget_tokens"], row["budget_period"]
        return cls(
            id=row["id"],
            name=row["name"],
            prefix=row["prefix"],
            hash=row["hash"],
            created_at=row["created_at"],
            revoked_at=row["revoked_at"],
            policy=KeyPolicy(
                models=tuple(json.loads(row["models"])),
                rpm=row["rpm"],
                tpm=row["tpm"],
                max_concurrent=row["max_concurrent"],
                budget=None if tokens is None or period is None else Budget(tokens, period),
                priority=row["priority"],
                expires_at=row["expires_at"],
            ),
            updated_at=row["updated_at"],
        )


def policy_columns(policy: KeyPolicy) -> dict[str, Any]:
    """The api_keys columns that hold *policy*, by name."""
    budget = policy.budget
    return {
        "models": json.dumps(list(policy.models), separators=(",", ":")),
        "rpm": policy.rpm,
        "tpm": policy.tpm,
        "max_concurrent": policy.max_concurrent,
        "budget_tokens": None if budget is None else budget.tokens,
        "budget_period": None if budget is None else budget.period,
        "priority": policy.priority,
        "expires_at": policy.expires_at,
    }


def usage_from_row(row: Row) -> UsageRow:
    """A usage row, its key's name from the ``key_name`` column a join adds ('' without)."""
    keys = row.keys()
    return UsageRow(
        day=str(row["day"]),
        key_id=str(row["key_id"]),
        model=str(row["model"]),
        requests=int(row["requests"]),
        prompt_tokens=int(row["prompt_tokens"]),
        completion_tokens=int(row["completion_tokens"]),
        cached_tokens=int(row["cached_tokens"]),
        errors=int(row["errors"]),
        key_name=str(row["key_name"] or "") if "key_name" in keys else "",
    )


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    subject: str
    message: str
    actor: str = ""
    """Who took the action: an operator's name, ``token`` (the admin token), or '' (the
    control plane itself)."""

    @classmethod
    def from_row(cls, row: Row) -> Event:
        return cls(
            id=row["id"],
            ts=row["ts"],
            kind=row["kind"],
            subject=row["subject"],
            message=row["message"],
            actor=row["actor"],
        )


OPERATOR_ROLES = ("admin", "viewer")
"""An operator's roles: an admin changes the cluster, a viewer only reads it."""
_OPERATOR_NAME = re.compile(r"[a-z][a-z0-9._-]{0,63}")


def check_operator_name(name: str) -> str:
    """*name* when it is an operator's name; ValueError giving the rule otherwise."""
    if not isinstance(name, str) or _OPERATOR_NAME.fullmatch(name) is None:
        raise ValueError(
            f"bad operator name {name!r}: 1 to 64 characters of a-z, 0-9, '.', '_' and '-', "
            "starting with a letter"
        )
    return name


@dataclass(frozen=True)
class Operator:
    """An operator account; ``password_hash`` is scrypt's (:mod:`llmgw.server.passwords`)."""

    id: int
    name: str
    role: str
    password_hash: str = field(repr=False)
    created_at: float
    created_by: str
    password_changed_at: float
    removed_at: float | None

    @classmethod
    def from_row(cls, row: Row) -> Operator:
        return cls(
            id=row["id"],
            name=row["name"],
            role=row["role"],
            password_hash=row["password_hash"],
            created_at=row["created_at"],
            created_by=row["created_by"],
            password_changed_at=row["password_changed_at"],
            removed_at=row["removed_at"],
        )


LOGIN_KINDS = ("console", "cli")
"""A login session's kinds: a console cookie, or an ``llmgw ctl login`` token."""


@dataclass(frozen=True)
class StoredLogin:
    """A login session as stored (by its token's hash), with its account as it is now:
    ``operator`` and ``role`` are read from the operators row with the session, and
    ``active`` is False once that account was removed."""

    token_hash: str = field(repr=False)
    operator_id: int
    operator: str
    role: str
    active: bool
    kind: str
    csrf: str = field(repr=False)
    created_at: float
    seen_at: float
    expires_at: float
    addr: str
    agent: str

    @classmethod
    def from_row(cls, row: Row) -> StoredLogin:
        return cls(
            token_hash=row["token_hash"],
            operator_id=row["operator_id"],
            operator=row["name"],
            role=row["role"],
            active=row["removed_at"] is None,
            kind=row["kind"],
            csrf=row["csrf"],
            created_at=row["created_at"],
            seen_at=row["seen_at"],
            expires_at=row["expires_at"],
            addr=row["addr"],
            agent=row["agent"],
        )


@dataclass(frozen=True)
class Certificate:
    """A certificate issued to a node, by serial (lowercase hex)."""

    serial: str
    node_id: str
    fingerprint: str
    not_before: float
    not_after: float
    issued_at: float
    revoked_at: float | None
    reason: str

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def from_row(cls, row: Row) -> Certificate:
        return cls(
            serial=row["serial"],
            node_id=row["node_id"],
            fingerprint=row["fingerprint"],
            not_before=row["not_before"],
            not_after=row["not_after"],
            issued_at=row["issued_at"],
            revoked_at=row["revoked_at"],
            reason=row["reason"],
        )


def join_token_from_row(row: Row, as_of: float) -> JoinToken:
    """A join token row, read at *as_of* (the store's clock), as a :class:`JoinToken`."""
    return JoinToken(
        id=row["id"],
        hash=row["hash"],
        prefix=row["prefix"],
        node_id=row["node_id"],
        kind=TokenKind(row["kind"]),
        node_uid=row["node_uid"],
        require_approval=bool(row["require_approval"]),
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        used_at=row["used_at"],
        revoked_at=row["revoked_at"],
        lost_state=bool(row["lost_state"]),
        auto_approve=bool(row["auto_approve"]),
        approved_fingerprint=row["approved_fingerprint"],
        as_of=as_of,
    )


_State = TypeVar("_State", bound=enum.StrEnum)


def check_state(state: str, states: type[_State], what: str) -> _State:
    """*state* as a member of *states*; ValueError names the states there are."""
    try:
        return states(state)
    except ValueError:
        names = ", ".join(sorted(member.value for member in states))
        raise ValueError(f"{state!r} is not a {what} state; use one of {names}") from None


def dump_json(value: dict[str, Any], what: str) -> str:
    """A mapping as the JSON a column holds (keys sorted, no spaces)."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a mapping, not {type(value).__name__}")
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable: {exc}") from exc
