"""The state database's schema: the versioned migrations, and how they are applied.

Migration *n* takes a database from schema version *n - 1* (SQLite's ``user_version``,
PostgreSQL's ``llmgw_schema`` table) to *n*. The statements are SQLite's; PostgreSQL runs
them as :mod:`.dialect` translates them, so that one set of migrations serves both. A migration that has shipped is history: it never changes, because databases out
there already ran it. A change to the schema (a new state in :mod:`llmgw.server.store.states`
included: its CHECK constraints are generated from those enums) is a new migration at the
end of :data:`MIGRATIONS`; ``tests/unit/server/store/test_schema.py`` holds the shipped
ones and fails when one of them changes.
"""

from __future__ import annotations

import sqlite3

from llmgw.contracts.keypolicy import BUDGET_PERIODS, PRIORITIES
from llmgw.errors import StoreError
from llmgw.server.store.database import Database
from llmgw.server.store.states import (
    InstallState,
    NodeState,
    ReplicaState,
    ShardState,
    TokenKind,
    sql_check,
)

__all__ = ["MIGRATIONS", "migrate", "schema_version", "split_sql"]


def _check(column: str, values: tuple[str, ...]) -> str:
    """``CHECK (column IN ('a', 'b'))`` for a column that takes one of *values*."""
    return f"CHECK ({column} IN ({', '.join(repr(v) for v in values)}))"


# The states of replicas and shards as migration 1 wrote its CHECKs (migration 17 widened
# them to every state of llmgw.server.store.states): a shipped migration never changes.
_REPLICA_STATES_1 = ("pending", "starting", "ready", "failed", "stopping")
_SHARD_STATES_1 = ("pending", "starting", "ready", "failed", "exited", "stopping", "stopped")

# Migration 17 rebuilds replicas and shards on SQLite (a CHECK cannot be altered there):
# the tables are renamed aside first, so that dropping the old ones deletes no row through
# their ON DELETE CASCADE (SQLite >= 3.26 points the child's reference at the renamed
# parent), and their indexes are made again.
_REPLICAS_17 = "id, model, state, created_at, updated_at, profile"
_SHARDS_17 = (
    "id, replica_id, node_id, rank, state, port, pid, exit_code, reason, restarts, op_id, "
    "updated_at, gpus, dist_init_addr"
)

