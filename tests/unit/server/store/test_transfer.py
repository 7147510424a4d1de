"""Tests for copying a state database from SQLite into PostgreSQL (``llmgw server migrate``,
real PostgreSQL: the session's throwaway cluster): a populated cluster arrives row for row in
every table and reads back through the store; each refusal leaves the target as it was."""

from __future__ import annotations

import fcntl
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.contracts.catalog import parse_catalog
from llmgw.contracts.keypolicy import Budget, KeyPolicy, UsageRow
from llmgw.errors import ConfigError, Conflict, StoreError, StoreUnavailable
from llmgw.server.accounts.passwords import PASSWORD_META
from llmgw.server.store import MIGRATIONS, Store
from llmgw.server.store.database import Database
from llmgw.server.store.location import Location, parse_location
from llmgw.server.store.lock import try_lock
from llmgw.server.store.postgres import PostgresDatabase
from llmgw.server.store.schema import split_sql
from llmgw.server.store.states import InstallState, NodeState, ReplicaState, ShardState, TokenKind
from llmgw.server.store.transfer import Transfer, migrate_to_postgresql
from tests.pg import PASSWORD, ROLE
from tests.unit.clock import Clock

T0 = 1_700_000_000.25  # the populated store's clock
POLICY = KeyPolicy(
    models=("llama", "m/b"),
    rpm=60,
    tpm=100_000,
    max_concurrent=4,
    budget=Budget(10**13, "month"),
    priority="high",
    expires_at=T0 + 86400.5,
)
ORDER = b'{"counter":1,"version":"0.9.0"}\x00\xff\xfe raw'
SIGNATURE = bytes(range(256))
CATALOG = {
    "models": {
        "llama": {
            "profiles": {
                "default": {"engine": "sim", "params": {"ttft_ms": "5"}},
                "fast": {"engine": "sim", "gpus": 0, "params": {"tps": "50"}, "args": ["--x"]},
            }
        }
    }
}


# ---------------------------------------------------------------------------- helpers


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def source(state_dir: Path) -> Location:
    return parse_location(f"sqlite://{state_dir}/llmgw.db")


@pytest.fixture
def target(pg_cluster: Any, tmp_path: Path) -> Location:
    """A fresh, empty PostgreSQL database (no schema yet), its password in a file."""
    name = pg_cluster.fresh_database()
    return parse_location(
        pg_cluster.url(name, password=False), password_file=pg_cluster.password_file(tmp_path)
    )


