"""Tests for the state database's migrations: applied once each, in order, to databases of
every version; those shipped never change."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.errors import Conflict, NotFound, StoreError
from llmgw.server.store import MIGRATIONS, Model, Replica, Shard, Store
from llmgw.server.store.location import Location, parse_location
from llmgw.server.store.schema import split_sql
from llmgw.server.store.states import NodeState, ReplicaState, ShardState, TokenKind, sql_check


def test_migrations_idempotent(db_location: Location) -> None:
    s = Store.open(db_location)
    assert s.schema_version() == len(MIGRATIONS)
    s.put_model("m", engine="vllm", params={"a": 1}, replicas=2)
    s.close()
    s = Store.open(db_location)
    assert s.schema_version() == len(MIGRATIONS)
    assert s.migrate() == len(MIGRATIONS)
    assert s.get_model("m").params == {"a": 1}
    s.close()


def test_future_schema_refused(db_path: Path) -> None:
    Store.open(db_path).close()
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version={len(MIGRATIONS) + 5}")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as info:
        Store.open(db_path)
    assert str(info.value) == (
        f"state database {db_path} has schema version {len(MIGRATIONS) + 5}, newer than this "
        f"llmgw ({len(MIGRATIONS)}); run the newer llmgw that wrote it (a database is never "
        "downgraded), or restore a backup taken before the upgrade"
    )


def test_a_postgresql_database_of_a_newer_schema_is_refused_and_left_alone(
    pg_cluster: Any, tmp_path: Path
) -> None:
    name = pg_cluster.fresh_database()
    where = parse_location(
        pg_cluster.url(name, password=False), password_file=pg_cluster.password_file(tmp_path)
    )
    Store.open(where).close()
    pg_cluster.psql(f"UPDATE llmgw_schema SET version = {len(MIGRATIONS) + 2}", database=name)
    with pytest.raises(StoreError) as info:
        Store.open(where)
    assert f"has schema version {len(MIGRATIONS) + 2}, newer than this llmgw" in str(info.value)
    assert "never downgraded" in str(info.value)
    assert where.display in str(info.value) and "test-password" not in str(info.value)
    assert pg_cluster.psql("SELECT version FROM llmgw_schema", database=name).strip() == str(
        len(MIGRATIONS) + 2
    )


def test_migration_2_tables(db_path: Path) -> None:
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS) >= 2
    conn = sqlite3.connect(db_path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    conn.close()
    assert {"join_tokens", "certificates"} <= tables
    assert "certificates_by_node" in indexes


def test_migration_2_upgrades_a_version_1_database(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    conn.executescript(MIGRATIONS[0])
    conn.execute("INSERT INTO nodes(id, uid, created_at) VALUES ('old', 'u1', 1.0)")
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS)
        assert s.get_node("old").uid == "u1"
        s.create_join_token("old", ttl=60)
        assert len(s.list_join_tokens()) == 1


def test_kind_is_checked_by_the_schema(store: Store) -> None:
    tok, _ = store.create_join_token("gpu-1", ttl=60)
    with pytest.raises(Conflict, match="out of range"), store.transaction():
        store._db.execute("UPDATE join_tokens SET kind = 'other' WHERE id = ?", (tok.id,))
    assert store.get_join_token(tok.id).kind == "join"


def _v2_database(path: Path) -> None:
    """A state database as llmgw with two migrations left it, with a node, a model, a
    replica, a shard, a key and a join token in it."""
    conn = sqlite3.connect(path, isolation_level=None)
    for script in MIGRATIONS[:2]:
        for statement in split_sql(script):
            conn.execute(statement)
    conn.execute("PRAGMA user_version=2")
    conn.execute(
        "INSERT INTO nodes(id, uid, state, inventory, created_at) "
        "VALUES ('gpu1', 'u1', 'approved', '{\"cpus\": 8}', 1.0)"
    )
    conn.execute(
        "INSERT INTO models(name, engine, params, replicas, created_at, updated_at) "
        "VALUES ('m', 'sim', '{\"ttft_ms\": 5}', 2, 1.0, 2.0)"
    )
    conn.execute(
        "INSERT INTO replicas(id, model, state, created_at, updated_at) "
        "VALUES ('m-abc', 'm', 'ready', 1.0, 1.0)"
    )
    conn.execute(
        "INSERT INTO shards(id, replica_id, node_id, rank, state, port, updated_at) "
        "VALUES ('m-abc-s0', 'm-abc', 'gpu1', 0, 'ready', 8001, 1.0)"
    )
    conn.execute(
        "INSERT INTO api_keys(id, name, prefix, hash, created_at) "
        "VALUES ('k1', 'ci', 'sk-llmgw-abc', 'h', 1.0)"
    )
    conn.execute(
        "INSERT INTO join_tokens(id, hash, prefix, node_id, kind, created_at, expires_at) "
        "VALUES ('t1', 'th', 'llmgwjt_abc', 'gpu2', 'join', 1.0, 99.0)"
    )
    conn.close()


def test_migration_3_upgrades_a_v2_database_and_keeps_its_data(db_path: Path) -> None:
    assert len(MIGRATIONS) >= 3
    _v2_database(db_path)
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS)
        node = s.get_node("gpu1")
        assert (node.state, node.inventory, node.lost, node.lost_at) == (
            "approved",
            {"cpus": 8},
            False,
            None,
        )
        assert s.get_model("m") == Model("m", "sim", {"ttft_ms": 5}, 2, 1.0, 2.0, {}, "default")
        assert [r.id for r in s.list_replicas("m")] == ["m-abc"]
        shard = s.get_shard("m-abc-s0")
        assert (shard.state, shard.port, shard.gpus, shard.dist_init_addr) == (
            "ready",
            8001,
            (),
            "",
        )
        assert [k.id for k in s.list_api_keys()] == ["k1"]
        assert s.get_join_token("t1").node_id == "gpu2"
        # A model from before the catalog keeps deploying: its engine is its default.
        scaled = s.deploy_model("m", profile="default", replicas=3)
        assert (scaled.engine, scaled.params, scaled.replicas) == ("sim", {"ttft_ms": 5}, 3)
        with pytest.raises(NotFound, match="deployed without the catalog, with engine sim"):
            s.deploy_model("m", profile="tp2", replicas=1)


def test_migration_5_leaves_older_replicas_without_a_profile(db_path: Path) -> None:
    # A replica placed before llmgw recorded profiles (here: from a v2 database) has none,
    # and a profile switch leaves it alone; new replicas get the deployed profile.
    _v2_database(db_path)
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS)
        assert s.get_replica("m-abc").profile is None
        assert s.add_replica("m").profile == "default"


def test_migration_10_gives_older_keys_no_limits_and_keeps_them(db_path: Path) -> None:
    # Keys made before policies: every limit off, priority normal, never expiring, last
    # changed when made; and an empty usage table beside them.
    conn = sqlite3.connect(db_path, isolation_level=None)
    for script in MIGRATIONS[:9]:
        for statement in split_sql(script):
            conn.execute(statement)
    conn.execute("PRAGMA user_version=9")
    for key_id, name, revoked in (("k1", "ci", None), ("k2", "ci", None), ("k3", "old", 9.0)):
        conn.execute(
            "INSERT INTO api_keys(id, name, prefix, hash, created_at, revoked_at) "
            "VALUES (?, ?, ?, ?, 3.5, ?)",
            (key_id, name, "sk-llmgw-" + key_id, "h" + key_id, revoked),
        )
    conn.close()
    with Store.open(db_path) as s:
        keys = s.list_api_keys(include_revoked=True)
        assert [(k.id, k.policy, k.updated_at) for k in keys] == [
            ("k1", KeyPolicy(), 3.5),
            ("k2", KeyPolicy(), 3.5),
            ("k3", KeyPolicy(), 3.5),
        ]
        assert s.list_usage() == []
        # Two active keys of one name, as older llmgw allowed: kept, named by their ids.
        with pytest.raises(Conflict, match=r"2 active API keys are named ci \(k1, k2\)"):
            s.get_api_key("ci")
        assert s.get_api_key("old").id == "k3"


# ------------------------------------------- the shipped migrations stay as they were

SHIPPED = Path(__file__).with_name("shipped_migrations.sql")


def _shipped() -> list[str]:
    scripts = re.split(r"^-- migration \d+\n", SHIPPED.read_text(), flags=re.MULTILINE)
    return scripts[1:]


def _words(sql: str) -> str:
    return " ".join(sql.split())


def test_the_shipped_migrations_are_unchanged() -> None:
    # Their CHECKs are generated from llmgw.server.store.states: a state added there must come
    # with a new migration, never change one that databases out there already ran.
    shipped = _shipped()
    assert len(MIGRATIONS) >= len(shipped) == 13
    for number, (now, then) in enumerate(zip(MIGRATIONS, shipped, strict=False), 1):
        assert _words(now) == _words(then), f"migration {number} changed"


def test_the_checks_name_the_states_of_llmgw_server_states() -> None:
    first, second = MIGRATIONS[0], MIGRATIONS[1]
    body = first.split("CREATE TABLE nodes (", 1)[1].split(");", 1)[0]
    assert sql_check("state", NodeState) in _words(body)
    assert sql_check("kind", TokenKind) in _words(second)
    # The states of replicas and shards, as the last migration to rebuild them wrote them.
    rebuilt = next(m for m in reversed(MIGRATIONS) if "CREATE TABLE shards (" in m)
    for table, states in (("replicas", ReplicaState), ("shards", ShardState)):
        body = rebuilt.split(f"CREATE TABLE {table} (", 1)[1].split(");", 1)[0]
        assert sql_check("state", states) in _words(body)
        assert _words(f"ADD CONSTRAINT {table}_state_check {sql_check('state', states)}") in (
            _words(rebuilt)
        )


def _schema(path: Path) -> list[tuple[str, str, str]]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY name"
        ).fetchall()
        return [(kind, name, _words(sql)) for kind, name, sql in rows]
    finally:
        conn.close()


@pytest.mark.parametrize("version", list(range(1, 13)))
def test_a_database_migrated_from_a_shipped_version_equals_a_fresh_one(
    tmp_path: Path, version: int
) -> None:
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old, isolation_level=None)
    for script in _shipped()[:version]:
        conn.executescript(script)
    conn.execute(f"PRAGMA user_version={version}")
    conn.close()
    Store.open(old).close()
    fresh = tmp_path / "fresh.db"
    Store.open(fresh).close()
    assert _schema(old) == _schema(fresh)
    assert len(_schema(fresh)) > 10


def test_migration_17_lets_replicas_and_shards_sleep_on_both_engines(
    store: Store, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    # The CHECKs widened (a table rebuild on SQLite, the constraint replaced on PostgreSQL).
    replica, (shard, *_) = replica_with_shards()
    for state in ("falling_asleep", "asleep", "waking", "ready"):
        store.set_replica_state(replica.id, state)
        assert store.get_replica(replica.id).state == state
    store.update_shard(shard.id, state="asleep", sleep_level=1, host_memory_mib=512)
    got = store.get_shard(shard.id)
    assert (got.state, got.sleep_level, got.host_memory_mib) == ("asleep", 1, 512)
    with pytest.raises(ValueError):
        store.set_replica_state(replica.id, "dozing")
