"""The control plane's state store: nodes, models, replicas, shards, API keys, events, join
tokens and the certificates issued to nodes.

One SQLite file in WAL mode, schema upgraded by versioned migrations on open; every
sqlite3 error leaves this module as a :class:`~llmgw.errors.StoreError` that says what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import secrets
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmgw.errors import Conflict, NotFound, StoreError, TokenError
from llmgw.netaddr import validate_node_id

__all__ = [
    "DEFAULT_PROFILE",
    "JOIN_TOKEN_KINDS",
    "JOIN_TOKEN_PREFIX",
    "MAX_EVENTS",
    "MIGRATIONS",
    "MODEL_REPLICA_STATES",
    "NODE_STATES",
    "SHARD_FIELDS",
    "SHARD_STATES",
    "ApiKey",
    "Certificate",
    "Event",
    "JoinToken",
    "Model",
    "Node",
    "NodeUpdate",
    "Replica",
    "Shard",
    "Store",
    "hash_api_key",
]

NODE_STATES: frozenset[str] = frozenset({"pending", "approved", "revoked"})
MODEL_REPLICA_STATES: frozenset[str] = frozenset(
    {"pending", "starting", "ready", "failed", "stopping"}
)
SHARD_STATES: frozenset[str] = frozenset(
    {"pending", "starting", "ready", "failed", "exited", "stopping", "stopped"}
)
SHARD_FIELDS: frozenset[str] = frozenset(
    {"state", "port", "pid", "exit_code", "reason", "restarts", "op_id", "gpus", "dist_init_addr"}
)

MAX_EVENTS = 10_000
"""Events kept; older ones are trimmed every :attr:`Store.event_trim_every` inserts."""
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Characters of kind, subject and message kept over all events (trimmed with the count)."""
MAX_EVENT_MESSAGE = 1000
"""Characters of one event's message; a longer one is cut (ending in '…')."""
MAX_EVENT_SUBJECT = 255

API_KEY_PREFIX = "sk-llmgw-"
JOIN_TOKEN_PREFIX = "llmgwjt_"
JOIN_TOKEN_KINDS: frozenset[str] = frozenset({"join", "rekey"})
DEFAULT_PROFILE = "default"
"""The profile a model deploys when none is named (the column's default)."""

MIGRATIONS: list[str] = [
    # 1: initial schema
    """
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );

    CREATE TABLE nodes (
        id             TEXT PRIMARY KEY,
        uid            TEXT NOT NULL UNIQUE,
        state          TEXT NOT NULL DEFAULT 'approved'
                       CHECK (state IN ('pending', 'approved', 'revoked')),
        connected      INTEGER NOT NULL DEFAULT 0,
        dataplane_addr TEXT,
        agent_version  TEXT,
        inventory      TEXT NOT NULL DEFAULT '{}',
        fingerprint    TEXT,
        draining       INTEGER NOT NULL DEFAULT 0,
        last_seen      REAL,
        created_at     REAL NOT NULL
    );

    CREATE TABLE models (
        name       TEXT PRIMARY KEY,
        engine     TEXT NOT NULL,
        params     TEXT NOT NULL DEFAULT '{}',
        replicas   INTEGER NOT NULL CHECK (replicas >= 0),
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );

    CREATE TABLE replicas (
        id         TEXT PRIMARY KEY,
        model      TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
        state      TEXT NOT NULL
                   CHECK (state IN ('pending', 'starting', 'ready', 'failed', 'stopping')),
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX replicas_by_model ON replicas(model);

    CREATE TABLE shards (
        id         TEXT PRIMARY KEY,
        replica_id TEXT NOT NULL REFERENCES replicas(id) ON DELETE CASCADE,
        node_id    TEXT NOT NULL REFERENCES nodes(id),
        rank       INTEGER NOT NULL DEFAULT 0,
        state      TEXT NOT NULL
                   CHECK (state IN ('pending', 'starting', 'ready', 'failed',
                                    'exited', 'stopping', 'stopped')),
        port       INTEGER,
        pid        INTEGER,
        exit_code  INTEGER,
        reason     TEXT NOT NULL DEFAULT '',
        restarts   INTEGER NOT NULL DEFAULT 0,
        op_id      TEXT,
        updated_at REAL NOT NULL
    );
    CREATE INDEX shards_by_node ON shards(node_id);
    CREATE UNIQUE INDEX shards_by_replica ON shards(replica_id, rank);

    CREATE TABLE api_keys (
        id         TEXT PRIMARY KEY,
        name       TEXT NOT NULL,
        prefix     TEXT NOT NULL,
        hash       TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        revoked_at REAL
    );
    CREATE INDEX api_keys_by_prefix ON api_keys(prefix);

    CREATE TABLE events (
        id      INTEGER PRIMARY KEY AUTOINCREMENT,
        ts      REAL NOT NULL,
        kind    TEXT NOT NULL,
        subject TEXT NOT NULL,
        message TEXT NOT NULL
    );
    CREATE INDEX events_by_subject ON events(subject, id);
    """,
    # 2: join tokens and the certificates issued to nodes (kept after a node is deleted, so
    # the serials of a removed node stay refused)
    """
    CREATE TABLE join_tokens (
        id               TEXT PRIMARY KEY,
        hash             TEXT NOT NULL UNIQUE,
        prefix           TEXT NOT NULL,
        node_id          TEXT NOT NULL,
        kind             TEXT NOT NULL CHECK (kind IN ('join', 'rekey')),
        node_uid         TEXT,
        require_approval INTEGER NOT NULL DEFAULT 0,
        created_at       REAL NOT NULL,
        expires_at       REAL NOT NULL,
        used_at          REAL,
        revoked_at       REAL
    );
    CREATE INDEX join_tokens_by_prefix ON join_tokens(prefix);

    CREATE TABLE certificates (
        serial      TEXT PRIMARY KEY,
        node_id     TEXT NOT NULL,
        fingerprint TEXT NOT NULL,
        not_before  REAL NOT NULL,
        not_after   REAL NOT NULL,
        issued_at   REAL NOT NULL,
        revoked_at  REAL,
        reason      TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX certificates_by_node ON certificates(node_id);
    """,
    # 3: the catalog (a model's profiles and the one deployed), the GPUs and rendezvous
    # address given to each shard, and nodes lost (silent past the loss timeout)
    """
    ALTER TABLE models ADD COLUMN profiles TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE models ADD COLUMN profile TEXT NOT NULL DEFAULT 'default';
    ALTER TABLE shards ADD COLUMN gpus TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE shards ADD COLUMN dist_init_addr TEXT NOT NULL DEFAULT '';
    ALTER TABLE nodes ADD COLUMN lost INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE nodes ADD COLUMN lost_at REAL;
    """,
    # 4: signed self-updates: each node's last update order (its counter only ever grows,
    # and the row outlives the node, so a node joined again under the same id is never sent
    # a counter its update helper already accepted) and the status the node reported
    """
    CREATE TABLE node_updates (
        node_id    TEXT PRIMARY KEY,
        counter    INTEGER NOT NULL CHECK (counter >= 0),
        version    TEXT NOT NULL DEFAULT '',
        state      TEXT NOT NULL DEFAULT '',
        message    TEXT NOT NULL DEFAULT '',
        op_id      TEXT NOT NULL DEFAULT '',
        order_json BLOB,
        signature  BLOB,
        expires    REAL,
        ordered_at REAL,
        updated_at REAL NOT NULL
    );
    """,
    # 5: the profile each replica was placed with, so that a switch of the model's profile
    # replaces the others one at a time (NULL: placed before this column; left alone)
    """
    ALTER TABLE replicas ADD COLUMN profile TEXT;
    """,
]


