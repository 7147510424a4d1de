"""The rows of the state store: one frozen dataclass per table, built from a row, and
the checks a value passes before it is written to a column.

(A join token's row is :class:`llmgw.server.store.tokens.JoinToken`, with the rules of its use.)
They are plain values: the store reads them, callers compare and pass them around, and
nothing writes through them. State columns come back as the enums of
:mod:`llmgw.server.store.states`, which equal their strings.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self, TypeVar

from llmgw.contracts.catalog import DEFAULT_PROFILE
from llmgw.contracts.keypolicy import Budget, KeyPolicy, UsageRow
from llmgw.server.store.database import Row
from llmgw.server.store.states import InstallState, NodeState, ReplicaState, ShardState, TokenKind
from llmgw.server.store.tokens import JoinToken

__all__ = [
    "DEFAULT_PROFILE",
    "LOGIN_KINDS",
    "OPERATOR_ROLES",
    "ApiKey",
    "Certificate",
    "DesiredBuild",
    "Event",
    "FromRow",
    "Model",
    "Node",
    "NodeEngine",
    "NodeUpdate",
    "Operator",
    "Replica",
    "RowMap",
    "Shard",
    "StoredLogin",
    "check_operator_name",
    "check_state",
    "dump_json",
    "join_token_from_row",
    "optional_bytes",
    "policy_columns",
    "row_to",
    "usage_from_row",
]


# ------------------------------------------------------------------------ row -> dataclass


@dataclass(frozen=True, eq=False)
class RowMap:
    """How a row becomes a dataclass: each field from the column of its name, unless
    ``columns`` names another; through ``convert``'s function of that column's value where
    there is one; a field made of several columns by ``derived``'s function of the row."""

    convert: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    columns: Mapping[str, str] = field(default_factory=dict)
    derived: Mapping[str, Callable[[Row], Any]] = field(default_factory=dict)


_Readers = tuple[tuple[str, Callable[[Row], Any]], ...]
_PLANS: dict[tuple[type, RowMap], _Readers] = {}


def _column(name: str, convert: Callable[[Any], Any] | None) -> Callable[[Row], Any]:
    if convert is None:
        return lambda row: row[name]
    return lambda row: convert(row[name])


def _plan(cls: type, rows: RowMap) -> _Readers:
    """One reader per field of ``cls`` (made once per class and map: rows are read often)."""
    key = (cls, rows)
    plan = _PLANS.get(key)
    if plan is None:
        plan = tuple(
            (
                f.name,
                rows.derived.get(f.name)
                or _column(rows.columns.get(f.name, f.name), rows.convert.get(f.name)),
            )
            for f in fields(cls)
            if f.init
        )
        _PLANS[key] = plan
    return plan


_T = TypeVar("_T")


def row_to(cls: type[_T], row: Row, rows: RowMap, **given: Any) -> _T:
    """``row`` as a ``cls`` (a dataclass) by the map ``rows``; ``given`` fields are taken as
    they are, not read from the row."""
    values = {name: read(row) for name, read in _plan(cls, rows) if name not in given}
    return cls(**values, **given)


class FromRow:
    """A row type read by its :data:`ROW` map: ``Type.from_row(row)``."""

    ROW: ClassVar[RowMap] = RowMap()

    @classmethod
    def from_row(cls, row: Row) -> Self:
        return row_to(cls, row, cls.ROW)


def optional_bytes(value: Any) -> bytes | None:
    """A BLOB column that may be NULL (the drivers hand out memoryview or bytes)."""
    return None if value is None else bytes(value)


@dataclass(frozen=True)
class Node(FromRow):
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

    ROW: ClassVar[RowMap] = RowMap(
        convert={
            "state": NodeState,
            "connected": bool,
            "inventory": json.loads,
            "draining": bool,
            "lost": bool,
        }
    )

    @classmethod
    def from_row(cls, row: Row, inventory: dict[str, Any] | None = None) -> Node:
        """The row as a Node; ``inventory``, when given, is the row's inventory already
        parsed (llmgw.server.store.nodes keeps them: shared, never to be changed)."""
        if inventory is None:
            return row_to(cls, row, cls.ROW)
        return row_to(cls, row, cls.ROW, inventory=inventory)


@dataclass(frozen=True)
class NodeUpdate(FromRow):
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

    ROW: ClassVar[RowMap] = RowMap(
        convert={"counter": int, "order": optional_bytes, "signature": optional_bytes},
        columns={"order": "order_json"},
    )