@pytest.fixture
def populated(source: Location) -> Iterator[Store]:
    """A single-instance cluster's SQLite store with rows in every table, made through the
    store's own API (the test closes it before the migration)."""
    clock = Clock(T0)
    s = Store.open(source, clock=clock)
    # Nodes: approved and connected, pending (joined, awaiting approval), revoked, lost.
    s.upsert_node(
        "gpu1",
        dataplane_addr="10.0.0.1:9443",
        agent_version="0.9.0",
        inventory={"gpus": [{"name": "H100", "memory_mib": 81920}], "arch": "x86_64"},
        connected=True,
    )
    s.set_node_fingerprint("gpu1", "sha256:aa")
    s.upsert_node(
        "gpu2", dataplane_addr="10.0.0.2:9443", agent_version="0.9.0", inventory={}, connected=False
    )
    s.set_node_lost("gpu2", True)
    s.set_node_draining("gpu2", True)
    s.cordon_gpus("gpu1", ["GPU-0"], reason="fan noise ✓", actor="admin")
    s.enrol_node("gpu3", fingerprint="sha256:cc", rekey=False, node_uid=None, require_approval=True)
    s.enrol_node(
        "gpu4", fingerprint="sha256:dd", rekey=False, node_uid=None, require_approval=False
    )
    s.set_node_state("gpu4", NodeState.REVOKED)
    # Certificates: gpu1's current one, an older one of gpu1 revoked, gpu4's revoked.
    s.add_certificate(
        "1A1B", node_id="gpu1", fingerprint="sha256:old", not_before=1.0, not_after=2.0
    )
    s.revoke_certificates("gpu1", reason="renewed")
    clock.advance(1)
    s.add_certificate(
        "2c2d", node_id="gpu1", fingerprint="sha256:aa", not_before=3.5, not_after=9e9
    )
    s.add_certificate(
        "ff00", node_id="gpu4", fingerprint="sha256:dd", not_before=3.0, not_after=9e9
    )
    s.revoke_certificates("gpu4", reason="revoked by the operator")
    # The catalog's model with two profiles, deployed; a model without the catalog.
    for name, spec in parse_catalog(CATALOG, source="catalog").models.items():
        s.put_catalog_model(name, spec.to_dict()["profiles"])
    s.deploy_model("llama", profile="fast", replicas=2)
    s.put_model("plain", engine="vllm", params={"max_len": 4096, "tp": 2}, replicas=1)
    # Replicas and their shards (one multi-node replica across gpu1 and gpu2).
    r1 = s.add_replica("llama")
    s.set_replica_state(r1.id, ReplicaState.READY)
    sh = s.add_shard(r1.id, "gpu1")
    s.update_shard(
        sh.id, state=ShardState.READY, port=8001, pid=4242, gpus=["GPU-aaaa", "GPU-bbbb"]
    )
    r2 = s.add_replica("plain")
    s.add_shard(r2.id, "gpu1", rank=0)
    s.update_shard(
        s.add_shard(r2.id, "gpu2", rank=1).id,
        state=ShardState.FAILED,
        exit_code=-9,
        reason="killed",
        restarts=3,
        dist_init_addr="10.0.0.1:29500",
    )
    # API keys, one revoked; join tokens: one open, one rekey spent, one revoked.
    # (ci with a policy of every kind of limit; old's usage outlives it.)
    ci, _ = s.create_api_key("ci", POLICY)
    revoked_key, _ = s.create_api_key("old")
    s.revoke_api_key(revoked_key.id)
    s.add_usage(
        [
            UsageRow("2023-11-14", ci.id, "llama", 3, 1200, 300, 64, 1),
            UsageRow("2023-11-14", revoked_key.id, "llama", 1, 10, 5),
            UsageRow("2023-11-15", ci.id, "llama", 2, 10**12, 7),
        ]
    )
    s.create_join_token("gpu5", ttl=3600)
    gpu1 = s.get_node("gpu1")
    _, secret = s.create_join_token(
        "gpu1", kind=TokenKind.REKEY, ttl=600, node_uid=gpu1.uid, require_approval=True
    )
    s.consume_join_token(secret, node_id="gpu1", kind=TokenKind.REKEY, node_uid=gpu1.uid)
    stale, _ = s.create_join_token("gpu6", ttl=60)
    s.revoke_join_token(stale.id)
    # Events, the newest deleted: SQLite's AUTOINCREMENT never gives its id out again.
    for i in range(5):
        s.add_event("node", f"gpu{i}", f"event {i} ünïcode ✓")
    gone = s.add_event("node", "gpu9", "deleted")
    with s.transaction():
        s.database.execute("DELETE FROM events WHERE id = ?", (gone.id,))
    # A signed update order, its bytes not valid UTF-8; a reserved counter without an order.
    counter = s.next_update_counter("gpu1")
    s.put_update(
        "gpu1",
        counter=counter,
        version="0.9.1",
        state="sent",
        message="",
        op_id="op-1",
        order=ORDER,
        signature=SIGNATURE,
        expires=1_700_003_600.5,
    )
    s.next_update_counter("gpu2")
    s.next_update_counter("gpu2")
    # Engines: desired builds and each node's install.
    s.set_desired_engine(
        "", "vllm", "0.6.3", [("x86_64", "https://x/vllm-amd64.tgz", "a" * 64), ("", "u", "b" * 64)]
    )
    s.set_desired_engine("gpu1", "sglang", "0.4", [("x86_64", "https://x/sg.tgz", "c" * 64)])
    s.put_node_engine(
        "gpu1", "vllm", version="0.6.3", sha256="a" * 64, state=InstallState.INSTALLED, op_id="e1"
    )
    s.put_node_engine(
        "gpu2",
        "vllm",
        version="0.6.3",
        sha256="a" * 64,
        state=InstallState.FAILED,
        op_id="e2",
        error="no space left",
    )
    # Meta: the cluster id, the admin password's hash, what a CA rotation keeps.
    s.cluster_id()
    s.set_meta(PASSWORD_META, "scrypt$16384$8$1$c2FsdA$aGFzaA")
    s.set_meta("ca_rotation", '{"phase": "cross-signed", "old": "sha256:01"}')
    # Operator accounts: the first admin, and a removed viewer whose row stays.
    s.add_operator("admin", "admin", "scrypt$16384$8$1$c2FsdA$aGFzaA", "control-plane")
    s.add_operator("bob", "viewer", "scrypt$16384$8$1$c2FsdA$Ym9i", "admin")
    s.remove_operator("bob")
    # A console session of admin's (by its token's hash), a locked failure counter.
    s.add_login_session(
        "ab" * 32,
        s.get_operator("admin").id,
        "console",
        csrf="csrf-token",
        now=1_700_000_000.25,
        expires_at=1_700_043_200.25,
        addr="203.0.113.9",
        agent="Mozilla/5.0 ✓",
    )
    s.count_login_attempt("addr:203.0.113.7", 1_700_000_000.5, window=900, limit=1, lockout=900)
    # The leader's epoch, as seven take-overs left it; an instance row.
    for _ in range(7):
        s.bump_epoch()
    with s.transaction():
        s.database.execute(
            "INSERT INTO instances(id, process, stream_addr, http_addr, started_at, seen_at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            ("cp1", "cp1:1234", "cp1:7443", "http://cp1:8080", 1.5, 2.5),
        )
    # A standby's demand for the leader's planner.
    s.put_demand(
        "cp2", {"chat": (3, 1, 0, 0.25, 4096), "cold": (0, 0, 2, None)}, at=1_700_000_001.5
    )
    # The planner's scale-down window of llama, and what its sleepers held of host memory.
    s.set_scale_down_window("llama", 1_700_000_002.75)
    s.set_learnt_host_memory("llama", 20480)
    empty = [t for t in s.database.table_names() if not _rows(s.database, t)]
    assert empty == [], f"the fixture leaves {empty} empty: give each table a row"
    s.close()
    reopened = Store.open(source)
    yield reopened
    reopened.close()