# --------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Node:
    id: str
    uid: str
    state: str
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
    def _from_row(cls, row: sqlite3.Row) -> Node:
        return cls(
            id=row["id"],
            uid=row["uid"],
            state=row["state"],
            connected=bool(row["connected"]),
            dataplane_addr=row["dataplane_addr"],
            agent_version=row["agent_version"],
            inventory=json.loads(row["inventory"]),
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
    def _from_row(cls, row: sqlite3.Row) -> NodeUpdate:
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
    profile: str = "default"

    @classmethod
    def _from_row(cls, row: sqlite3.Row) -> Model:
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
    state: str
    created_at: float
    updated_at: float
    # The model's profile when it was placed (None: placed before llmgw recorded it).
    profile: str | None = None

    @classmethod
    def _from_row(cls, row: sqlite3.Row) -> Replica:
        return cls(
            id=row["id"],
            model=row["model"],
            state=row["state"],
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
    state: str
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
    def _from_row(cls, row: sqlite3.Row) -> Shard:
        return cls(
            id=row["id"],
            replica_id=row["replica_id"],
            node_id=row["node_id"],
            rank=row["rank"],
            state=row["state"],
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

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @classmethod
    def _from_row(cls, row: sqlite3.Row) -> ApiKey:
        return cls(
            id=row["id"],
            name=row["name"],
            prefix=row["prefix"],
            hash=row["hash"],
            created_at=row["created_at"],
            revoked_at=row["revoked_at"],
        )


@dataclass(frozen=True)
class Event:
    id: int
    ts: float
    kind: str
    subject: str
    message: str

    @classmethod
    def _from_row(cls, row: sqlite3.Row) -> Event:
        return cls(
            id=row["id"],
            ts=row["ts"],
            kind=row["kind"],
            subject=row["subject"],
            message=row["message"],
        )


@dataclass(frozen=True)
class JoinToken:
    """A one-time token that lets one node join (or rekey); only its hash is stored.

    ``as_of`` is the store's clock when the row was read; :attr:`active` is judged at it.
    """

    id: str
    hash: str
    prefix: str
    node_id: str
    kind: str
    node_uid: str | None
    require_approval: bool
    created_at: float
    expires_at: float
    used_at: float | None
    revoked_at: float | None
    as_of: float = field(default=0.0, compare=False, repr=False)

    @property
    def used(self) -> bool:
        return self.used_at is not None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def expired(self) -> bool:
        return self.expires_at <= self.as_of

    @property
    def active(self) -> bool:
        """Neither used, nor revoked, nor expired when it was read."""
        return not (self.used or self.revoked or self.expired)

    @classmethod
    def _from_row(cls, row: sqlite3.Row, as_of: float) -> JoinToken:
        return cls(
            id=row["id"],
            hash=row["hash"],
            prefix=row["prefix"],
            node_id=row["node_id"],
            kind=row["kind"],
            node_uid=row["node_uid"],
            require_approval=bool(row["require_approval"]),
            created_at=row["created_at"],
            expires_at=row["expires_at"],
            used_at=row["used_at"],
            revoked_at=row["revoked_at"],
            as_of=as_of,
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
    def _from_row(cls, row: sqlite3.Row) -> Certificate:
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


# --------------------------------------------------------------------------- helpers


def hash_api_key(secret: str) -> str:
    """The hex SHA-256 of an API key secret, as stored and as the gateway caches it."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def _hash_token(secret: str) -> str:
    # surrogatepass: a secret that came out of JSON may hold lone surrogates; it matches nothing.
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def _normal_serial(serial: str) -> str:
    try:
        return format(int(serial, 16), "x")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"certificate serial {serial!r} is not a hex number") from exc


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ts))


def _mint_hint(token: JoinToken) -> str:
    if token.kind == "rekey":
        return (
            f"mint a new rekey token for {token.node_id}, or join it afresh with "
            f"'llmgw ctl join-command --node {token.node_id}'"
        )
    return f"mint a new one with 'llmgw ctl join-command --node {token.node_id}'"


def _token_used(token: JoinToken, used_at: float | None) -> TokenError:
    when = f" at {_when(used_at)}" if used_at is not None else ""
    return TokenError(
        f"{token.kind} token {token.id} for {token.node_id} was already used{when}; a token "
        f"works once; {_mint_hint(token)}",
        code="token_used",
    )


def _check_token(token: JoinToken, *, node_id: str, kind: str, node_uid: str | None) -> None:
    """Raise the TokenError that refuses *token* for this use, if any."""
    if token.revoked_at is not None:
        raise TokenError(
            f"{token.kind} token {token.id} for {token.node_id} was revoked at "
            f"{_when(token.revoked_at)}; {_mint_hint(token)}",
            code="token_revoked",
        )
    if token.used_at is not None:
        raise _token_used(token, token.used_at)
    if token.expired:
        ago = token.as_of - token.expires_at
        raise TokenError(
            f"{token.kind} token {token.id} for {token.node_id} expired at "
            f"{_when(token.expires_at)} ({_ago(ago)} ago); {_mint_hint(token)}",
            code="token_expired",
        )
    if token.node_id != node_id:
        raise TokenError(
            f"{token.kind} token {token.id} is for node {token.node_id}, not {node_id}; join as "
            f"{token.node_id} (--node-id {token.node_id}), or mint a token for {node_id} with "
            f"'llmgw ctl join-command --node {node_id}'",
            code="token_wrong_node",
        )
    if token.kind != kind:
        if token.kind == "rekey":
            message = f"this is a rekey token for {token.node_id}; run 'llmgw agent join --rekey'"
        else:
            message = (
                f"this is a join token for {token.node_id}, not a rekey token; run "
                "'llmgw agent join' without --rekey"
            )
        raise TokenError(message, code="token_wrong_kind")
    if kind == "rekey" and token.node_uid != node_uid:
        raise TokenError(
            f"rekey token {token.id} is bound to {token.node_id} with uid {token.node_uid}, but "
            f"this node has uid {node_uid or '(none)'}; the node joined afresh since the token "
            f"was minted; {_mint_hint(token)}",
            code="node_uid_mismatch",
        )


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _dump_json(value: dict[str, Any], what: str) -> str:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a mapping, not {type(value).__name__}")
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serialisable: {exc}") from exc


def _check_replicas(name: str, replicas: object) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise Conflict(
            f"model {name}: replicas must be a whole number of 0 or more, not {replicas!r}"
        )


def _check_profiles(name: str, profiles: object) -> None:
    if not isinstance(profiles, dict) or not profiles:
        raise ValueError(f"model {name}: profiles must be a non-empty mapping, not {profiles!r}")
    for profile, spec in profiles.items():
        if (
            not isinstance(profile, str)
            or not isinstance(spec, dict)
            or not isinstance(spec.get("engine"), str)
        ):
            raise ValueError(
                f"model {name}: profile {profile!r} must be a mapping with an engine, not {spec!r}"
            )


def _first_profile(profiles: dict[str, Any]) -> str:
    return DEFAULT_PROFILE if DEFAULT_PROFILE in profiles else next(iter(profiles))


def _profile_columns(profile: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The engine and params columns for a deployed profile: its params, and its args as
    ``extra_args`` (what starting a shard reads)."""
    params: dict[str, Any] = dict(profile.get("params") or {})
    args = list(profile.get("args") or [])
    if args:
        params["extra_args"] = args
    return str(profile["engine"]), params


def _check_state(state: str, allowed: frozenset[str], what: str) -> None:
    if state not in allowed:
        raise ValueError(
            f"{state!r} is not a {what} state; use one of {', '.join(sorted(allowed))}"
        )


def _split_sql(script: str) -> list[str]:
    """Split a migration script into complete statements (triggers included)."""
    statements: list[str] = []
    buf = ""
    for line in script.splitlines(keepends=True):
        buf += line
        if sqlite3.complete_statement(buf):
            if buf.strip():
                statements.append(buf.strip())
            buf = ""
    if buf.strip():
        raise ValueError(f"migration ends in an incomplete statement: {buf.strip()[:80]!r}")
    return statements


_TABLE_NOUNS = {
    "meta": "meta entry",
    "nodes": "node",
    "models": "model",
    "replicas": "replica",
    "shards": "shard",
    "api_keys": "API key",
    "events": "event",
    "join_tokens": "join token",
    "certificates": "certificate",
}

_CONSTRAINT_RE = re.compile(r"(UNIQUE|NOT NULL) constraint failed: (\w+)\.(\w+)")


def _integrity_message(exc: sqlite3.IntegrityError) -> str:
    text = str(exc)
    m = _CONSTRAINT_RE.search(text)
    if m:
        kind, table, column = m.groups()
        noun = _TABLE_NOUNS.get(table, table)
        if kind == "UNIQUE":
            return f"a {noun} with this {column} already exists; choose another {column}"
        return f"a {noun} needs a {column}; give one"
    if "FOREIGN KEY" in text:
        return (
            "the change refers to a node, model or replica that does not exist, or removes one "
            "that is still in use; check the 'llmgw ctl' listings and retry"
        )
    if "CHECK" in text:
        return f"a value is out of range ({text}); correct it and retry"
    return f"the change contradicts what is stored ({text})"


# --------------------------------------------------------------------------- store


class Store:
    """The state database. Open with :meth:`Store.open`; use from one thread.

    Single methods commit on their own; wrap multi-step changes in :meth:`transaction`.
    Never ``await`` inside a transaction: other coroutines would write into it.
    """

    event_trim_every: int = 100
    """Insertions between two trims of the events table."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: str,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._conn: sqlite3.Connection | None = conn
        self.path = path
        self._clock = clock
        self._depth = 0
        self._events_since_trim = self.event_trim_every  # trim on the first insert
        self.max_events = MAX_EVENTS
        self.max_event_bytes = MAX_EVENT_BYTES

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    def open(cls, path: Path | str, *, clock: Callable[[], float] = time.time) -> Store:
        """Open (creating if needed, mode 0600) and migrate the database at *path*."""
        spath = str(path)
        if spath != ":memory:":
            _create_file(Path(spath))
        try:
            conn = sqlite3.connect(
                spath, timeout=5.0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise _translate(exc, spath) from exc
        conn.row_factory = sqlite3.Row
        store = cls(conn, spath, clock=clock)
        try:
            with store._guard():
                conn.execute("PRAGMA busy_timeout=5000")
                conn.execute("PRAGMA journal_mode=WAL").fetchone()
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA foreign_keys=ON")
            store.migrate()
        except BaseException:
            conn.close()
            raise
        return store

    def close(self) -> None:
        """Close the database; later calls raise :class:`StoreError`."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def schema_version(self) -> int:
        with self._guard():
            return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def journal_mode(self) -> str:
        with self._guard():
            return str(self._db.execute("PRAGMA journal_mode").fetchone()[0])

    def migrate(self) -> int:
        """Apply the missing migrations, one transaction each; return the schema version."""
        known = len(MIGRATIONS)
        current = self.schema_version()
        if current > known:
            raise StoreError(
                f"state database {self.path} has schema version {current}, newer than this "
                f"llmgw ({known}); upgrade llmgw or restore a backup"
            )
        for version in range(current + 1, known + 1):
            with self._write():
                # Another process may have migrated between our read and BEGIN IMMEDIATE.
                now = int(self._db.execute("PRAGMA user_version").fetchone()[0])
                if now >= version:
                    continue
                for statement in _split_sql(MIGRATIONS[version - 1]):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version={version}")
        return self.schema_version()

    # ------------------------------------------------------------ transactions

    @property
    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(
                f"state database {self.path} is closed; this is a bug in the caller, "
                "report it with the traceback"
            )
        return self._conn

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            if isinstance(exc, sqlite3.ProgrammingError | sqlite3.InterfaceError):
                raise
            raise _translate(exc, self.path) from exc

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Store]:
        """All changes inside commit together or not at all (nested ones use savepoints)."""
        with self._write():
            yield self

    @contextlib.contextmanager
    def _write(self) -> Iterator[Store]:
        db = self._db
        with self._guard():
            if self._depth == 0:
                db.execute("BEGIN IMMEDIATE")
                savepoint = None
            else:
                savepoint = f"sp{self._depth}"
                db.execute(f"SAVEPOINT {savepoint}")
        self._depth += 1
        try:
            with self._guard():
                yield self
        except BaseException:
            self._depth -= 1
            with contextlib.suppress(sqlite3.Error):
                if savepoint is None:
                    db.execute("ROLLBACK")
                else:
                    db.execute(f"ROLLBACK TO {savepoint}")
                    db.execute(f"RELEASE {savepoint}")
            raise
        self._depth -= 1
        with self._guard():
            if savepoint is None:
                try:
                    db.execute("COMMIT")
                except sqlite3.Error:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
            else:
                db.execute(f"RELEASE {savepoint}")

    def _one(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        with self._guard():
            row: sqlite3.Row | None = self._db.execute(sql, params).fetchone()
            return row

    def _all(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._guard():
            return list(self._db.execute(sql, params).fetchall())

    # --------------------------------------------------------------------- meta

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self._one("SELECT value FROM meta WHERE key = ?", (key,))
        return default if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        with self._write():
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def cluster_id(self) -> str:
        """This cluster's id: a random UUID made on first use and kept."""
        existing = self.get_meta("cluster_id")
        if existing is not None:
            return existing
        with self._write():
            self._db.execute(
                "INSERT OR IGNORE INTO meta(key, value) VALUES ('cluster_id', ?)",
                (str(uuid.uuid4()),),
            )
            row = self._db.execute("SELECT value FROM meta WHERE key = 'cluster_id'").fetchone()
        return str(row["value"])

    def epoch(self) -> int:
        """The control plane's current epoch (0 before the first :meth:`bump_epoch`)."""
        return int(self.get_meta("epoch", "0") or 0)

    def bump_epoch(self) -> int:
        """Atomically add one to the epoch and return the new value."""
        with self._write():
            row = self._db.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone()
            value = (int(row["value"]) if row is not None else 0) + 1
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES ('epoch', ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (str(value),),
            )
        return value

    # -------------------------------------------------------------------- nodes

    def upsert_node(
        self,
        node_id: str,
        *,
        dataplane_addr: str | None,
        agent_version: str | None,
        inventory: dict[str, Any],
        connected: bool,
    ) -> Node:
        """Record a node's latest report; new nodes get a fresh uid, known ones keep theirs."""
        inv = _dump_json(inventory, "node inventory")
        now = self._clock()
        uid = uuid.uuid4().hex
        values = (node_id, uid, int(connected), dataplane_addr, agent_version, inv, now, now)
        with self._write():
            self._db.execute(
                "INSERT INTO nodes(id, uid, connected, dataplane_addr, agent_version, inventory, "
                "last_seen, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT(id) DO UPDATE SET connected = excluded.connected, "
                "dataplane_addr = excluded.dataplane_addr, "
                "agent_version = excluded.agent_version, inventory = excluded.inventory, "
                "last_seen = excluded.last_seen",
                values,
            )
            return self.get_node(node_id)

    def _update_node(self, node_id: str, sql: str, params: tuple[Any, ...]) -> None:
        with self._write():
            cur = self._db.execute(f"UPDATE nodes SET {sql} WHERE id = ?", (*params, node_id))
            if cur.rowcount == 0:
                raise _no_node(node_id)

    def set_node_connected(self, node_id: str, connected: bool) -> None:
        self._update_node(node_id, "connected = ?", (int(connected),))

    def touch_node(self, node_id: str) -> None:
        self._update_node(node_id, "last_seen = ?", (self._clock(),))

    def set_node_state(self, node_id: str, state: str) -> None:
        """Set pending / approved / revoked; any other value is a ValueError."""
        _check_state(state, NODE_STATES, "node")
        self._update_node(node_id, "state = ?", (state,))

    def set_node_draining(self, node_id: str, draining: bool) -> None:
        self._update_node(node_id, "draining = ?", (int(draining),))

    def set_node_fingerprint(self, node_id: str, fingerprint: str | None) -> None:
        self._update_node(node_id, "fingerprint = ?", (fingerprint,))

    def set_node_lost(self, node_id: str, lost: bool) -> None:
        """Mark a node lost (``lost_at`` keeps when it was first found lost) or found again."""
        if lost:
            self._update_node(node_id, "lost = 1, lost_at = COALESCE(lost_at, ?)", (self._clock(),))
        else:
            self._update_node(node_id, "lost = 0, lost_at = NULL", ())

    def set_all_disconnected(self) -> None:
        """Mark every node disconnected (at server start, before any stream exists)."""
        with self._write():
            self._db.execute("UPDATE nodes SET connected = 0 WHERE connected != 0")

    def get_node(self, node_id: str) -> Node:
        row = self._one("SELECT * FROM nodes WHERE id = ?", (node_id,))
        if row is None:
            raise _no_node(node_id)
        return Node._from_row(row)

    def list_nodes(self) -> list[Node]:
        return [Node._from_row(r) for r in self._all("SELECT * FROM nodes ORDER BY id")]

    def delete_node(self, node_id: str) -> None:
        """Forget a node; refused while shards are placed on it."""
        with self._write():
            self.get_node(node_id)
            row = self._db.execute(
                "SELECT count(*) FROM shards WHERE node_id = ?", (node_id,)
            ).fetchone()
            if row[0]:
                raise Conflict(
                    f"node {node_id} still hosts {row[0]} shard(s); drain it and wait for its "
                    "replicas to move, or delete those models, then retry"
                )
            self._db.execute("DELETE FROM nodes WHERE id = ?", (node_id,))

    # ------------------------------------------------------------------- models

    def put_model(
        self,
        name: str,
        *,
        engine: str,
        params: dict[str, Any],
        replicas: int,
        profiles: dict[str, Any] | None = None,
    ) -> Model:
        """Create a model or replace its engine, params and replica count, deploying profile
        ``default``; its profiles become *profiles* (which must have ``default``), or none:
        then its engine and params are its only profile."""
        _check_replicas(name, replicas)
        blob = _dump_json(params, f"model {name} params")
        if profiles is not None:
            _check_profiles(name, profiles)
            if DEFAULT_PROFILE not in profiles:
                raise ValueError(f"model {name}: profiles must include {DEFAULT_PROFILE!r}")
        kept = _dump_json(profiles or {}, f"model {name} profiles")
        now = self._clock()
        with self._write():
            self._db.execute(
                "INSERT INTO models(name, engine, params, replicas, created_at, updated_at, "
                "profiles, profile) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE "
                "SET engine = excluded.engine, params = excluded.params, "
                "replicas = excluded.replicas, updated_at = excluded.updated_at, "
                "profiles = excluded.profiles, profile = excluded.profile",
                (name, engine, blob, replicas, now, now, kept, DEFAULT_PROFILE),
            )
            return self.get_model(name)

    def put_catalog_model(self, name: str, profiles: dict[str, Any]) -> Model:
        """Create a model from the catalog with 0 replicas, or replace its profiles keeping
        its replica count and deployed profile (whose engine and params are refreshed).

        A new model deploys ``default``, else its first profile. Refused with
        :class:`Conflict` when the change would pull the ground from under running
        replicas: their profile's engine changes, or their profile is dropped.
        """
        _check_profiles(name, profiles)
        blob = _dump_json(profiles, f"model {name} profiles")
        now = self._clock()
        with self._write():
            row = self._db.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone()
            if row is None:
                deployed = _first_profile(profiles)
                engine, params = _profile_columns(profiles[deployed])
                self._db.execute(
                    "INSERT INTO models(name, engine, params, replicas, created_at, updated_at, "
                    "profiles, profile) VALUES (?, ?, ?, 0, ?, ?, ?, ?)",
                    (name, engine, _dump_json(params, "params"), now, now, blob, deployed),
                )
                return self.get_model(name)
            model = Model._from_row(row)
            running = self._replica_count(name)
            deployed = model.profile
            if deployed not in profiles:
                if running or model.replicas:
                    raise Conflict(
                        f"model {name} has profile {deployed} deployed ({model.replicas} "
                        f"replicas wanted, {running} placed) and the new profiles "
                        f"({', '.join(sorted(profiles))}) drop it; keep profile {deployed}, "
                        f"or scale {name} to 0 first ('llmgw ctl deploy {name} --replicas 0')"
                    )
                deployed = _first_profile(profiles)
            engine, params = _profile_columns(profiles[deployed])
            if running and engine != model.engine:
                raise Conflict(
                    f"model {name} runs {running} replica(s) of profile {deployed} with engine "
                    f"{model.engine}, and the new profile {deployed} has engine {engine}; "
                    f"'llmgw ctl undeploy {name}' (or scale it to 0) first, or give engine "
                    f"{engine} another profile"
                )
            self._db.execute(
                "UPDATE models SET profiles = ?, profile = ?, engine = ?, params = ?, "
                "updated_at = ? WHERE name = ?",
                (blob, deployed, engine, _dump_json(params, "params"), now, name),
            )
            return self.get_model(name)

    def deploy_model(self, name: str, *, profile: str, replicas: int) -> Model:
        """Deploy *profile* of a model with *replicas* replicas: its engine and params become
        the profile's. :class:`NotFound` names the profiles there are. Replicas of another
        profile keep running; the scheduler replaces them one at a time."""
        _check_replicas(name, replicas)
        with self._write():
            model = self.get_model(name)
            if not model.profiles:
                if profile != DEFAULT_PROFILE:
                    raise NotFound(
                        f"model {name} has no profile {profile}: it was deployed without the "
                        f"catalog, with engine {model.engine} as its only profile "
                        f"({DEFAULT_PROFILE}); add it to the catalog with "
                        "'llmgw ctl models apply -f catalog.yaml'"
                    )
                engine, params = model.engine, model.params
            elif profile not in model.profiles:
                raise NotFound(
                    f"model {name} has no profile {profile}; its profiles: "
                    f"{', '.join(sorted(model.profiles))}"
                )
            else:
                engine, params = _profile_columns(model.profiles[profile])
            self._db.execute(
                "UPDATE models SET profile = ?, engine = ?, params = ?, replicas = ?, "
                "updated_at = ? WHERE name = ?",
                (
                    profile,
                    engine,
                    _dump_json(params, "params"),
                    replicas,
                    self._clock(),
                    name,
                ),
            )
            return self.get_model(name)

    def _replica_count(self, model: str) -> int:
        row = self._db.execute("SELECT count(*) FROM replicas WHERE model = ?", (model,)).fetchone()
        return int(row[0])

    def get_model(self, name: str) -> Model:
        row = self._one("SELECT * FROM models WHERE name = ?", (name,))
        if row is None:
            raise _no_model(name)
        return Model._from_row(row)

    def list_models(self) -> list[Model]:
        return [Model._from_row(r) for r in self._all("SELECT * FROM models ORDER BY name")]

    def delete_model(self, name: str) -> None:
        """Delete a model and, by cascade, its replicas and their shards."""
        with self._write():
            cur = self._db.execute("DELETE FROM models WHERE name = ?", (name,))
            if cur.rowcount == 0:
                raise _no_model(name)

    # ----------------------------------------------------------------- replicas

    def add_replica(self, model: str) -> Replica:
        """A new replica of *model*, state ``pending``, of the model's current profile."""
        now = self._clock()
        with self._write():
            profile = self.get_model(model).profile
            while True:
                replica_id = f"{model}-{secrets.token_hex(3)}"
                taken = self._db.execute(
                    "SELECT 1 FROM replicas WHERE id = ?", (replica_id,)
                ).fetchone()
                if taken is None:
                    break
            self._db.execute(
                "INSERT INTO replicas(id, model, state, created_at, updated_at, profile) "
                "VALUES (?, ?, 'pending', ?, ?, ?)",
                (replica_id, model, now, now, profile),
            )
            return self.get_replica(replica_id)

    def get_replica(self, replica_id: str) -> Replica:
        row = self._one("SELECT * FROM replicas WHERE id = ?", (replica_id,))
        if row is None:
            raise _no_replica(replica_id)
        return Replica._from_row(row)

    def list_replicas(self, model: str | None = None) -> list[Replica]:
        if model is None:
            rows = self._all("SELECT * FROM replicas ORDER BY model, created_at, id")
        else:
            rows = self._all(
                "SELECT * FROM replicas WHERE model = ? ORDER BY created_at, id", (model,)
            )
        return [Replica._from_row(r) for r in rows]

    def set_replica_state(self, replica_id: str, state: str) -> None:
        """Set pending / starting / ready / failed / stopping; other values are a ValueError."""
        _check_state(state, MODEL_REPLICA_STATES, "replica")
        with self._write():
            cur = self._db.execute(
                "UPDATE replicas SET state = ?, updated_at = ? WHERE id = ?",
                (state, self._clock(), replica_id),
            )
            if cur.rowcount == 0:
                raise _no_replica(replica_id)

    def delete_replica(self, replica_id: str) -> None:
        """Delete a replica and, by cascade, its shards."""
        with self._write():
            cur = self._db.execute("DELETE FROM replicas WHERE id = ?", (replica_id,))
            if cur.rowcount == 0:
                raise _no_replica(replica_id)

    # ------------------------------------------------------------------- shards

    def add_shard(self, replica_id: str, node_id: str, *, rank: int = 0) -> Shard:
        """Place rank *rank* of a replica on a node; id ``<replica>-s<rank>``, state pending."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"shard rank must be a whole number of 0 or more, not {rank!r}")
        shard_id = f"{replica_id}-s{rank}"
        with self._write():
            self.get_replica(replica_id)
            self.get_node(node_id)
            taken = self._db.execute("SELECT 1 FROM shards WHERE id = ?", (shard_id,)).fetchone()
            if taken is not None:
                raise Conflict(
                    f"replica {replica_id} already has a shard of rank {rank}; "
                    f"delete shard {shard_id} first"
                )
            self._db.execute(
                "INSERT INTO shards(id, replica_id, node_id, rank, state, updated_at) "
                "VALUES (?, ?, ?, ?, 'pending', ?)",
                (shard_id, replica_id, node_id, rank, self._clock()),
            )
            return self.get_shard(shard_id)

    def get_shard(self, shard_id: str) -> Shard:
        row = self._one("SELECT * FROM shards WHERE id = ?", (shard_id,))
        if row is None:
            raise _no_shard(shard_id)
        return Shard._from_row(row)

    def list_shards(
        self, *, node_id: str | None = None, replica_id: str | None = None
    ) -> list[Shard]:
        where: list[str] = []
        params: list[Any] = []
        if node_id is not None:
            where.append("node_id = ?")
            params.append(node_id)
        if replica_id is not None:
            where.append("replica_id = ?")
            params.append(replica_id)
        sql = "SELECT * FROM shards"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY replica_id, rank"
        return [Shard._from_row(r) for r in self._all(sql, tuple(params))]

    def update_shard(self, shard_id: str, **fields: Any) -> Shard:
        """Set any of state, port, pid, exit_code, reason, restarts, op_id, gpus (a list of
        GPU uuids), dist_init_addr; return the row."""
        unknown = set(fields) - SHARD_FIELDS
        if unknown:
            raise ValueError(
                f"cannot update shard field(s) {', '.join(sorted(unknown))}; "
                f"allowed: {', '.join(sorted(SHARD_FIELDS))}"
            )
        if "state" in fields:
            _check_state(fields["state"], SHARD_STATES, "shard")
        if "gpus" in fields:
            gpus = fields["gpus"]
            if not isinstance(gpus, list | tuple) or not all(isinstance(g, str) for g in gpus):
                raise ValueError(f"shard gpus must be a list of GPU uuids, not {gpus!r}")
            fields["gpus"] = json.dumps(list(gpus))
        if "dist_init_addr" in fields and not isinstance(fields["dist_init_addr"], str):
            raise ValueError(
                f"shard dist_init_addr must be a host:port string, not {fields['dist_init_addr']!r}"
            )
        names = sorted(fields)
        assignments = "".join(f"{name} = ?, " for name in names)
        with self._write():
            cur = self._db.execute(
                f"UPDATE shards SET {assignments}updated_at = ? WHERE id = ?",
                (*(fields[name] for name in names), self._clock(), shard_id),
            )
            if cur.rowcount == 0:
                raise _no_shard(shard_id)
            return self.get_shard(shard_id)

    def delete_shard(self, shard_id: str) -> None:
        with self._write():
            cur = self._db.execute("DELETE FROM shards WHERE id = ?", (shard_id,))
            if cur.rowcount == 0:
                raise _no_shard(shard_id)

    # ----------------------------------------------------------------- api keys

    def create_api_key(self, name: str) -> tuple[ApiKey, str]:
        """Make a key; return its row and the secret, which is shown once and never stored."""
        secret = API_KEY_PREFIX + secrets.token_urlsafe(32)
        with self._write():
            while True:
                key_id = secrets.token_hex(6)
                taken = self._db.execute(
                    "SELECT 1 FROM api_keys WHERE id = ?", (key_id,)
                ).fetchone()
                if taken is None:
                    break
            self._db.execute(
                "INSERT INTO api_keys(id, name, prefix, hash, created_at) VALUES (?, ?, ?, ?, ?)",
                (key_id, name, secret[:12], hash_api_key(secret), self._clock()),
            )
            row = self._db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        return ApiKey._from_row(row), secret

    def get_api_key(self, key_id_or_prefix: str, *, prefer_active: bool = False) -> ApiKey:
        """The key with this id, or the only key with this prefix.

        With *prefer_active*, a prefix shared by several keys names the one unrevoked among them.
        """
        row = self._one("SELECT * FROM api_keys WHERE id = ?", (key_id_or_prefix,))
        if row is not None:
            return ApiKey._from_row(row)
        rows = self._all("SELECT * FROM api_keys WHERE prefix = ?", (key_id_or_prefix,))
        if prefer_active and len(rows) > 1:
            active = [r for r in rows if r["revoked_at"] is None]
            rows = active or rows
        if not rows:
            raise NotFound(
                f"no API key with id or prefix {key_id_or_prefix}; 'llmgw ctl keys' lists them"
            )
        if len(rows) > 1:
            raise Conflict(
                f"{len(rows)} API keys have prefix {key_id_or_prefix}; "
                "name the key by its id ('llmgw ctl keys' lists them)"
            )
        return ApiKey._from_row(rows[0])

    def list_api_keys(self, include_revoked: bool = False) -> list[ApiKey]:
        sql = "SELECT * FROM api_keys"
        if not include_revoked:
            sql += " WHERE revoked_at IS NULL"
        sql += " ORDER BY created_at, id"
        return [ApiKey._from_row(r) for r in self._all(sql)]

    def revoke_api_key(self, key_id_or_prefix: str) -> ApiKey:
        """Revoke a key by id or unique prefix; return the revoked row."""
        with self._write():
            key = self.get_api_key(key_id_or_prefix, prefer_active=True)
            if key.revoked:
                raise Conflict(
                    f"API key {key.id} ({key.name}) is already revoked; "
                    "'llmgw ctl keys' lists the active ones"
                )
            self._db.execute(
                "UPDATE api_keys SET revoked_at = ? WHERE id = ?", (self._clock(), key.id)
            )
            return self.get_api_key(key.id)

    def verify_api_key(self, secret: str) -> ApiKey | None:
        """The active key whose secret this is, or None."""
        row = self._one(
            "SELECT * FROM api_keys WHERE hash = ? AND revoked_at IS NULL",
            (hash_api_key(secret),),
        )
        return None if row is None else ApiKey._from_row(row)

    def active_key_hashes(self) -> set[str]:
        """Hashes of all unrevoked keys, for the gateway's in-memory check."""
        return {
            str(r["hash"]) for r in self._all("SELECT hash FROM api_keys WHERE revoked_at IS NULL")
        }

    # -------------------------------------------------------------- join tokens

    def create_join_token(
        self,
        node_id: str,
        *,
        kind: str = "join",
        ttl: float,
        node_uid: str | None = None,
        require_approval: bool = False,
    ) -> tuple[JoinToken, str]:
        """Mint a one-time token for *node_id*, valid *ttl* seconds; return its row and the
        secret, which is shown once and stored only as a hash.

        A ``rekey`` token is bound to the node's current uid (*node_uid*); with
        *require_approval* the rekeyed node goes back to pending.
        """
        validate_node_id(node_id)
        if kind not in JOIN_TOKEN_KINDS:
            raise ValueError(f"{kind!r} is not a join token kind; use 'join' or 'rekey'")
        if kind == "rekey" and not node_uid:
            raise ValueError(f"a rekey token for {node_id} needs the node's uid (node_uid)")
        if kind == "join" and node_uid is not None:
            raise ValueError("node_uid binds rekey tokens only; leave it out for a join token")
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not 0 < ttl < math.inf:
            raise ValueError(
                f"a join token's ttl must be a positive number of seconds, not {ttl!r}"
            )
        secret = JOIN_TOKEN_PREFIX + secrets.token_urlsafe(32)
        now = self._clock()
        with self._write():
            while True:
                token_id = secrets.token_hex(4)
                taken = self._db.execute(
                    "SELECT 1 FROM join_tokens WHERE id = ?", (token_id,)
                ).fetchone()
                if taken is None:
                    break
            self._db.execute(
                "INSERT INTO join_tokens(id, hash, prefix, node_id, kind, node_uid, "
                "require_approval, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    token_id,
                    _hash_token(secret),
                    secret[:14],
                    node_id,
                    kind,
                    node_uid,
                    int(require_approval),
                    now,
                    now + float(ttl),
                ),
            )
            row = self._db.execute("SELECT * FROM join_tokens WHERE id = ?", (token_id,)).fetchone()
        return JoinToken._from_row(row, now), secret

    def list_join_tokens(self, include_inactive: bool = False) -> list[JoinToken]:
        """Tokens still usable, oldest first; with *include_inactive* also used, revoked and
        expired ones."""
        now = self._clock()
        sql = "SELECT * FROM join_tokens"
        params: tuple[Any, ...] = ()
        if not include_inactive:
            sql += " WHERE used_at IS NULL AND revoked_at IS NULL AND expires_at > ?"
            params = (now,)
        sql += " ORDER BY created_at, id"
        return [JoinToken._from_row(r, now) for r in self._all(sql, params)]

    def get_join_token(self, id_or_prefix: str) -> JoinToken:
        """The token with this id, or the only one with this prefix (``llmgwjt_`` + 6)."""
        now = self._clock()
        row = self._one("SELECT * FROM join_tokens WHERE id = ?", (id_or_prefix,))
        if row is not None:
            return JoinToken._from_row(row, now)
        rows = self._all("SELECT * FROM join_tokens WHERE prefix = ?", (id_or_prefix,))
        if not rows:
            raise NotFound(
                f"no join token with id or prefix {id_or_prefix}; mint one with "
                "'llmgw ctl join-command --node NODE'"
            )
        if len(rows) > 1:
            raise Conflict(
                f"{len(rows)} join tokens have prefix {id_or_prefix}; name the token by its id"
            )
        return JoinToken._from_row(rows[0], now)

    def revoke_join_token(self, id_or_prefix: str) -> JoinToken:
        """Revoke an unused token by id or prefix; return the revoked row."""
        with self._write():
            token = self.get_join_token(id_or_prefix)
            if token.revoked_at is not None:
                raise Conflict(
                    f"join token {token.id} for {token.node_id} is already revoked "
                    f"(at {_when(token.revoked_at)}); nothing to do"
                )
            if token.used_at is not None:
                raise Conflict(
                    f"join token {token.id} for {token.node_id} is already used "
                    f"(at {_when(token.used_at)}); to shut the node out, run "
                    f"'llmgw ctl revoke {token.node_id}'"
                )
            self._db.execute(
                "UPDATE join_tokens SET revoked_at = ? WHERE id = ?", (self._clock(), token.id)
            )
            return self.get_join_token(token.id)

    def consume_join_token(
        self, secret: str, *, node_id: str, kind: str, node_uid: str | None
    ) -> JoinToken:
        """Check the token *secret* for a *kind* (``join``/``rekey``) of *node_id* and mark it
        used, atomically: of two racing consumers exactly one wins. Raises
        :class:`~llmgw.errors.TokenError`; inside :meth:`transaction` the use is undone if
        the transaction rolls back."""
        if kind not in JOIN_TOKEN_KINDS:
            raise ValueError(f"{kind!r} is not a join token kind; use 'join' or 'rekey'")
        with self._write():
            now = self._clock()
            row = self._db.execute(
                "SELECT * FROM join_tokens WHERE hash = ?", (_hash_token(secret),)
            ).fetchone()
            if row is None:
                raise TokenError(
                    "no such join token; mint one with "
                    f"'llmgw ctl join-command --node {node_id or 'NODE'}'",
                    code="token_unknown",
                )
            token = JoinToken._from_row(row, now)
            _check_token(token, node_id=node_id, kind=kind, node_uid=node_uid)
            cur = self._db.execute(
                "UPDATE join_tokens SET used_at = ? "
                "WHERE id = ? AND used_at IS NULL AND revoked_at IS NULL",
                (now, token.id),
            )
            if cur.rowcount != 1:
                # Someone else got there between our read and this write.
                row = self._db.execute(
                    "SELECT * FROM join_tokens WHERE id = ?", (token.id,)
                ).fetchone()
                _check_token(
                    JoinToken._from_row(row, now), node_id=node_id, kind=kind, node_uid=node_uid
                )
                raise _token_used(token, now)
            row = self._db.execute("SELECT * FROM join_tokens WHERE id = ?", (token.id,)).fetchone()
            return JoinToken._from_row(row, now)

    # --------------------------------------------------------------- enrolment

    def enrol_node(
        self,
        node_id: str,
        *,
        fingerprint: str,
        rekey: bool,
        node_uid: str | None,
        require_approval: bool,
    ) -> Node:
        """Record a node that joined (or rekeyed) with the key *fingerprint*.

        A join makes the node, or gives an existing one (reinstalled, or revoked and coming
        back) a fresh uid, state pending and revokes its older certificates. A rekey keeps
        the uid, which must be *node_uid*, and the state (pending with *require_approval*).
        """
        validate_node_id(node_id)
        now = self._clock()
        with self._write():
            row = self._db.execute("SELECT * FROM nodes WHERE id = ?", (node_id,)).fetchone()
            if not rekey:
                uid = uuid.uuid4().hex
                if row is None:
                    self._db.execute(
                        "INSERT INTO nodes(id, uid, state, fingerprint, created_at) "
                        "VALUES (?, ?, 'pending', ?, ?)",
                        (node_id, uid, fingerprint, now),
                    )
                else:
                    self._db.execute(
                        "UPDATE nodes SET uid = ?, state = 'pending', fingerprint = ? WHERE id = ?",
                        (uid, fingerprint, node_id),
                    )
                    self.revoke_certificates(node_id, reason="replaced by a fresh join")
                return self.get_node(node_id)
            if row is None:
                raise TokenError(
                    f"node {node_id} is not known here (it was deleted); join it afresh with "
                    f"'llmgw ctl join-command --node {node_id}'",
                    code="node_unknown",
                )
            node = Node._from_row(row)
            if node.state == "revoked":
                raise TokenError(
                    f"node {node_id} is revoked; a revoked node can come back only through a "
                    f"fresh join: 'llmgw ctl join-command --node {node_id}'",
                    code="node_revoked",
                )
            if node_uid is None or node.uid != node_uid:
                raise TokenError(
                    f"node {node_id} has uid {node.uid}, not {node_uid or '(none)'}: it joined "
                    "afresh since this node last got a certificate; join this machine afresh "
                    f"with 'llmgw ctl join-command --node {node_id}'",
                    code="node_uid_mismatch",
                )
            state = "pending" if require_approval else node.state
            self._db.execute(
                "UPDATE nodes SET state = ?, fingerprint = ? WHERE id = ?",
                (state, fingerprint, node_id),
            )
            return self.get_node(node_id)

    # ------------------------------------------------------------- certificates

    def add_certificate(
        self,
        serial: str,
        *,
        node_id: str,
        fingerprint: str,
        not_before: float,
        not_after: float,
    ) -> Certificate:
        """Record a certificate issued to *node_id*; *serial* is hex (stored lowercase)."""
        serial = _normal_serial(serial)
        with self._write():
            self._db.execute(
                "INSERT INTO certificates(serial, node_id, fingerprint, not_before, not_after, "
                "issued_at) VALUES (?, ?, ?, ?, ?, ?)",
                (serial, node_id, fingerprint, not_before, not_after, self._clock()),
            )
            row = self._db.execute(
                "SELECT * FROM certificates WHERE serial = ?", (serial,)
            ).fetchone()
        return Certificate._from_row(row)

    def latest_certificate(self, node_id: str) -> Certificate | None:
        """The node's newest unrevoked certificate, or None."""
        row = self._one(
            "SELECT * FROM certificates WHERE node_id = ? AND revoked_at IS NULL "
            "ORDER BY issued_at DESC, rowid DESC LIMIT 1",
            (node_id,),
        )
        return None if row is None else Certificate._from_row(row)

    def list_certificates(self, node_id: str | None = None) -> list[Certificate]:
        """Every certificate recorded (of *node_id*), oldest first, revoked ones included."""
        if node_id is None:
            rows = self._all("SELECT * FROM certificates ORDER BY issued_at, rowid")
        else:
            rows = self._all(
                "SELECT * FROM certificates WHERE node_id = ? ORDER BY issued_at, rowid",
                (node_id,),
            )
        return [Certificate._from_row(r) for r in rows]

    def revoke_certificates(
        self, node_id: str, *, reason: str, except_serial: str | None = None
    ) -> list[str]:
        """Revoke every unrevoked certificate of *node_id* but *except_serial*; return their
        serials."""
        keep = None if except_serial is None else _normal_serial(except_serial)
        with self._write():
            rows = self._db.execute(
                "SELECT serial FROM certificates WHERE node_id = ? AND revoked_at IS NULL "
                "ORDER BY issued_at, rowid",
                (node_id,),
            ).fetchall()
            serials = [str(r["serial"]) for r in rows if r["serial"] != keep]
            now = self._clock()
            self._db.executemany(
                "UPDATE certificates SET revoked_at = ?, reason = ? WHERE serial = ?",
                [(now, reason, serial) for serial in serials],
            )
        return serials

    def is_revoked(self, serial: str) -> bool:
        """True if the certificate with this (hex) serial was revoked; unknown serials are not."""
        row = self._one(
            "SELECT 1 FROM certificates WHERE serial = ? AND revoked_at IS NOT NULL",
            (_normal_serial(serial),),
        )
        return row is not None

    def revoked_serials(self) -> set[str]:
        """Serials of every revoked certificate, for the stream's and data plane's deny list."""
        return {
            str(r["serial"])
            for r in self._all("SELECT serial FROM certificates WHERE revoked_at IS NOT NULL")
        }

    # ------------------------------------------------------------------ updates

    def next_update_counter(self, node_id: str) -> int:
        """Reserve the next update counter of *node_id* (one above the last ever given, also
        when the order is then not sent): call inside :meth:`transaction` with the
        :meth:`put_update` that uses it."""
        now = self._clock()
        with self._write():
            self._db.execute(
                "INSERT INTO node_updates(node_id, counter, updated_at) VALUES (?, 1, ?) "
                "ON CONFLICT(node_id) DO UPDATE SET counter = counter + 1",
                (node_id, now),
            )
            row = self._db.execute(
                "SELECT counter FROM node_updates WHERE node_id = ?", (node_id,)
            ).fetchone()
        return int(row["counter"])

    def put_update(
        self,
        node_id: str,
        *,
        counter: int,
        version: str,
        state: str,
        message: str,
        op_id: str,
        order: bytes,
        signature: bytes,
        expires: float,
    ) -> NodeUpdate:
        """Record the order with *counter* (from :meth:`next_update_counter`) as the node's
        latest; Conflict if a later counter was given out meanwhile."""
        now = self._clock()
        with self._write():
            cur = self._db.execute(
                "UPDATE node_updates SET version = ?, state = ?, message = ?, op_id = ?, "
                "order_json = ?, signature = ?, expires = ?, ordered_at = ?, updated_at = ? "
                "WHERE node_id = ? AND counter = ?",
                (
                    version,
                    state,
                    message,
                    op_id,
                    order,
                    signature,
                    expires,
                    now,
                    now,
                    node_id,
                    counter,
                ),
            )
            if cur.rowcount != 1:
                raise Conflict(
                    f"update counter {counter} of node {node_id} is no longer the latest; "
                    "order the update again"
                )
        update = self.get_update(node_id)
        assert update is not None
        return update

    def get_update(self, node_id: str) -> NodeUpdate | None:
        """The node's latest update order, or None (never ordered, or nothing but a
        reserved counter)."""
        row = self._one(
            "SELECT * FROM node_updates WHERE node_id = ? AND ordered_at IS NOT NULL", (node_id,)
        )
        return None if row is None else NodeUpdate._from_row(row)

    def list_updates(self) -> list[NodeUpdate]:
        rows = self._all("SELECT * FROM node_updates WHERE ordered_at IS NOT NULL ORDER BY node_id")
        return [NodeUpdate._from_row(r) for r in rows]

    def set_update_state(self, node_id: str, counter: int, state: str, message: str) -> bool:
        """Set the state of the node's update order *counter*; False when that is not its
        latest order (a late report about an older one)."""
        with self._write():
            cur = self._db.execute(
                "UPDATE node_updates SET state = ?, message = ?, updated_at = ? "
                "WHERE node_id = ? AND counter = ? AND ordered_at IS NOT NULL",
                (state, message[:2000], self._clock(), node_id, counter),
            )
        return cur.rowcount == 1

    # ------------------------------------------------------------------- events

    def add_event(self, kind: str, subject: str, message: str) -> Event:
        """Record an event, its message cut to :data:`MAX_EVENT_MESSAGE` characters (and its
        subject to :data:`MAX_EVENT_SUBJECT`); the oldest are trimmed to keep at most
        :attr:`max_events` events and :attr:`max_event_bytes` characters of them."""
        kind, subject = _cut(kind, 64), _cut(subject, MAX_EVENT_SUBJECT)
        message = _cut(message, MAX_EVENT_MESSAGE)
        with self._write():
            cur = self._db.execute(
                "INSERT INTO events(ts, kind, subject, message) VALUES (?, ?, ?, ?)",
                (self._clock(), kind, subject, message),
            )
            event_id = cur.lastrowid
            self._events_since_trim += 1
            if self._events_since_trim >= self.event_trim_every:
                self._db.execute(
                    "DELETE FROM events WHERE id <= "
                    "(SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)",
                    (self.max_events,),
                )
                # The newest events up to max_event_bytes stay; older ones go.
                self._db.execute(
                    "DELETE FROM events WHERE id <= (SELECT id FROM (SELECT id, SUM("
                    "length(kind) + length(subject) + length(message)) OVER (ORDER BY id DESC) "
                    "AS total FROM events) WHERE total > ? ORDER BY id DESC LIMIT 1)",
                    (self.max_event_bytes,),
                )
                self._events_since_trim = 0
            row = self._db.execute("SELECT * FROM events WHERE id = ?", (event_id,)).fetchone()
        return Event._from_row(row)

    def list_events(self, limit: int = 100, subject: str | None = None) -> list[Event]:
        """The most recent events, newest first, optionally only those about *subject*."""
        if subject is None:
            rows = self._all("SELECT * FROM events ORDER BY id DESC LIMIT ?", (limit,))
        else:
            rows = self._all(
                "SELECT * FROM events WHERE subject = ? ORDER BY id DESC LIMIT ?",
                (subject, limit),
            )
        return [Event._from_row(r) for r in rows]


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --------------------------------------------------------------------------- errors


def _no_node(node_id: str) -> NotFound:
    return NotFound(f"no node named {node_id}; 'llmgw ctl nodes' lists them")


def _no_model(name: str) -> NotFound:
    return NotFound(f"no model named {name}; 'llmgw ctl models' lists them")


def _no_replica(replica_id: str) -> NotFound:
    return NotFound(f"no replica named {replica_id}; 'llmgw ctl models' lists them")


def _no_shard(shard_id: str) -> NotFound:
    return NotFound(f"no shard named {shard_id}; 'llmgw ctl models' lists them")


def _translate(exc: sqlite3.Error, path: str) -> StoreError:
    if isinstance(exc, sqlite3.IntegrityError):
        return Conflict(_integrity_message(exc))
    text = str(exc)
    if "locked" in text or "busy" in text:
        return StoreError(
            f"state database {path} is locked by another process; stop any other llmgw "
            "server using it, or wait and retry"
        )
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return StoreError(
            f"state database {path} is not a readable SQLite database ({text}); "
            "restore a backup or move the file aside to start empty"
        )
    if "readonly" in text or "unable to open" in text or "disk I/O" in text or "full" in text:
        return StoreError(
            f"state database {path} cannot be read or written ({text}); check its permissions, "
            "its directory's and the free disk space"
        )
    return StoreError(
        f"state database {path}: {text}; check the file and its directory, or restore a backup"
    )


def _create_file(path: Path) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise StoreError(
            f"directory {parent} for the state database does not exist; create it "
            "(mode 0700, owned by the llmgw user) or choose another path"
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError(
            f"cannot create state database {path}: {exc.strerror}; check the permissions "
            f"of {parent}"
        ) from exc
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