@dataclass(frozen=True)
class DesiredBuild(FromRow):
    """One architecture's build of an engine desired for a scope."""

    scope: str
    engine: str
    version: str
    arch: str  # "" runs on any architecture
    url: str
    sha256: str
    updated_at: float

    ROW: ClassVar[RowMap] = RowMap()


@dataclass(frozen=True)
class NodeEngine(FromRow):
    """The install of a desired engine build on one node: the last one ordered there."""

    node_id: str
    engine: str
    version: str
    sha256: str
    state: InstallState
    error: str
    op_id: str
    updated_at: float

    ROW: ClassVar[RowMap] = RowMap(convert={"state": InstallState})


@dataclass(frozen=True)
class Model(FromRow):
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
    # The scaling policy's JSON (llmgw.contracts.scaling); {} for a fixed count.
    scaling: dict[str, Any] = field(default_factory=dict)

    ROW: ClassVar[RowMap] = RowMap(
        convert={"params": json.loads, "profiles": json.loads, "scaling": json.loads}
    )


@dataclass(frozen=True)
class Replica(FromRow):
    id: str
    model: str
    state: ReplicaState
    created_at: float
    updated_at: float
    # The model's profile when it was placed (None: placed before llmgw recorded it).
    profile: str | None = None

    ROW: ClassVar[RowMap] = RowMap(convert={"state": ReplicaState})


@dataclass(frozen=True)
class Shard(FromRow):
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
    sleep_level: int = 0
    """Asleep (or falling asleep, waking): the level its engine sleeps at."""
    host_memory_mib: int = 0
    """Asleep: the host memory its engine says it holds (the weights, at level 1)."""

    ROW: ClassVar[RowMap] = RowMap(
        convert={"state": ShardState, "gpus": lambda value: tuple(json.loads(value))}
    )


def _policy_from_row(row: Row) -> KeyPolicy:
    tokens, period = row["budget_tokens"], row["budget_period"]
    return KeyPolicy(
        models=tuple(json.loads(row["models"])),
        rpm=row["rpm"],
        tpm=row["tpm"],
        max_concurrent=row["max_concurrent"],
        budget=None if tokens is None or period is None else Budget(tokens, period),
        priority=row["priority"],
        expires_at=row["expires_at"],
        resume=bool(row["resume"]),
    )


@dataclass(frozen=True)
class ApiKey(FromRow):
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

    ROW: ClassVar[RowMap] = RowMap(derived={"policy": _policy_from_row})


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
        "resume": int(policy.resume),
    }


_USAGE_ROW = RowMap(
    convert={
        "day": str,
        "key_id": str,
        "model": str,
        "requests": int,
        "prompt_tokens": int,
        "completion_tokens": int,
        "cached_tokens": int,
        "errors": int,
    },
    derived={
        "key_name": lambda row: str(row["key_name"] or "") if "key_name" in row.keys() else ""
    },
)


def usage_from_row(row: Row) -> UsageRow:
    """A usage row, its key's name from the ``key_name`` column a join adds ('' without)."""
    return row_to(UsageRow, row, _USAGE_ROW)


@dataclass(frozen=True)
class Event(FromRow):
    id: int
    ts: float
    kind: str
    subject: str
    message: str
    actor: str = ""
    """Who took the action: an operator's name, ``token`` (the admin token), or '' (the
    control plane itself)."""

    ROW: ClassVar[RowMap] = RowMap()


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
class Operator(FromRow):
    """An operator account; ``password_hash`` is scrypt's (:mod:`llmgw.server.accounts.passwords`)."""

    id: int
    name: str
    role: str
    password_hash: str = field(repr=False)
    created_at: float
    created_by: str
    password_changed_at: float
    removed_at: float | None

    ROW: ClassVar[RowMap] = RowMap()


LOGIN_KINDS = ("console", "cli")
"""A login session's kinds: a console cookie, or an ``llmgw ctl login`` token."""


@dataclass(frozen=True)
class StoredLogin(FromRow):
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

    ROW: ClassVar[RowMap] = RowMap(
        columns={"operator": "name"},
        derived={"active": lambda row: row["removed_at"] is None},
    )


@dataclass(frozen=True)
class Certificate(FromRow):
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

    ROW: ClassVar[RowMap] = RowMap()


_JOIN_TOKEN_ROW = RowMap(
    convert={
        "kind": TokenKind,
        "require_approval": bool,
        "lost_state": bool,
        "auto_approve": bool,
    }
)


def join_token_from_row(row: Row, as_of: float) -> JoinToken:
    """A join token row, read at *as_of* (the store's clock), as a :class:`JoinToken`."""
    return row_to(JoinToken, row, _JOIN_TOKEN_ROW, as_of=as_of)


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