def _primary_key(db: Database, table: str) -> list[str]:
    """The table's primary-key columns, from SQLite's catalog."""
    info = db.all(f"PRAGMA table_info({table})")
    return [str(r["name"]) for r in sorted(info, key=lambda r: r["pk"]) if r["pk"]]


def _rows(db: Database, table: str, order: list[str] | None = None) -> list[dict[str, Any]]:
    by = f" ORDER BY {', '.join(order)}" if order else ""
    return [{k: r[k] for k in r.keys()} for r in db.all(f"SELECT * FROM {table}{by}")]


def _snapshot(location: Location) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table of a PostgreSQL database, by table (rows in a fixed order)."""
    db = PostgresDatabase.open(location)
    try:
        return {t: sorted(_rows(db, t), key=repr) for t in db.table_names()}
    finally:
        db.close()


# ------------------------------------------------------------------------- the copy


def _contents(db: Database) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table of a SQLite database, ordered by primary key."""
    return {t: _rows(db, t, _primary_key(db, t)) for t in db.table_names()}


def test_a_populated_cluster_arrives_row_for_row(
    populated: Store, source: Location, target: Location, state_dir: Path
) -> None:
    before = _contents(populated.database)
    keys = {t: _primary_key(populated.database, t) for t in before}
    max_event_id = max(r["id"] for r in before["events"])
    populated.close()

    done = migrate_to_postgresql(source, target)

    assert done == Transfer(
        source=source.display,
        target=target.display,
        schema_version=len(MIGRATIONS),
        upgraded_from=len(MIGRATIONS),
        rows={t: len(rows) for t, rows in sorted(before.items())},
    )
    with Store.open(target, clock=Clock(T0 + 60)) as pg:
        # Every table of the schema, each row equal column by column (bytes, floats, NULLs).
        assert sorted(pg.database.table_names()) == sorted(before)
        for table, rows in before.items():
            assert _rows(pg.database, table, keys[table]) == rows, table
        # The store reads it all back.
        assert pg.epoch() == 7
        assert pg.get_node("gpu1").inventory["gpus"][0]["name"] == "H100"
        assert (pg.get_node("gpu2").lost, pg.get_node("gpu2").draining) == (True, True)
        assert pg.get_node("gpu3").state == NodeState.PENDING
        assert pg.get_node("gpu4").state == NodeState.REVOKED
        assert pg.is_revoked("1a1b") and pg.is_revoked("FF00") and not pg.is_revoked("2c2d")
        assert pg.revoked_serials() == {"1a1b", "ff00"}
        latest = pg.latest_certificate("gpu1")
        assert latest is not None and latest.serial == "2c2d"
        assert [c.serial for c in pg.list_certificates()] == ["1a1b", "2c2d", "ff00"]
        llama = pg.get_model("llama")
        assert (llama.profile, llama.replicas, sorted(llama.profiles)) == (
            "fast",
            2,
            ["default", "fast"],
        )
        update = pg.get_update("gpu1")
        assert update is not None and (update.order, update.signature) == (ORDER, SIGNATURE)
        assert pg.next_update_counter("gpu2") == 3  # the counter goes on, never back
        assert [(k.name, k.policy) for k in pg.list_api_keys()] == [("ci", POLICY)]
        ci = pg.get_api_key("ci")
        assert pg.tokens_since("2023-11-15") == {ci.id: 10**12 + 7}
        assert [(u.day, u.key_name, u.requests) for u in pg.list_usage()] == [
            ("2023-11-14", "ci", 3),
            ("2023-11-14", "old", 1),
            ("2023-11-15", "ci", 2),
        ]
        assert [t.node_id for t in pg.list_join_tokens()] == ["gpu5"]
        spent = {t.node_id: (t.used, t.revoked) for t in pg.list_join_tokens(True)}
        assert spent == {"gpu1": (True, False), "gpu5": (False, False), "gpu6": (False, True)}
        assert pg.get_meta(PASSWORD_META) == "scrypt$16384$8$1$c2FsdA$aGFzaA"
        # New ids go past every id SQLite gave out, the deleted newest event's included.
        assert pg.add_event("node", "gpu1", "after the move").id == max_event_id + 2
    # The source is left as it was: the backup.
    with Store.open(source) as s:
        assert _contents(s.database) == before
    # The lock was held for the copy and no longer.
    fd = try_lock(state_dir)
    assert fd is not None
    os.close(fd)