MIGRATIONS: list[str] = [
    # 1: initial schema
    f"""
    CREATE TABLE meta (
        key   TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );

    CREATE TABLE nodes (
        id             TEXT PRIMARY KEY,
        uid            TEXT NOT NULL UNIQUE,
        state          TEXT NOT NULL DEFAULT 'approved'
                       {sql_check("state", NodeState)},
        connected      INTEGER NOT NULL DEFAULT 0,
        dataplane_addr TEXT,
        agent_version  TEXT,
        inventory      TEXT NOT NULL DEFAULT '{{}}',
        fingerprint    TEXT,
        draining       INTEGER NOT NULL DEFAULT 0,
        last_seen      REAL,
        created_at     REAL NOT NULL
    );

    CREATE TABLE models (
        name       TEXT PRIMARY KEY,
        engine     TEXT NOT NULL,
        params     TEXT NOT NULL DEFAULT '{{}}',
        replicas   INTEGER NOT NULL CHECK (replicas >= 0),
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );

    CREATE TABLE replicas (
        id         TEXT PRIMARY KEY,
        model      TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
        state      TEXT NOT NULL
                   {_check("state", _REPLICA_STATES_1)},
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
                   {_check("state", _SHARD_STATES_1)},
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
    f"""
    CREATE TABLE join_tokens (
        id               TEXT PRIMARY KEY,
        hash             TEXT NOT NULL UNIQUE,
        prefix           TEXT NOT NULL,
        node_id          TEXT NOT NULL,
        kind             TEXT NOT NULL {sql_check("kind", TokenKind)},
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
    # 6: the desired engine builds (scope '' for every node, else one node id; arch '' for
    # a build that runs on any architecture), and what became of each node's install
    f"""
    CREATE TABLE desired_engines (
        scope      TEXT NOT NULL,
        engine     TEXT NOT NULL,
        version    TEXT NOT NULL,
        arch       TEXT NOT NULL,
        url        TEXT NOT NULL,
        sha256     TEXT NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (scope, engine, arch)
    );

    CREATE TABLE node_engines (
        node_id    TEXT NOT NULL,
        engine     TEXT NOT NULL,
        version    TEXT NOT NULL,
        sha256     TEXT NOT NULL,
        state      TEXT NOT NULL {sql_check("state", InstallState)},
        error      TEXT NOT NULL DEFAULT '',
        op_id      TEXT NOT NULL DEFAULT '',
        updated_at REAL NOT NULL,
        PRIMARY KEY (node_id, engine)
    );
    CREATE INDEX node_engines_by_op ON node_engines(op_id);
    """,
    # 7: rekey tokens for a node whose state directory is gone: spent without the old key
    # (with the uid they are bound to), the node pending approval again
    """
    ALTER TABLE join_tokens ADD COLUMN lost_state INTEGER NOT NULL DEFAULT 0;
    """,
    # 8: several control-plane instances on one database (PostgreSQL): the leader's lease,
    # whose epoch fences a replaced leader's writes (the epoch so far kept in meta moves
    # there); the instances, each with the addresses agents and clients reach it at and
    # the serials of its own server and client certificates (a retired instance's are
    # refused by the agents); and the order in which certificates were issued, which SQLite's rowid gave and PostgreSQL
    # has no equivalent of
    """
    CREATE TABLE leader_lease (
        id          INTEGER PRIMARY KEY CHECK (id = 1),
        holder      TEXT NOT NULL DEFAULT '',
        epoch       INTEGER NOT NULL CHECK (epoch >= 0),
        expires_at  REAL NOT NULL DEFAULT 0,
        acquired_at REAL NOT NULL DEFAULT 0,
        renewed_at  REAL NOT NULL DEFAULT 0
    );
    INSERT INTO leader_lease(id, epoch)
        SELECT 1, COALESCE(MAX(CAST(value AS INTEGER)), 0) FROM meta WHERE key = 'epoch';
    DELETE FROM meta WHERE key = 'epoch';

    CREATE TABLE instances (
        id          TEXT PRIMARY KEY,
        process     TEXT NOT NULL,
        stream_addr TEXT NOT NULL DEFAULT '',
        http_addr   TEXT NOT NULL DEFAULT '',
        enroll_addr TEXT NOT NULL DEFAULT '',
        version     TEXT NOT NULL DEFAULT '',
        ca_hash     TEXT NOT NULL DEFAULT '',
        client_serial TEXT NOT NULL DEFAULT '',
        server_serial TEXT NOT NULL DEFAULT '',
        started_at  REAL NOT NULL,
        seen_at     REAL NOT NULL,
        retired_at  REAL
    );

    ALTER TABLE certificates ADD COLUMN seq INTEGER NOT NULL DEFAULT 0;
    /* sqlite */ UPDATE certificates SET seq = rowid;
    CREATE INDEX certificates_by_seq ON certificates(node_id, seq);
    """,
    # 9: the draining nodes found without reading every node (each reconcile pass asks; a
    # fleet's rows are large, their inventories before the flag); and the shards that need
    # work (failed, pending) without reading every shard
    """
    CREATE INDEX nodes_draining ON nodes(draining) WHERE draining != 0;
    CREATE INDEX shards_by_state ON shards(state);
    """,
    # 10: an API key's policy (llmgw.contracts.keypolicy: the models it may call, its rate
    # limits, its token budget per UTC period, its priority, its expiry; NULL: not limited)
    # and when it last changed; and its usage, one row per UTC day, key and model, which
    # every gateway instance adds its own counts to
    f"""
    ALTER TABLE api_keys ADD COLUMN models TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE api_keys ADD COLUMN rpm INTEGER CHECK (rpm >= 1);
    ALTER TABLE api_keys ADD COLUMN tpm INTEGER CHECK (tpm >= 1);
    ALTER TABLE api_keys ADD COLUMN max_concurrent INTEGER CHECK (max_concurrent >= 1);
    ALTER TABLE api_keys ADD COLUMN budget_tokens INTEGER CHECK (budget_tokens >= 1);
    ALTER TABLE api_keys ADD COLUMN budget_period TEXT {_check("budget_period", BUDGET_PERIODS)};
    ALTER TABLE api_keys ADD COLUMN priority TEXT NOT NULL DEFAULT 'normal'
        {_check("priority", PRIORITIES)};
    ALTER TABLE api_keys ADD COLUMN expires_at REAL;
    ALTER TABLE api_keys ADD COLUMN updated_at REAL;
    UPDATE api_keys SET updated_at = created_at;
    CREATE INDEX api_keys_by_name ON api_keys(name);

    CREATE TABLE usage (
        day               TEXT NOT NULL,
        key_id            TEXT NOT NULL,
        model             TEXT NOT NULL,
        requests          INTEGER NOT NULL DEFAULT 0,
        prompt_tokens     INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        cached_tokens     INTEGER NOT NULL DEFAULT 0,
        errors            INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (day, key_id, model)
    );
    CREATE INDEX usage_by_key ON usage(key_id, day);
    """,
    # 11: operator accounts (the web console's and ctl's people, issue 17), and who took
    # the action an event records (an account's name, 'token', '' for the system)
    f"""
    CREATE TABLE operators (
        id                  INTEGER PRIMARY KEY AUTOINCREMENT,
        name                TEXT NOT NULL,
        role                TEXT NOT NULL {_check("role", ("admin", "viewer"))},
        password_hash       TEXT NOT NULL,
        created_at          REAL NOT NULL,
        created_by          TEXT NOT NULL,
        password_changed_at REAL NOT NULL,
        removed_at          REAL
    );
    CREATE UNIQUE INDEX operators_active_name ON operators(name) WHERE removed_at IS NULL;
    ALTER TABLE events ADD COLUMN actor TEXT NOT NULL DEFAULT '';
    """,
    # 12: login sessions (the console's cookies and 'llmgw ctl login' tokens, each kept as
    # the SHA-256 of the token, never the token) and the failed logins counted per source
    # address and per account name, so that a lockout holds across control-plane instances
    f"""
    CREATE TABLE login_sessions (
        token_hash  TEXT PRIMARY KEY,
        operator_id INTEGER NOT NULL REFERENCES operators(id),
        kind        TEXT NOT NULL {_check("kind", ("console", "cli"))},
        csrf        TEXT NOT NULL DEFAULT '',
        created_at  REAL NOT NULL,
        seen_at     REAL NOT NULL,
        expires_at  REAL NOT NULL,
        addr        TEXT NOT NULL DEFAULT '',
        agent       TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX login_sessions_by_operator ON login_sessions(operator_id);

    CREATE TABLE login_failures (
        key          TEXT PRIMARY KEY,
        failures     INTEGER NOT NULL DEFAULT 0,
        first_at     REAL NOT NULL,
        locked_until REAL NOT NULL DEFAULT 0
    );
    """,
    # 13: auto-approve join tokens (issue 18: machines that boot into the fleet): the node
    # that spends one is approved on first use, and the token keeps the key it approved
    """
    ALTER TABLE join_tokens ADD COLUMN auto_approve INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE join_tokens ADD COLUMN approved_fingerprint TEXT;
    """,
    # 14: the names each control-plane instance answers to (the DNS names of its server
    # certificate: host name, FQDN, advertise entries; a JSON list), which no node may take
    # as its id: a node under an instance's name could pose as that instance
    """
    ALTER TABLE instances ADD COLUMN names TEXT NOT NULL DEFAULT '[]';
    """,
    # 15: a model's scaling policy (issue 39: replicas by demand), its JSON
    # (llmgw.contracts.scaling); '{}' for a fixed count, which the replicas column holds
    # either way (the planner writes the count it wants)
    """
    ALTER TABLE models ADD COLUMN scaling TEXT NOT NULL DEFAULT '{}';
    """,
    # 16: each gateway instance's demand per model (requests in flight, queued, waiting for a
    # replica to exist, TTFT p90), written about once a second by the standbys on
    # PostgreSQL and summed by the leader's planner (issue 39); unfenced, as usage is
    """
    CREATE TABLE demand (
        instance   TEXT NOT NULL,
        model      TEXT NOT NULL,
        inflight   INTEGER NOT NULL CHECK (inflight >= 0),
        queued     INTEGER NOT NULL CHECK (queued >= 0),
        waiting    INTEGER NOT NULL CHECK (waiting >= 0),
        ttft_p90   REAL,
        at         REAL NOT NULL,
        PRIMARY KEY (instance, model)
    );
    """,
    # 17: sleeping replicas (issue 39): the states falling_asleep, asleep and waking of
    # replicas and shards, and a sleeping shard's level and the host memory it holds
    f"""
    /* sqlite */ ALTER TABLE shards RENAME TO shards_old;
    /* sqlite */ ALTER TABLE replicas RENAME TO replicas_old;
    /* sqlite */ CREATE TABLE replicas (
        id         TEXT PRIMARY KEY,
        model      TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
        state      TEXT NOT NULL
                   {sql_check("state", ReplicaState)},
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        profile    TEXT
    );
    /* sqlite */ INSERT INTO replicas({_REPLICAS_17}) SELECT {_REPLICAS_17} FROM replicas_old;
    /* sqlite */ CREATE TABLE shards (
        id             TEXT PRIMARY KEY,
        replica_id     TEXT NOT NULL REFERENCES replicas(id) ON DELETE CASCADE,
        node_id        TEXT NOT NULL REFERENCES nodes(id),
        rank           INTEGER NOT NULL DEFAULT 0,
        state          TEXT NOT NULL
                       {sql_check("state", ShardState)},
        port           INTEGER,
        pid            INTEGER,
        exit_code      INTEGER,
        reason         TEXT NOT NULL DEFAULT '',
        restarts       INTEGER NOT NULL DEFAULT 0,
        op_id          TEXT,
        updated_at     REAL NOT NULL,
        gpus           TEXT NOT NULL DEFAULT '[]',
        dist_init_addr TEXT NOT NULL DEFAULT ''
    );
    /* sqlite */ INSERT INTO shards({_SHARDS_17}) SELECT {_SHARDS_17} FROM shards_old;
    /* sqlite */ DROP TABLE shards_old;
    /* sqlite */ DROP TABLE replicas_old;
    /* sqlite */ CREATE INDEX replicas_by_model ON replicas(model);
    /* sqlite */ CREATE INDEX shards_by_node ON shards(node_id);
    /* sqlite */ CREATE UNIQUE INDEX shards_by_replica ON shards(replica_id, rank);
    /* sqlite */ CREATE INDEX shards_by_state ON shards(state);
    /* postgresql */ ALTER TABLE replicas DROP CONSTRAINT replicas_state_check;
    /* postgresql */ ALTER TABLE replicas ADD CONSTRAINT replicas_state_check
        {sql_check("state", ReplicaState)};
    /* postgresql */ ALTER TABLE shards DROP CONSTRAINT shards_state_check;
    /* postgresql */ ALTER TABLE shards ADD CONSTRAINT shards_state_check
        {sql_check("state", ShardState)};
    ALTER TABLE shards ADD COLUMN sleep_level INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE shards ADD COLUMN host_memory_mib INTEGER NOT NULL DEFAULT 0;
    """,
    # 18: GPUs an operator cordoned (issue 39): placement gives them no work and moves what
    # runs on them, while the rest of their node keeps serving; gone with their node
    """
    CREATE TABLE gpu_cordons (
        node_id  TEXT NOT NULL REFERENCES nodes(id) ON DELETE CASCADE,
        gpu_uuid TEXT NOT NULL,
        reason   TEXT NOT NULL DEFAULT '',
        actor    TEXT NOT NULL DEFAULT '',
        at       REAL NOT NULL,
        PRIMARY KEY (node_id, gpu_uuid)
    );
    """,
    # 19: what the leader's planner learnt of each model that a new leader should not learn
    # again (issue 39: a take-over keeps scaling state): since when its demand stayed below
    # its count (UNIX seconds; NULL: no scale-down window runs), and the host memory (MiB) a
    # replica of it held asleep at level 1, as its engines said; gone with its model
    """
    CREATE TABLE scaling_state (
        model          TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
        low_since      REAL,
        sleep_host_mib INTEGER NOT NULL DEFAULT 0 CHECK (sleep_host_mib >= 0)
    );
    """,
    # 20: an API key's resume (issue 40): 0 turns off, for its requests, the gateway's
    # continuing of a broken stream (and retrying of a failed answer) on another replica
    """
    ALTER TABLE api_keys ADD COLUMN resume INTEGER NOT NULL DEFAULT 1 CHECK (resume IN (0, 1));
    """,
    # 21: the tokens of each gateway instance's demand per model (issue 41: a pool scaled by
    # tokens, a prefill pool's prompts, a decode pool's outputs); 0 from an older writer
    """
    ALTER TABLE demand ADD COLUMN tokens INTEGER NOT NULL DEFAULT 0 CHECK (tokens >= 0);
    """,
]


def split_sql(script: str) -> list[str]:
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


def schema_version(db: Database) -> int:
    """The version of the schema *db* has (0: empty)."""
    return db.schema_version()


def migrate(db: Database) -> int:
    """Apply the missing migrations, one transaction each; return the schema version.

    Each runs under the writers' lock and checks the version again inside it, so that two
    control planes starting together on one database migrate it once."""
    known = len(MIGRATIONS)
    current = schema_version(db)
    if current > known:
        raise StoreError(
            f"state database {db.path} has schema version {current}, newer than this "
            f"llmgw ({known}); run the newer llmgw that wrote it (a database is never "
            "downgraded), or restore a backup taken before the upgrade"
        )
    for version in range(current + 1, known + 1):
        with db.unfenced(), db.write():
            # Another process may have migrated between our read and the lock.
            if schema_version(db) >= version:
                continue
            db.run_script(split_sql(MIGRATIONS[version - 1]))
            db.set_schema_version(version)
    return schema_version(db)
