"""Tests for the state database's connection: opening, file mode, and sqlite3 errors as StoreError."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import psycopg
import pytest

from llmgw.errors import Conflict, StoreError
from llmgw.server.store import (
    MIGRATIONS,
    Store,
)


def test_wal_mode_and_pragmas(sqlite_store: Store, db_path: Path) -> None:
    store = sqlite_store
    assert store.journal_mode() == "wal"
    assert store._db.one("PRAGMA foreign_keys")[0] == 1  # type: ignore[index]
    assert store._db.one("PRAGMA synchronous")[0] == 1  # type: ignore[index]  # NORMAL
    assert store._db.one("PRAGMA busy_timeout")[0] == 5000  # type: ignore[index]
    # WAL is persistent: a plain sqlite3 connection sees it too.
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_file_mode_0600(sqlite_store: Store, db_path: Path) -> None:
    store = sqlite_store
    store.set_meta("x", "y")
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600
    wal = db_path.with_name(db_path.name + "-wal")
    if wal.exists():
        assert stat.S_IMODE(wal.stat().st_mode) & 0o077 == 0


def test_missing_directory_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        Store.open(tmp_path / "nope" / "state.db")


def test_not_a_database_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a readable SQLite database") as info:
        Store.open(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


def test_memory_database() -> None:
    with Store.open(":memory:") as s:
        assert s.schema_version() == len(MIGRATIONS)
        s.put_model("m", engine="vllm", params={}, replicas=0)
        assert [m.name for m in s.list_models()] == ["m"]


def test_closed_store_raises_store_error(db_path: Path) -> None:
    s = Store.open(db_path)
    s.close()
    s.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        s.list_nodes()


def test_locked_database_is_store_error(db_path: Path) -> None:
    s = Store.open(db_path)
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        s._db.execute("PRAGMA busy_timeout=50")
        with pytest.raises(StoreError, match="locked") as info:
            s.set_meta("k", "v")
        assert str(db_path) in str(info.value)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    finally:
        other.execute("ROLLBACK")
        other.close()
    s.set_meta("k", "v")  # usable again once the lock is gone
    assert s.get_meta("k") == "v"
    s.close()


def test_integrity_error_becomes_conflict(store: Store) -> None:
    key, _ = store.create_api_key("a")
    with pytest.raises(Conflict, match="API key with this hash already exists") as info:
        with store._db.write():
            store._db.execute(
                "INSERT INTO api_keys(id, name, prefix, hash, created_at) VALUES (?,?,?,?,?)",
                ("other", "b", "p", key.hash, 0.0),
            )
    assert isinstance(info.value.__cause__, sqlite3.IntegrityError | psycopg.IntegrityError)
    assert [k.id for k in store.list_api_keys()] == [key.id]


def test_a_database_that_cannot_be_created_is_store_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "link", refuse)
    path = tmp_path / "state.db"
    with pytest.raises(StoreError) as info:
        Store.open(path)
    assert str(info.value) == (
        f"cannot create state database {path}: Permission denied; check the permissions "
        f"of {tmp_path}"
    )
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_existing_database_file_is_opened_not_replaced(db_path: Path) -> None:
    with Store.open(db_path) as s:
        s.set_meta("k", "v")
    with Store.open(db_path) as s:
        assert s.get_meta("k") == "v"


def test_unused_id_skips_the_ids_a_table_already_holds(store: Store) -> None:
    key, _ = store.create_api_key("taken")
    offered = iter([key.id, key.id, "fresh-id", "never-asked"])
    with store._db.write():
        assert store._db.unused_id("api_keys", lambda: next(offered)) == "fresh-id"
    assert next(offered) == "never-asked"


def test_unused_id_refuses_what_is_not_a_table_name(store: Store) -> None:
    with pytest.raises(ValueError, match="not a table name"):
        store._db.unused_id("api_keys; DROP TABLE nodes", lambda: "x")
