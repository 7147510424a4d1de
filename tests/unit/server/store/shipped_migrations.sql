-- The migrations as llmgw shipped them (llmgw/server/store/schema.py), one per
-- "-- migration N" line. Databases out there ran these; test_schema.py checks that
-- MIGRATIONS still say the same. Never edit this file: add a migration instead.
-- migration 1
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
-- migration 2
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
-- migration 3
ALTER TABLE models ADD COLUMN profiles TEXT NOT NULL DEFAULT '{}';
ALTER TABLE models ADD COLUMN profile TEXT NOT NULL DEFAULT 'default';
ALTER TABLE shards ADD COLUMN gpus TEXT NOT NULL DEFAULT '[]';
ALTER TABLE shards ADD COLUMN dist_init_addr TEXT NOT NULL DEFAULT '';
ALTER TABLE nodes ADD COLUMN lost INTEGER NOT NULL DEFAULT 0;
ALTER TABLE nodes ADD COLUMN lost_at REAL;
-- migration 4
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
-- migration 5
ALTER TABLE replicas ADD COLUMN profile TEXT;
-- migration 6
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
        state      TEXT NOT NULL CHECK (state IN ('installing', 'installed', 'failed')),
        error      TEXT NOT NULL DEFAULT '',
        op_id      TEXT NOT NULL DEFAULT '',
        updated_at REAL NOT NULL,
        PRIMARY KEY (node_id, engine)
    );
    CREATE INDEX node_engines_by_op ON node_engines(op_id);
    
-- migration 7
    ALTER TABLE join_tokens ADD COLUMN lost_state INTEGER NOT NULL DEFAULT 0;
    
-- migration 8
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
    
-- migration 9
    CREATE INDEX nodes_draining ON nodes(draining) WHERE draining != 0;
    CREATE INDEX shards_by_state ON shards(state);
    
-- migration 10
    ALTER TABLE api_keys ADD COLUMN models TEXT NOT NULL DEFAULT '[]';
    ALTER TABLE api_keys ADD COLUMN rpm INTEGER CHECK (rpm >= 1);
    ALTER TABLE api_keys ADD COLUMN tpm INTEGER CHECK (tpm >= 1);
    ALTER TABLE api_keys ADD COLUMN max_concurrent INTEGER CHECK (max_concurrent >= 1);
    ALTER TABLE api_keys ADD COLUMN budget_tokens INTEGER CHECK (budget_tokens >= 1);
    ALTER TABLE api_keys ADD COLUMN budget_period TEXT CHECK (budget_period IN ('day', 'month'));
    ALTER TABLE api_keys ADD COLUMN priority TEXT NOT NULL DEFAULT 'normal'
        CHECK (priority IN ('high', 'normal', 'low'));
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
    
-- migration 11
    CREATE TABLE operators (
        id                  INTEGER PRIMARY KEY AUTOINCREMENT,
        name                TEXT NOT NULL,
        role                TEXT NOT NULL CHECK (role IN ('admin', 'viewer')),
        password_hash       TEXT NOT NULL,
        created_at          REAL NOT NULL,
        created_by          TEXT NOT NULL,
        password_changed_at REAL NOT NULL,
        removed_at          REAL
    );
    CREATE UNIQUE INDEX operators_active_name ON operators(name) WHERE removed_at IS NULL;
    ALTER TABLE events ADD COLUMN actor TEXT NOT NULL DEFAULT '';
    
-- migration 12
    CREATE TABLE login_sessions (
        token_hash  TEXT PRIMARY KEY,
        operator_id INTEGER NOT NULL REFERENCES operators(id),
        kind        TEXT NOT NULL CHECK (kind IN ('console', 'cli')),
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
    

-- migration 13
    ALTER TABLE join_tokens ADD COLUMN auto_approve INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE join_tokens ADD COLUMN approved_fingerprint TEXT;
