"""The admin API's operator accounts: GET/POST /api/users, PATCH/DELETE /api/users/{name};
never a hash in an answer; every refusal says what to do and changes nothing."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import PASSWORD_META, check_password, hash_password
from llmgw.server.store import Store
from tests.unit.server.admin.keys_rig import Admin

FIRST = "the first admin password"


@pytest.fixture
def admin(store: Store) -> Admin:
    store.set_meta(PASSWORD_META, hash_password(FIRST))
    OperatorAccounts(store).ensure_first_admin()
    return Admin(store)


def _verify(store: Store, name: str, password: str) -> bool:
    return asyncio.run(OperatorAccounts(store).verify(name, password)) is not None


def test_add_list_change_and_remove(admin: Admin, store: Store) -> None:
    made = admin.ok(
        "POST", "/api/users", {"name": "bob", "role": "viewer", "password": "bob's password"}, 201
    )
    assert (made["name"], made["role"], made["created_by"]) == ("bob", "viewer", "token")
    listed = admin.ok("GET", "/api/users")
    assert [(u["name"], u["role"]) for u in listed] == [("admin", "admin"), ("bob", "viewer")]
    assert all("hash" not in key for u in listed for key in u)
    assert "scrypt" not in repr(listed)
    assert _verify(store, "bob", "bob's password")

    # Promoting needs the caller's own password: the admin password, for the admin token.
    promote = {"role": "admin", "password": "a new one, long"}
    message = admin.refused("PATCH", "/api/users/bob", promote, 403)
    assert "'bob' was not promoted: an admin account can sign updates" in message
    wrong = admin.refused(
        "PATCH", "/api/users/bob", {**promote, "confirm_password": "bob's password"}, 403
    )
    assert wrong.startswith("wrong password for the account 'admin'; 'bob' was not promoted")
    assert store.get_operator("bob").role == "viewer" and _verify(store, "bob", "bob's password")
    changed = admin.ok("PATCH", "/api/users/bob", {**promote, "confirm_password": FIRST})
    assert changed["role"] == "admin"
    assert _verify(store, "bob", "a new one, long") and not _verify(store, "bob", "bob's password")

    assert admin.ok("DELETE", "/api/users/bob") == {"removed": "bob"}
    assert [u["name"] for u in admin.ok("GET", "/api/users")] == ["admin"]
    kinds = [e.kind for e in reversed(store.list_events(subject="bob"))]
    assert kinds == [
        "operator_added", "operator_role_changed", "operator_password_changed", "operator_removed",
    ]  # fmt: skip


def test_the_admin_token_cannot_reset_the_admin_password(admin: Admin, store: Store) -> None:
    # The admin password is the second secret beside the token: the token must not reset it.
    before = store.get_meta(PASSWORD_META) or ""
    message = admin.refused(
        "PATCH", "/api/users/admin", {"password": "the second admin password"}, 409
    )
    assert "change it with 'llmgw ctl admin password', which asks for the current one" in message
    stored = store.get_meta(PASSWORD_META) or ""
    assert stored == before and check_password(stored, FIRST)
    assert store.get_operator("admin").password_hash == before
    assert not [e for e in store.list_events(subject="admin") if "password" in e.kind]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "message"),
    [
        ("POST", "/api/users", {"name": "Bob!", "role": "viewer", "password": "long enough pw"},
         400, "bad operator name 'Bob!': 1 to 64 characters of a-z, 0-9"),
        ("POST", "/api/users", {"name": "bob", "role": "root", "password": "long enough pw"},
         400, "unknown role 'root'; use one of admin, viewer"),
        ("POST", "/api/users", {"name": "bob", "role": "viewer", "password": "short"},
         400, "at least 12 characters"),
        ("POST", "/api/users", {"name": "bob", "role": "viewer"},
         400, "at least 12 characters"),
        ("POST", "/api/users", {"name": "bob", "role": "viewer", "password": "x" * 12, "x": 1},
         400, "unknown field 'x'; an account takes confirm_password, name, password, role"),
        ("POST", "/api/users", {"role": "viewer", "password": "long enough pw"},
         400, "name must be a string"),
        ("POST", "/api/users", {"name": "admin", "role": "viewer", "password": "long enough pw"},
         409, "operator 'admin' exists already: it is the admin password's account; change "
         "that password with 'llmgw ctl admin password'"),
        ("PATCH", "/api/users/nobody", {"role": "viewer"},
         404, "no operator 'nobody'; 'llmgw ctl users list' shows them"),
        ("PATCH", "/api/users/admin", {}, 400, "nothing to change: give role, password or both"),
        ("PATCH", "/api/users/admin", {"password": None}, 400, "password must be a string"),
        ("PATCH", "/api/users/admin", {"role": "viewer"},
         409, "'admin' cannot be demoted: its password is the admin password"),
        ("PATCH", "/api/users/admin", {"password": "long enough pw"},
         409, "is the admin password, the second secret beside the admin token"),
        ("DELETE", "/api/users/admin", None,
         409, "'admin' cannot be removed: its password is the admin password"),
        ("DELETE", "/api/users/nobody", None, 404, "no operator 'nobody'"),
    ],
)  # fmt: skip
def test_refusals_change_nothing(
    admin: Admin, store: Store, method: str, path: str, body: object, status: int, message: str
) -> None:
    before = (store.list_operators(), store.get_meta(PASSWORD_META), len(store.list_events()))
    assert message in admin.refused(method, path, body, status)
    assert (
        store.list_operators(),
        store.get_meta(PASSWORD_META),
        len(store.list_events()),
    ) == before


def test_a_change_with_a_refused_part_changes_nothing(admin: Admin, store: Store) -> None:
    admin.ok("POST", "/api/users", {"name": "carol", "role": "viewer", "password": "x" * 12}, 201)
    message = admin.refused("PATCH", "/api/users/carol", {"role": "admin", "password": "short"})
    assert "at least 12 characters" in message
    assert store.get_operator("carol").role == "viewer"
    admin.refused("PATCH", "/api/users/admin", {"role": "viewer", "password": "y" * 12}, 409)
    assert check_password(store.get_meta(PASSWORD_META) or "", FIRST)


def test_without_the_admin_token_nothing(admin: Admin) -> None:
    admin.ctx = type(admin.ctx)(**{**vars(admin.ctx), "admin_token": "other"})  # type: ignore[arg-type]
    status, _ = admin.call("GET", "/api/users")
    assert status == 401


def test_whoami_names_the_admin_token(admin: Admin) -> None:
    assert admin.ok("GET", "/api/whoami") == {"name": "token", "role": "admin", "via": "token"}