# -------------------------------------------------------------------------- refusals


def _small(source: Location) -> None:
    """A source with a few rows."""
    with Store.open(source) as s:
        s.upsert_node(
            "gpu1", dataplane_addr=None, agent_version=None, inventory={}, connected=False
        )
        s.add_event("node", "gpu1", "joined")


def _seeded_only(location: Location) -> dict[str, list[dict[str, Any]]]:
    """What a PostgreSQL database at this schema holds before anything is written to it."""
    lease = {
        "id": 1,
        "holder": "",
        "epoch": 0,
        "expires_at": 0.0,
        "acquired_at": 0.0,
        "renewed_at": 0.0,
    }
    return {t: ([lease] if t == "leader_lease" else []) for t in _snapshot(location)}


def test_a_target_with_rows_is_refused_and_left_as_it_was(
    source: Location, target: Location
) -> None:
    _small(source)
    with Store.open(target) as pg:
        pg.create_api_key("already here")
        pg.add_event("node", "x", "one")
        pg.add_event("node", "x", "two")
    before = _snapshot(target)
    with pytest.raises(Conflict) as info:
        migrate_to_postgresql(source, target)
    name = target.conninfo["dbname"]
    assert str(info.value) == (
        f"database {target.display} is not empty: api_keys (1 row), events (2 rows); migrate "
        f"only into an empty database: drop and create it again (dropdb {name} && createdb -O "
        f"{ROLE} {name}), or give another database name; nothing was written"
    )
    assert _snapshot(target) == before


