"""The control plane's side of signed updates: the store's update rows (migration 4, counters
that only grow), and the admin password (scrypt hash, made once, changed with the old one)."""

from __future__ import annotations

import asyncio
import sqlite3
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmgw.errors import Conflict, PasswordError
from llmgw.server.store import MIGRATIONS, Store
from llmgw.server.updates import (
    PASSWORD_FILE,
    PASSWORD_META,
    Updates,
    check_password,
    hash_password,
)

ORDER = {"order": b'{"counter":1}', "signature": b"sig", "expires": 2000.0}


def test_migration_4_adds_update_rows_to_a_v3_database(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:3]:
        conn.executescript(script)
    conn.execute("PRAGMA user_version=3")
    conn.execute("INSERT INTO nodes(id, uid, created_at) VALUES ('gpu-1', 'u1', 1.0)")
    conn.commit()
    conn.close()
    with Store.open(path) as s:
        assert s.schema_version() == len(MIGRATIONS) >= 4
        assert s.get_node("gpu-1").uid == "u1"
        assert s.get_update("gpu-1") is None
        assert s.list_updates() == []
        assert s.next_update_counter("gpu-1") == 1


def test_counters_only_grow_per_node(store: Store) -> None:
    assert [store.next_update_counter("a") for _ in range(3)] == [1, 2, 3]
    assert store.next_update_counter("b") == 1
    # A reserved counter not used for an order is skipped, never given out again.
    assert store.get_update("a") is None
    with store.transaction():
        counter = store.next_update_counter("a")
        store.put_update(
            "a", counter=counter, version="0.2.0", state="queued", message="m", op_id="op", **ORDER
        )
    update = store.get_update("a")
    assert update is not None
    assert (update.counter, update.version, update.state, update.order) == (
        4,
        "0.2.0",
        "queued",
        b'{"counter":1}',
    )
    assert store.next_update_counter("a") == 5


def test_a_stale_counter_is_not_recorded(store: Store) -> None:
    first = store.next_update_counter("a")
    store.next_update_counter("a")
    with pytest.raises(Conflict, match="no longer the latest"):
        store.put_update(
            "a", counter=first, version="0.2.0", state="queued", message="", op_id="", **ORDER
        )
    assert store.get_update("a") is None


def test_update_state_is_set_only_for_the_latest_order(store: Store) -> None:
    counter = store.next_update_counter("a")
    store.put_update(
        "a", counter=counter, version="0.2.0", state="sent", message="", op_id="op", **ORDER
    )
    assert store.set_update_state("a", counter, "done", "upgraded to 0.2.0")
    assert not store.set_update_state("a", counter - 1 if counter > 1 else 99, "refused", "old")
    update = store.get_update("a")
    assert update is not None and (update.state, update.message) == ("done", "upgraded to 0.2.0")
    assert [u.node_id for u in store.list_updates()] == ["a"]


def test_update_rows_outlive_the_node(store: Store) -> None:
    store.upsert_node(
        "gpu-1", dataplane_addr="a:1", agent_version="0.1.0", inventory={}, connected=True
    )
    assert store.next_update_counter("gpu-1") == 1
    store.delete_node("gpu-1")
    assert store.next_update_counter("gpu-1") == 2


# -- the admin password ------------------------------------------------------------------------


def test_password_hashes_check_only_the_right_password() -> None:
    stored = hash_password("correct horse battery")
    assert stored.startswith("scrypt$16384$8$1$")
    assert "correct horse" not in stored
    assert check_password(stored, "correct horse battery")
    assert not check_password(stored, "correct horse batterY")
    assert not check_password(stored, "")
    assert not check_password("garbage", "correct horse battery")
    assert hash_password("same") != hash_password("same")  # salted


def _updates(tmp_path: Path, store: Store) -> Updates:
    cfg = SimpleNamespace(admin_token_file=tmp_path / "state" / "admin.token")
    cp = SimpleNamespace(cfg=cfg, store=store)
    return Updates(cast(Any, cp))


def test_the_first_start_makes_a_password_file_and_stores_only_its_hash(
    tmp_path: Path, store: Store
) -> None:
    updates = _updates(tmp_path, store)
    updates.start()
    path = tmp_path / "state" / PASSWORD_FILE
    password = path.read_text().strip()
    assert len(password) >= 20
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = store.get_meta(PASSWORD_META)
    assert stored is not None and password not in stored
    assert check_password(stored, password)
    # A restart keeps it.
    updates.start()
    assert path.read_text().strip() == password
    assert store.get_meta(PASSWORD_META) == stored


def test_a_kept_password_file_is_used_by_a_new_store(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "state" / PASSWORD_FILE
    path.parent.mkdir()
    path.write_text("an operator's own password\n")
    _updates(tmp_path, store).start()
    assert check_password(store.get_meta(PASSWORD_META) or "", "an operator's own password")


def test_wrong_and_right_passwords(tmp_path: Path, store: Store) -> None:
    updates = _updates(tmp_path, store)
    updates.start()
    password = (tmp_path / "state" / PASSWORD_FILE).read_text().strip()
    asyncio.run(updates.check(password))
    for wrong in ("nope", "", None, 12, password + "x"):
        with pytest.raises(PasswordError, match="wrong admin password; nothing was signed"):
            asyncio.run(updates.check(wrong))


def test_changing_the_password_needs_the_old_one(tmp_path: Path, store: Store) -> None:
    updates = _updates(tmp_path, store)
    updates.start()
    path = tmp_path / "state" / PASSWORD_FILE
    old = path.read_text().strip()
    before = store.get_meta(PASSWORD_META)
    with pytest.raises(PasswordError, match="wrong admin password"):
        asyncio.run(updates.change_password("not it", "a brand new password"))
    with pytest.raises(PasswordError, match="at least 12 characters"):
        asyncio.run(updates.change_password(old, "short"))
    with pytest.raises(PasswordError, match="is the old one"):
        asyncio.run(updates.change_password(old, old))
    assert store.get_meta(PASSWORD_META) == before
    assert path.exists()
    asyncio.run(updates.change_password(old, "a brand new password"))
    asyncio.run(updates.check("a brand new password"))
    with pytest.raises(PasswordError):
        asyncio.run(updates.check(old))
    assert not path.exists()  # the first password's file no longer tells the truth
