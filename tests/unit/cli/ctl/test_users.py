"""``llmgw ctl users add|list|password|role|remove`` against the real admin API on a real
store (answered in process): the password from stdin or typed twice, never an argument; what
the operator reads; refusals with their fix."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import PASSWORD_META, check_password, hash_password
from llmgw.server.store import Store
from tests.unit.cli.ctl.fakeapi import FakeAPI, Status
from tests.unit.clock import Clock
from tests.unit.server.admin.keys_rig import Admin


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "state.db", clock=Clock(time.time()))
    s.set_meta(PASSWORD_META, hash_password("the first admin password"))
    OperatorAccounts(s).ensure_first_admin()
    yield s
    s.close()


@pytest.fixture
def admin(store: Store) -> Admin:
    return Admin(store)


@pytest.fixture
def api(admin: Admin) -> FakeAPI:
    return FakeAPI(lambda method, path, body: Status(*admin.call(method, path, body)))


def _verify(store: Store, name: str, password: str) -> bool:
    return asyncio.run(OperatorAccounts(store).verify(name, password)) is not None


def test_add_list_role_password_remove(
    api: FakeAPI, admin: Admin, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = api.ctl(
        "users", "add", "bob", "--role", "viewer", "--password-stdin", stdin="bob's password\n"
    )
    assert (out.exit_code, out.output) == (0, "added bob (viewer)\n")
    assert _verify(store, "bob", "bob's password")

    out = api.ctl("users", "list")
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "CREATED", "BY", "PASSWORD", "CHANGED"]
    assert [line.split()[:2] for line in lines[1:]] == [["admin", "admin"], ["bob", "viewer"]]
    listed = json.loads(api.ctl("users", "list", "--json").output)
    assert [u["name"] for u in listed] == ["admin", "bob"]

    # Making an admin asks the maker's own password: the admin password, with the token.
    out = api.ctl("users", "role", "bob", "admin")
    assert (out.exit_code, out.output) == (
        2,
        "error: no admin password: set LLMGW_ADMIN_PASSWORD or run in a terminal to be "
        "prompted; never pass it as an argument\n",
    )
    monkeypatch.setenv("LLMGW_ADMIN_PASSWORD", "not the admin password")
    out = api.ctl("users", "role", "bob", "admin")
    assert (
        out.exit_code == 1
        and "password for the account 'admin'; 'bob' was not promoted" in out.output
    )
    assert store.get_operator("bob").role == "viewer"
    monkeypatch.setenv("LLMGW_ADMIN_PASSWORD", "the first admin password")
    assert api.ctl("users", "role", "bob", "admin").output == "bob is now admin\n"
    out = api.ctl("users", "password", "bob", "--password-stdin", stdin="bob's second one\n")
    assert out.output == "changed the password of bob\n"
    assert _verify(store, "bob", "bob's second one")
    assert api.ctl("users", "remove", "bob").output == "removed bob\n"
    assert [o.name for o in store.list_operators()] == ["admin"]


def test_admin_s_password_is_changed_only_as_the_admin_password(
    api: FakeAPI, admin: Admin, store: Store
) -> None:
    before = store.get_meta(PASSWORD_META)
    out = api.ctl("users", "password", "admin", "--password-stdin", stdin="a new admin password\n")
    assert (out.exit_code, out.output) == (
        1,
        "error: the password of 'admin' is the admin password; change it with 'llmgw ctl "
        "admin password', which asks for the current one\n",
    )
    assert store.get_meta(PASSWORD_META) == before
    assert not check_password(before or "", "a new admin password")


def test_a_password_from_the_environment(api: FakeAPI, admin: Admin, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setenv("LLMGW_USER_PASSWORD", "carol's password")
    monkeypatch.setenv("LLMGW_ADMIN_PASSWORD", "the first admin password")  # makes an admin
    assert api.ctl("users", "add", "carol", "--role", "admin").exit_code == 0
    assert _verify(store, "carol", "carol's password")


@pytest.mark.parametrize(
    ("args", "stdin", "code", "message"),
    [
        (("users", "add", "bob", "--role", "viewer", "--password-stdin"), "short\n", 1,
         "error: an operator's password must have at least 12 characters; nothing was changed\n"),
        (("users", "add", "bob", "--role", "viewer", "--password-stdin"), "\n", 2,
         "error: no password on stdin; nothing was changed\n"),
        (("users", "add", "Bob", "--role", "viewer", "--password-stdin"), "long enough pw\n", 1,
         "error: bad operator name 'Bob': 1 to 64 characters of a-z, 0-9, '.', '_' and '-', "
         "starting with a letter\n"),
        (("users", "add", "bob", "--role", "viewer"), None, 2,
         "error: no password: set LLMGW_USER_PASSWORD or run in a terminal to be prompted; "
         "never pass it as an argument\n"),
        (("users", "remove", "admin"), None, 1,
         "error: 'admin' cannot be removed: its password is the admin password, which signs "
         "updates and exports the CA; change that password with 'llmgw ctl admin password'\n"),
        (("users", "remove", "nobody"), None, 1,
         "error: no operator 'nobody'; 'llmgw ctl users list' shows them\n"),
    ],
)  # fmt: skip
def test_refusals_say_what_to_do(
    api: FakeAPI,
    admin: Admin,
    store: Store,
    args: tuple[str, ...],
    stdin: str | None,
    code: int,
    message: str,
) -> None:
    # 2: what the command was given cannot be used (ConfigError); 1: the server refused.
    out = api.ctl(*args, stdin=stdin)
    assert (out.exit_code, out.output) == (code, message)
    assert [o.name for o in store.list_operators()] == ["admin"]


def test_an_unknown_role_is_refused_before_the_server_is_asked(api: FakeAPI, admin: Admin) -> None:
    out = api.ctl("users", "add", "bob", "--role", "root", "--password-stdin", stdin="x" * 12)
    assert out.exit_code == 2 and "'root' is not one of 'admin', 'viewer'" in out.output


def test_ctl_events_shows_who_did_it(api: FakeAPI, admin: Admin, store: Store) -> None:
    api.ctl("users", "add", "bob", "--role", "viewer", "--password-stdin", stdin="bob's password\n")
    out = api.ctl("events", "--subject", "bob")
    assert out.exit_code == 0, out.output
    header, row = out.output.splitlines()
    assert header.split() == ["TIME", "KIND", "SUBJECT", "BY", "MESSAGE"]
    assert row.split()[1:] == ["operator_added", "bob", "token", "role", "viewer"]
    assert json.loads(api.ctl("--json", "events").output)[0]["actor"] == "token"
