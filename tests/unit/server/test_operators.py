"""Operator accounts (llmgw.server.accounts.operators): the first admin is the admin password, one
secret changed from either side; verify answers for right, wrong, unknown and removed
accounts; every change is an event naming its actor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.errors import Conflict, PasswordError
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import (
    PASSWORD_FILE,
    PASSWORD_META,
    AdminPassword,
    hash_password,
)
from llmgw.server.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db", clock=lambda: 1000.0)
    yield s
    s.close()


def _started(tmp_path: Path, store: Store) -> tuple[AdminPassword, OperatorAccounts, str]:
    admin = AdminPassword(store, tmp_path / "state" / PASSWORD_FILE)
    admin.start()
    accounts = OperatorAccounts(store, admin)
    accounts.ensure_first_admin()
    return admin, accounts, (tmp_path / "state" / PASSWORD_FILE).read_text().strip()


def test_the_first_start_makes_admin_from_the_admin_password(tmp_path: Path, store: Store) -> None:
    _, accounts, password = _started(tmp_path, store)
    first = store.get_operator("admin")
    assert first.role == "admin" and first.created_by == "control-plane"
    assert first.password_hash == store.get_meta(PASSWORD_META)
    assert asyncio.run(accounts.verify("admin", password)) == first
    assert accounts.ensure_first_admin() is None  # once only
    assert [e.kind for e in store.list_events(subject="admin")] == ["operator_added"]


def test_an_upgraded_store_gets_admin_from_its_existing_hash(tmp_path: Path) -> None:
    # A store from before accounts: the admin password's hash in meta, no operators.
    path = tmp_path / "state.db"
    with Store.open(path) as old:
        old.set_meta(PASSWORD_META, hash_password("an old admin password"))
    with Store.open(path) as store:
        accounts = OperatorAccounts(store)
        assert accounts.ensure_first_admin() is not None
        assert asyncio.run(accounts.verify("admin", "an old admin password")) is not None


def test_no_first_admin_without_an_admin_password(store: Store) -> None:
    assert OperatorAccounts(store).ensure_first_admin() is None
    assert store.count_operators() == 0


def test_verify_right_wrong_unknown_and_removed(tmp_path: Path, store: Store) -> None:
    _, accounts, _ = _started(tmp_path, store)
    bob = asyncio.run(accounts.add("bob", "viewer", "bob's long password", actor="admin"))
    assert asyncio.run(accounts.verify("bob", "bob's long password")) == bob
    assert asyncio.run(accounts.verify("bob", "not bob's password")) is None
    assert asyncio.run(accounts.verify("bob", "")) is None
    assert asyncio.run(accounts.verify("bob", None)) is None
    assert asyncio.run(accounts.verify(None, "bob's long password")) is None
    accounts.remove("bob", actor="admin")
    assert asyncio.run(accounts.verify("bob", "bob's long password")) is None


def test_an_unknown_name_costs_a_hash_check(tmp_path: Path, store: Store) -> None:
    _, accounts, _ = _started(tmp_path, store)
    asyncio.run(accounts.verify("nobody", "warm the dummy hash"))
    start = time.perf_counter()
    assert asyncio.run(accounts.verify("nobody", "some password here")) is None
    # scrypt at N=2**14 takes tens of milliseconds; a bare lookup takes microseconds.
    assert time.perf_counter() - start > 0.005


def test_admin_s_password_is_changed_only_as_the_admin_password(
    tmp_path: Path, store: Store
) -> None:
    admin, accounts, old = _started(tmp_path, store)
    with pytest.raises(Conflict, match="change it with 'llmgw ctl admin password'"):
        asyncio.run(accounts.set_password("admin", "a brand new password", actor="admin"))
    asyncio.run(admin.check(old))
    assert store.get_operator("admin").password_hash == store.get_meta(PASSWORD_META)


def test_changing_the_admin_password_changes_admin(tmp_path: Path, store: Store) -> None:
    admin, accounts, old = _started(tmp_path, store)
    asyncio.run(admin.change(old, "changed through ctl admin", actor="token"))
    assert asyncio.run(accounts.verify("admin", "changed through ctl admin")) is not None
    assert asyncio.run(accounts.verify("admin", old)) is None


def test_another_account_leaves_the_admin_password_alone(tmp_path: Path, store: Store) -> None:
    admin, accounts, old = _started(tmp_path, store)
    asyncio.run(
        accounts.add(
            "carol",
            "admin",
            "carol's first password",
            actor="token",
            confirm_as="admin",
            confirm_password=old,
        )
    )
    asyncio.run(
        accounts.set_password(
            "carol",
            "carol's second password",
            actor="carol",
            confirm_as="carol",
            confirm_password="carol's first password",
        )
    )
    asyncio.run(admin.check(old))


def test_admin_is_neither_removed_nor_demoted(tmp_path: Path, store: Store) -> None:
    _, accounts, old = _started(tmp_path, store)
    asyncio.run(
        accounts.add(
            "carol", "admin", "carol's first password", actor="token", confirm_as="admin",
            confirm_password=old,
        )
    )  # fmt: skip
    with pytest.raises(Conflict, match="'admin' cannot be removed: its password is the admin"):
        accounts.remove("admin", actor="carol")
    with pytest.raises(Conflict, match="'admin' cannot be demoted"):
        asyncio.run(accounts.set_role("admin", "viewer", actor="carol"))
    assert store.get_operator("admin").role == "admin"


def test_a_short_password_is_refused(tmp_path: Path, store: Store) -> None:
    _, accounts, _ = _started(tmp_path, store)
    with pytest.raises(PasswordError, match="at least 12 characters; nothing was changed"):
        asyncio.run(accounts.add("bob", "viewer", "short", actor="admin"))
    assert store.find_operator("bob") is None


def test_every_change_is_an_event_naming_its_actor(tmp_path: Path, store: Store) -> None:
    _, accounts, old = _started(tmp_path, store)
    asyncio.run(accounts.add("bob", "viewer", "bob's long password", actor="token"))
    asyncio.run(accounts.set_password("bob", "bob's other password", actor="admin"))
    asyncio.run(
        accounts.set_role("bob", "admin", actor="admin", confirm_as="admin", confirm_password=old)
    )
    accounts.remove("bob", actor="admin")
    events = [(e.kind, e.message, e.actor) for e in reversed(store.list_events(subject="bob"))]
    assert events == [
        ("operator_added", "role viewer", "token"),
        ("operator_password_changed", "password changed", "admin"),
        ("operator_role_changed", "viewer -> admin", "admin"),
        ("operator_removed", "removed", "admin"),
    ]


def test_making_an_admin_needs_the_makers_own_password(tmp_path: Path, store: Store) -> None:
    # An admin account's password signs updates: were the admin token alone able to make
    # one, it could sign with it. So adding, promoting or re-keying an admin is confirmed.
    _, accounts, old = _started(tmp_path, store)
    for confirm in ({}, {"confirm_as": "admin", "confirm_password": "not the admin password"}):
        with pytest.raises(PasswordError, match="'carol' was not added"):
            asyncio.run(
                accounts.add("carol", "admin", "carol's long password", actor="token", **confirm)
            )
    assert store.find_operator("carol") is None
    asyncio.run(accounts.add("bob", "viewer", "bob's long password", actor="token"))
    with pytest.raises(PasswordError, match="'bob' was not promoted"):
        asyncio.run(accounts.set_role("bob", "admin", actor="token"))
    assert store.get_operator("bob").role == "viewer"
    asyncio.run(
        accounts.set_role("bob", "admin", actor="token", confirm_as="admin", confirm_password=old)
    )
    # bob, now an admin, re-keys no other admin without his own password ...
    asyncio.run(
        accounts.add(
            "carol", "admin", "carol's long password", actor="bob", confirm_as="bob",
            confirm_password="bob's long password",
        )
    )  # fmt: skip
    before = store.get_operator("carol").password_hash
    with pytest.raises(PasswordError, match="wrong password for the account 'bob'"):
        asyncio.run(
            accounts.set_password(
                "carol", "carol's new password", actor="bob", confirm_as="bob",
                confirm_password=old,
            )
        )  # fmt: skip
    assert store.get_operator("carol").password_hash == before
    # ... while a viewer's password, or a demotion, needs none.
    asyncio.run(accounts.add("dave", "viewer", "dave's long password", actor="bob"))
    asyncio.run(accounts.set_password("dave", "dave's other password", actor="bob"))
    asyncio.run(accounts.set_role("carol", "viewer", actor="bob"))


def test_confirm_checks_the_acting_accounts_password(tmp_path: Path, store: Store) -> None:
    _, accounts, old = _started(tmp_path, store)
    asyncio.run(accounts.add("bob", "viewer", "bob's long password", actor="token"))
    asyncio.run(accounts.confirm("admin", old, refused="nothing was signed"))
    asyncio.run(accounts.confirm("bob", "bob's long password", refused="nothing was signed"))
    # admin's wrong password is answered as the admin password's, saying where it was made.
    with pytest.raises(PasswordError, match=r"wrong admin password; nothing was signed\. It was"):
        asyncio.run(accounts.confirm("admin", "bob's long password", refused="nothing was signed"))
    with pytest.raises(PasswordError, match=r"wrong password for the account .bob.; nothing was"):
        asyncio.run(accounts.confirm("bob", old, refused="nothing was signed"))
    with pytest.raises(PasswordError, match="account 'nobody'"):
        asyncio.run(accounts.confirm("nobody", old, refused="nothing was signed"))
