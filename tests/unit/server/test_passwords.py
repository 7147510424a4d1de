"""The admin password (llmgw.server.accounts.passwords): a scrypt hash, made once, changed only with
the old one; its errors are not update errors."""

from __future__ import annotations

import asyncio
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.errors import LlmgwError, PasswordError, UpdateError
from llmgw.server.accounts.passwords import (
    PASSWORD_FILE,
    PASSWORD_META,
    AdminPassword,
    check_password,
    hash_password,
)
from llmgw.server.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db", clock=lambda: 1000.0)
    yield s
    s.close()


def test_a_password_error_is_no_update_error() -> None:
    # A wrong password is refused by the admin API (403), not an update that failed.
    assert issubclass(PasswordError, LlmgwError)
    assert not issubclass(PasswordError, UpdateError)
    assert PasswordError("x").exit_code == 1


def test_password_hashes_check_only_the_right_password() -> None:
    stored = hash_password("correct horse battery")
    assert stored.startswith("scrypt$16384$8$1$")
    assert "correct horse" not in stored
    assert check_password(stored, "correct horse battery")
    assert not check_password(stored, "correct horse batterY")
    assert not check_password(stored, "")
    assert not check_password("garbage", "correct horse battery")
    assert hash_password("same") != hash_password("same")  # salted


def _password(tmp_path: Path, store: Store) -> AdminPassword:
    return AdminPassword(store, tmp_path / "state" / PASSWORD_FILE)


def test_the_first_start_makes_a_password_file_and_stores_only_its_hash(
    tmp_path: Path, store: Store
) -> None:
    admin = _password(tmp_path, store)
    admin.start()
    path = tmp_path / "state" / PASSWORD_FILE
    password = path.read_text().strip()
    assert len(password) >= 20
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = store.get_meta(PASSWORD_META)
    assert stored is not None and password not in stored
    assert check_password(stored, password)
    # A restart keeps it.
    admin.start()
    assert path.read_text().strip() == password
    assert store.get_meta(PASSWORD_META) == stored


def test_a_kept_password_file_is_used_by_a_new_store(tmp_path: Path, store: Store) -> None:
    path = tmp_path / "state" / PASSWORD_FILE
    path.parent.mkdir()
    path.write_text("an operator's own password\n")
    _password(tmp_path, store).start()
    assert check_password(store.get_meta(PASSWORD_META) or "", "an operator's own password")


def test_wrong_and_right_passwords(tmp_path: Path, store: Store) -> None:
    admin = _password(tmp_path, store)
    admin.start()
    password = (tmp_path / "state" / PASSWORD_FILE).read_text().strip()
    asyncio.run(admin.check(password))
    for wrong in ("nope", "", None, 12, password + "x"):
        with pytest.raises(PasswordError, match="wrong admin password; nothing was signed"):
            asyncio.run(admin.check(wrong))
    # What the refusal says was not done is the caller's (a CA export, say).
    with pytest.raises(PasswordError, match=r"^wrong admin password; nothing was exported\. "):
        asyncio.run(admin.check("nope", refused="nothing was exported"))


def test_changing_the_password_needs_the_old_one(tmp_path: Path, store: Store) -> None:
    admin = _password(tmp_path, store)
    admin.start()
    path = tmp_path / "state" / PASSWORD_FILE
    old = path.read_text().strip()
    before = store.get_meta(PASSWORD_META)
    with pytest.raises(PasswordError, match="wrong admin password"):
        asyncio.run(admin.change("not it", "a brand new password", actor="token"))
    with pytest.raises(PasswordError, match="at least 12 characters"):
        asyncio.run(admin.change(old, "short", actor="token"))
    with pytest.raises(PasswordError, match="is the old one"):
        asyncio.run(admin.change(old, old, actor="token"))
    assert store.get_meta(PASSWORD_META) == before
    assert path.exists()
    asyncio.run(admin.change(old, "a brand new password", actor="token"))
    asyncio.run(admin.check("a brand new password"))
    with pytest.raises(PasswordError):
        asyncio.run(admin.check(old))
    assert not path.exists()  # the first password's file no longer tells the truth