def test_a_target_an_instance_has_led_is_refused(source: Location, target: Location) -> None:
    # Only the lease the migrations seed (epoch 0, no holder) counts as empty.
    _small(source)
    with Store.open(target) as pg:
        pg.bump_epoch()
    with pytest.raises(Conflict, match=r"is not empty: leader_lease \(1 row\); migrate only"):
        migrate_to_postgresql(source, target)
    with Store.open(target) as pg:
        assert pg.epoch() == 1


def test_a_source_in_use_is_refused_until_its_control_plane_stops(
    source: Location, target: Location, state_dir: Path
) -> None:
    _small(source)
    # What a running control plane holds: an exclusive flock on STATE/leader.lock.
    fd = os.open(state_dir / "leader.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StoreError) as info:
            migrate_to_postgresql(source, target)
        assert str(info.value) == (
            f"a control plane is running on {state_dir} (it holds {state_dir}/leader.lock); "
            "stop the control plane first (systemctl stop llmgw-server), then run migrate again"
        )
        assert _snapshot(target) == {}  # not even the schema
    finally:
        os.close(fd)
    done = migrate_to_postgresql(source, target)
    assert (done.rows["nodes"], done.rows["events"]) == (1, 1)


def test_the_lock_is_looked_for_in_the_state_directory_given(
    source: Location, target: Location, tmp_path: Path
) -> None:
    _small(source)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fd = try_lock(elsewhere)
    assert fd is not None
    try:
        with pytest.raises(StoreError, match=r"a control plane is running on .*/elsewhere"):
            migrate_to_postgresql(source, target, state_dir=elsewhere)
    finally:
        os.close(fd)


def test_a_missing_source_is_refused_and_not_created(state_dir: Path, target: Location) -> None:
    missing = state_dir / "nope.db"
    with pytest.raises(ConfigError) as info:
        migrate_to_postgresql(parse_location(f"sqlite://{missing}"), target)
    assert str(info.value) == (
        f"there is no state database at {missing}; give the control plane's SQLite file "
        "(by default /var/lib/llmgw/llmgw.db)"
    )
    assert not missing.exists()
    assert _snapshot(target) == {}


def test_the_engines_must_be_sqlite_then_postgresql(
    source: Location, target: Location, tmp_path: Path
) -> None:
    _small(source)
    with pytest.raises(ConfigError, match=r"the source postgresql://.* is not a SQLite file"):
        migrate_to_postgresql(target, target)
    with pytest.raises(ConfigError, match=r"the target .*/other\.db is not a PostgreSQL database"):
        migrate_to_postgresql(source, parse_location(f"sqlite://{tmp_path}/other.db"))


def test_an_unreachable_target_names_host_and_port(source: Location, tmp_path: Path) -> None:
    _small(source)
    nowhere = parse_location(
        f"postgresql://{ROLE}@127.0.0.1:1/llmgw", password_file=tmp_path / "unused"
    )
    (tmp_path / "unused").write_text(PASSWORD + "\n")
    with pytest.raises(StoreUnavailable) as info:
        migrate_to_postgresql(source, nowhere)
    assert str(info.value).startswith(
        f"cannot reach database postgresql://{ROLE}@127.0.0.1:1/llmgw at 127.0.0.1:1 ("
    )
    assert PASSWORD not in str(info.value)


def test_a_wrong_password_is_refused_without_saying_it(
    pg_cluster: Any, source: Location, tmp_path: Path
) -> None:
    _small(source)
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    name = pg_cluster.fresh_database()
    with pytest.raises(ConfigError) as info:
        migrate_to_postgresql(
            source, parse_location(pg_cluster.url(name, password=False), password_file=wrong)
        )
    assert f"refused the credentials of role {ROLE}" in str(info.value)
    assert "not-the-password" not in str(info.value) and PASSWORD not in str(info.value)


def test_a_source_of_a_newer_schema_is_refused(source: Location, target: Location) -> None:
    _small(source)
    with sqlite3.connect(source.path) as conn:
        conn.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    with pytest.raises(StoreError) as info:
        migrate_to_postgresql(source, target)
    assert str(info.value) == (
        f"{source.path} has schema version {len(MIGRATIONS) + 1}, newer than this llmgw's "
        f"({len(MIGRATIONS)}); run migrate with the llmgw release that wrote it (a database "
        "is never downgraded)"
    )
    assert _snapshot(target) == {}


def test_a_source_of_an_older_schema_is_migrated_in_place_then_copied(
    source: Location, target: Location
) -> None:
    # A file the release before the leader's lease wrote (schema 7): its epoch in meta.
    with sqlite3.connect(source.path) as conn:
        for script in MIGRATIONS[:7]:
            for statement in split_sql(script):
                conn.execute(statement)
        conn.execute("INSERT INTO meta(key, value) VALUES ('epoch', '3'), ('cluster_id', 'c1')")
        conn.execute("INSERT INTO nodes(id, uid, created_at) VALUES ('gpu1', 'u1', 1.0)")
        conn.execute("PRAGMA user_version=7")
    done = migrate_to_postgresql(source, target)
    assert (done.upgraded_from, done.schema_version) == (7, len(MIGRATIONS))
    with Store.open(target) as pg:
        assert (pg.epoch(), pg.cluster_id(), pg.get_node("gpu1").uid) == (3, "c1", "u1")
        assert pg.get_meta("epoch") is None
    with sqlite3.connect(source.path) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


def test_a_row_postgresql_refuses_rolls_the_whole_copy_back(
    source: Location, target: Location
) -> None:
    _small(source)
    with Store.open(source) as s, s.transaction():
        # SQLite keeps a NUL in a text; PostgreSQL cannot. Events are copied after nodes.
        s.database.execute(
            "INSERT INTO events(ts, kind, subject, message) VALUES (1, 'node', 'gpu1', ?)",
            ("a\x00b",),
        )
    with pytest.raises(StoreError) as info:
        migrate_to_postgresql(source, target)
    assert str(info.value) == (
        f"copying table events into {target.display} failed at the row id = 2 (PostgreSQL "
        "text fields cannot contain NUL (0x00) bytes); nothing was written: correct the row "
        f"in {source.path} (sqlite3 {source.path}) and run migrate again"
    )
    assert _snapshot(target) == _seeded_only(target)


def test_a_table_the_target_lacks_fails_loudly(source: Location, target: Location) -> None:
    _small(source)
    with sqlite3.connect(source.path) as conn:
        conn.execute("CREATE TABLE extra (id TEXT PRIMARY KEY)")
        conn.execute("INSERT INTO extra VALUES ('x')")
    with pytest.raises(StoreError) as info:
        migrate_to_postgresql(source, target)
    assert f"(only in {source.path}: extra; only in {target.display}: none)" in str(info.value)
    assert _snapshot(target) == _seeded_only(target)


def test_a_lock_file_root_makes_is_given_to_the_state_directory_s_owner(
    source: Location,
    target: Location,
    state_dir: Path,
    pg_cluster: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Run as root on a state directory without leader.lock, migrate makes the file: the
    # control plane's user (who owns the directory) must still open it when it starts.
    _small(source)
    given: list[tuple[int, int]] = []
    monkeypatch.setattr("llmgw.server.store.transfer.os.geteuid", lambda: 0)
    monkeypatch.setattr(
        "llmgw.server.store.transfer.os.fchown", lambda fd, uid, gid: given.append((uid, gid))
    )
    assert not (state_dir / "leader.lock").exists()
    migrate_to_postgresql(source, target)
    st = state_dir.stat()
    assert given == [(st.st_uid, st.st_gid)]
    # A lock file that was there already keeps its owner.
    given.clear()
    again = parse_location(
        pg_cluster.url(pg_cluster.fresh_database(), password=False),
        password_file=pg_cluster.password_file(tmp_path),
    )
    migrate_to_postgresql(source, again)
    assert given == []
