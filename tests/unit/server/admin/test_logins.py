"""The admin API's sign-in for ``llmgw ctl login`` (POST /api/login, /api/logout) and what
an account's token may do: an admin's changes are recorded under its name, a viewer's token
reads and is refused every change, a lapsed or ended token is nobody's; refusals with the
fix, throttling with Retry-After."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import PASSWORD_META, hash_password
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.admin.keys_rig import Admin

FIRST = "the first admin password"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db", clock=Clock(time.time()))
    s.set_meta(PASSWORD_META, hash_password(FIRST))
    accounts = OperatorAccounts(s)
    accounts.ensure_first_admin()
    asyncio.run(accounts.add("vera", "viewer", "vera's long password", actor="token"))
    yield s
    s.close()


def _login(admin: Admin, name: str, password: str) -> str:
    got = admin.ok("POST", "/api/login", {"name": name, "password": password}, 201)
    assert set(got) == {"token", "account", "role", "expires_at"} and got["account"] == name
    return str(got["token"])


def test_an_admin_s_token_acts_as_the_account(store: Store) -> None:
    admin = Admin(store)
    token = _login(admin, "admin", FIRST)
    status, me = admin.call("GET", "/api/whoami", token=token)
    assert (status, me) == (200, {"name": "admin", "role": "admin", "via": "cli"})
    status, _ = admin.call("POST", "/api/keys", {"name": "k1"}, token=token)
    assert status == 201
    assert [e.actor for e in store.list_events() if e.kind == "key_created"] == ["admin"]
    assert next(e.kind for e in store.list_events(subject="admin")) == "operator_login"


def test_a_viewer_s_token_reads_and_changes_nothing(store: Store) -> None:
    admin = Admin(store)
    token = _login(admin, "vera", "vera's long password")
    assert admin.call("GET", "/api/users", token=token)[0] == 200
    assert admin.call("GET", "/api/keys", token=token)[0] == 200
    for method, path, body in (
        ("POST", "/api/keys", {"name": "k1"}),
        ("POST", "/api/users", {"name": "eve", "role": "admin", "password": "x" * 12}),
        ("PATCH", "/api/users/vera", {"role": "admin"}),
        ("DELETE", "/api/users/admin", None),
        ("POST", "/api/join-tokens", {"node": "gpu-1"}),
    ):
        status, data = admin.call(method, path, body, token=token)
        assert status == 403, (path, data)
        assert data["error"]["code"] == "forbidden"
        assert (
            "'vera' is a viewer: it reads the cluster but changes nothing"
            in (data["error"]["message"])
        )
    assert store.list_api_keys() == [] and store.get_operator("vera").role == "viewer"
    # A viewer may still end its own login.
    assert admin.call("POST", "/api/logout", token=token) == (200, {"logged_out": True})
    assert admin.call("GET", "/api/whoami", token=token)[0] == 401


def test_a_demotion_takes_effect_on_the_next_request(store: Store) -> None:
    admin = Admin(store)
    asyncio.run(
        OperatorAccounts(store).add(
            "carl", "admin", "carl's long password", actor="token", confirm_as="admin",
            confirm_password=FIRST,
        )
    )  # fmt: skip
    token = _login(admin, "carl", "carl's long password")
    admin.ok("PATCH", "/api/users/carl", {"role": "viewer"})  # as the admin token
    # The role change ended carl's sessions: the token is nobody's now.
    assert admin.call("GET", "/api/whoami", token=token)[0] == 401


@pytest.mark.parametrize(
    ("body", "status", "code", "words"),
    [
        ({"name": "admin", "password": "wrong"}, 401, "wrong_login",
         "wrong account name or password; check both and try again"),
        ({"name": "nobody", "password": FIRST}, 401, "wrong_login", "wrong account name"),
        ({"name": "admin"}, 400, "bad_request", "a login takes 'name' (the account) and"),
        ({"name": "", "password": "x"}, 400, "bad_request", "a login takes 'name'"),
        ({"name": "admin", "password": FIRST, "kind": "console"}, 400, "bad_request",
         "unknown field 'kind'; a login takes name and password"),
    ],
)  # fmt: skip
def test_refused_logins_say_why(
    store: Store, body: dict[str, str], status: int, code: str, words: str
) -> None:
    got, data = Admin(store).call("POST", "/api/login", body, token=None)
    assert (got, data["error"]["code"]) == (status, code)
    assert words in data["error"]["message"]
    assert store.list_login_sessions() == []


def test_repeated_failures_are_throttled_with_retry_after(store: Store) -> None:
    admin = Admin(store)
    for _ in range(5):  # the default: 5 failures per account lock it
        wrong = admin.call("POST", "/api/login", {"name": "vera", "password": "x"}, token=None)
        assert wrong[0] == 401
    status, data = admin.call(
        "POST", "/api/login", {"name": "vera", "password": "vera's long password"}, token=None
    )
    assert status == 429 and data["error"]["code"] == "too_many_logins"
    assert "try again" in data["error"]["message"].lower()
    assert 1 <= int(admin.last_headers["Retry-After"]) <= 900


def test_logout_needs_the_login_s_own_token(store: Store) -> None:
    admin = Admin(store)
    for token in (None, "not a token", "admin-secret"):
        status, data = admin.call("POST", "/api/logout", token=token)
        assert status == 401 and "no login to end" in data["error"]["message"]
