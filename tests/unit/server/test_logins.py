"""Login sessions and login rate limits (llmgw.server.accounts.logins), on both engines: a token
resolves to its account (its role as it is now) until it lapses, idle or at its lifetime;
the account's changes end its sessions; failed logins lock the address and the account,
before any password is checked, and a lock is one event."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.errors import PasswordError
from llmgw.server.accounts.logins import (
    SEEN_EVERY,
    LoginPolicy,
    LoginRefused,
    Logins,
    LoginSession,
    LoginThrottled,
)
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import PASSWORD_FILE, AdminPassword
from llmgw.server.accounts.principals import VIA_CLI, VIA_CONSOLE, Principal
from llmgw.server.store import LOGIN_KINDS, Store, hash_session_token
from llmgw.server.store.location import Location, parse_location
from tests.unit.clock import Clock

BOB_PW = "bob's long password"
CAROL_PW = "carol's long password"
ADDR = "203.0.113.9"


@pytest.fixture(params=["sqlite", "postgresql"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    if request.param == "sqlite":
        return parse_location(f"sqlite://{tmp_path}/state.db")
    cluster = request.getfixturevalue("pg_cluster")
    return parse_location(
        cluster.url(cluster.fresh_database(), password=False),
        password_file=cluster.password_file(tmp_path),
    )


@pytest.fixture
def store(location: Location, clock: Clock) -> Iterator[Store]:
    s = Store.open(location, clock=clock)
    yield s
    s.close()


class Rig:
    """Accounts admin (the admin password), bob (viewer) and carol (admin), and the logins
    over them, all on the test's clock."""

    def __init__(self, store: Store, clock: Clock, tmp_path: Path, policy: LoginPolicy) -> None:
        self.store = store
        self.clock = clock
        self.password = AdminPassword(store, tmp_path / PASSWORD_FILE)
        self.password.start()
        self.admin_pw = (tmp_path / PASSWORD_FILE).read_text().strip()
        self.accounts = OperatorAccounts(store, self.password)
        self.accounts.ensure_first_admin()
        self.confirm = {"confirm_as": "admin", "confirm_password": self.admin_pw}
        asyncio.run(self.accounts.add("bob", "viewer", BOB_PW, actor="admin"))
        asyncio.run(self.accounts.add("carol", "admin", CAROL_PW, actor="admin", **self.confirm))
        self.logins = Logins(store, self.accounts, policy, clock=clock)
        self.verified = 0
        verify = self.accounts.verify

        async def counted(name: object, password: object) -> Any:
            self.verified += 1
            return await verify(name, password)

        self.accounts.verify = counted  # type: ignore[method-assign]

    def login(
        self, name: str = "bob", password: str = BOB_PW, *, kind: str = "console", addr: str = ADDR
    ) -> tuple[str, LoginSession]:
        return asyncio.run(
            self.logins.login(name, password, addr=addr, kind=kind, agent="Mozilla/5.0 " * 40)
        )

    def refused(
        self, name: str = "bob", password: str = "a wrong password", *, addr: str = ADDR
    ) -> Exception:
        with pytest.raises((LoginRefused, LoginThrottled)) as info:
            self.login(name, password, addr=addr)
        return info.value

    def events(self, kind: str) -> list[tuple[str, str, str]]:
        return self.events_of(self.store, kind)

    @staticmethod
    def events_of(store: Store, kind: str) -> list[tuple[str, str, str]]:
        return [
            (e.subject, e.message, e.actor)
            for e in reversed(store.list_events(limit=1000))
            if e.kind == kind
        ]


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path) -> Rig:
    return Rig(store, clock, tmp_path, LoginPolicy())


def _small(store: Store, clock: Clock, tmp_path: Path, **policy: Any) -> Rig:
    return Rig(store, clock, tmp_path, LoginPolicy(**policy))


# ------------------------------------------------------------------- sessions


def test_a_login_makes_a_session_the_token_resolves_to(rig: Rig, clock: Clock) -> None:
    token, session = rig.login()
    assert len(token) >= 43 and len(session.csrf) >= 43 and session.csrf != token
    assert session == LoginSession(
        operator="bob",
        role="viewer",
        kind="console",
        csrf=session.csrf,
        created_at=clock(),
        expires_at=clock() + 12 * 3600,
        idle_expires_at=clock() + 3600,
    )
    assert rig.logins.resolve(token, "console") == session
    stored = rig.store.find_login_session(hash_session_token(token))
    assert stored is not None and stored.addr == ADDR and len(stored.agent) == 200
    # Only the token's hash is kept.
    every_row = [
        repr(list(r))
        for t in rig.store.database.table_names()
        for r in rig.store.database.all(f"SELECT * FROM {t}")
    ]
    assert token not in "\n".join(every_row)
    assert rig.events("operator_login") == [("bob", f"console login from {ADDR}", "bob")]


def test_a_session_is_a_principal_of_its_kind(rig: Rig) -> None:
    assert (VIA_CONSOLE, VIA_CLI) == LOGIN_KINDS  # a session's kind is its principal's via
    _, console = rig.login()
    assert console.principal == Principal(name="bob", role="viewer", via=VIA_CONSOLE)
    assert not console.principal.is_admin and console.principal.actor == "bob"
    _, cli = rig.login("carol", CAROL_PW, kind="cli")
    assert cli.principal == Principal(name="carol", role="admin", via=VIA_CLI)
    assert cli.principal.is_admin and cli.principal.password_account == "carol"


def test_a_cli_login_has_no_csrf_token_and_lives_longer(rig: Rig, clock: Clock) -> None:
    token, session = rig.login("carol", CAROL_PW, kind="cli")
    assert (session.kind, session.csrf, session.role) == ("cli", "", "admin")
    assert session.expires_at == clock() + 30 * 86400
    assert session.idle_expires_at == clock() + 7 * 86400
    clock.advance(3 * 86400)
    assert rig.logins.resolve(token, "cli") is not None
    assert rig.events("operator_login") == [("carol", f"cli login from {ADDR}", "carol")]


@pytest.mark.parametrize(
    ("name", "password"), [("bob", "a wrong password"), ("nobody", BOB_PW), ("bob", "")]
)
def test_a_wrong_password_and_an_unknown_name_are_refused_alike(
    rig: Rig, name: str, password: str
) -> None:
    refused = rig.refused(name, password)
    assert isinstance(refused, LoginRefused)
    assert str(refused) == (
        "wrong account name or password; check both and try again (repeated failures lock "
        "logins for a while)"
    )
    assert rig.store.login_failures(f"account:{name}") == 1
    assert rig.store.login_failures(f"addr:{ADDR}") == 1
    assert rig.store.list_login_sessions() == []
    assert rig.events("operator_login") == []


def test_an_unknown_kind_is_refused(rig: Rig) -> None:
    with pytest.raises(ValueError, match="unknown login kind 'web'; use one of console, cli"):
        rig.login(kind="web")
    assert rig.verified == 0
    token, _ = rig.login()
    assert rig.logins.resolve(token, "web") is None


def test_unknown_and_empty_tokens_resolve_to_nothing(rig: Rig) -> None:
    rig.login()
    assert rig.logins.resolve("not-a-token", "console") is None
    assert rig.logins.resolve("", "console") is None


def test_a_token_of_the_other_kind_resolves_to_nothing(rig: Rig) -> None:
    console, _ = rig.login()
    cli, _ = rig.login(kind="cli")
    assert rig.logins.resolve(console, "cli") is None
    assert rig.logins.resolve(cli, "console") is None
    assert rig.logins.resolve(console, "console") is not None
    assert rig.logins.resolve(cli, "cli") is not None


def test_an_unused_session_lapses_after_its_idle_time(rig: Rig, clock: Clock) -> None:
    token, _ = rig.login()
    clock.advance(3000)
    used = rig.logins.resolve(token, "console")  # a use: idle counts from here
    assert used is not None and used.idle_expires_at == clock() + 3600
    clock.advance(3599)
    assert rig.logins.resolve(token, "console") is not None
    clock.advance(3600)
    assert rig.logins.resolve(token, "console") is None
    assert rig.store.list_login_sessions() == []  # a lapsed session is deleted when seen
    clock.t -= 3600  # even were the clock to go back, it is gone
    assert rig.logins.resolve(token, "console") is None


def test_a_used_session_lapses_at_its_lifetime(rig: Rig, clock: Clock) -> None:
    token, session = rig.login()
    while clock() + 1800 < session.expires_at:
        clock.advance(1800)
        seen = rig.logins.resolve(token, "console")
        assert seen is not None
        assert seen.idle_expires_at == min(clock() + 3600, session.expires_at)
    clock.t = session.expires_at
    assert rig.logins.resolve(token, "console") is None


def test_last_use_is_written_at_most_once_a_minute(rig: Rig, clock: Clock) -> None:
    token, _ = rig.login()
    start = clock()

    def seen_at() -> float:
        stored = rig.store.find_login_session(hash_session_token(token))
        assert stored is not None
        return stored.seen_at

    for _ in range(5):
        clock.advance(10)
        session = rig.logins.resolve(token, "console")
        assert session is not None and session.idle_expires_at == start + 3600
    assert seen_at() == start  # 50 s of polling: no write
    clock.advance(SEEN_EVERY - 50)
    assert rig.logins.resolve(token, "console") is not None
    assert seen_at() == start + SEEN_EVERY
    clock.advance(1)
    rig.logins.resolve(token, "console")
    assert seen_at() == start + SEEN_EVERY


def test_a_demotion_is_seen_at_once(rig: Rig) -> None:
    token, session = rig.login("carol", CAROL_PW)
    assert session.role == "admin"
    # Straight in the store (the accounts would end the session too).
    rig.store.set_operator_role("carol", "viewer")
    seen = rig.logins.resolve(token, "console")
    assert seen is not None and seen.role == "viewer"


def test_a_removed_account_s_session_resolves_to_nothing(rig: Rig) -> None:
    token, _ = rig.login()
    rig.store.remove_operator("bob")  # straight in the store: the row alone says it
    assert rig.logins.resolve(token, "console") is None
    # A new account of the same name is not the old one's sessions.
    asyncio.run(rig.accounts.add("bob", "admin", BOB_PW, actor="admin", **rig.confirm))
    assert rig.logins.resolve(token, "console") is None


def test_logout_ends_one_session(rig: Rig) -> None:
    first, _ = rig.login()
    second, _ = rig.login()
    rig.logins.logout(first)
    rig.logins.logout(first)  # twice: nothing more to end
    rig.logins.logout("")
    assert rig.logins.resolve(first, "console") is None
    assert rig.logins.resolve(second, "console") is not None


def test_end_sessions_of_an_account_but_one(rig: Rig) -> None:
    kept, _ = rig.login()
    ended, _ = rig.login(kind="cli")
    other, _ = rig.login("carol", CAROL_PW)
    assert rig.logins.end_sessions_of("bob", except_token=kept) == 1
    assert rig.logins.resolve(kept, "console") is not None
    assert rig.logins.resolve(ended, "cli") is None
    assert rig.logins.end_sessions_of("bob") == 1
    assert rig.logins.resolve(kept, "console") is None
    assert rig.logins.end_sessions_of("nobody") == 0
    assert rig.logins.resolve(other, "console") is not None


# ------------------------------------------- the account's changes end its sessions


def test_a_password_change_ends_the_sessions_but_the_one_it_came_through(rig: Rig) -> None:
    through, _ = rig.login()
    other, _ = rig.login(kind="cli")
    carol, _ = rig.login("carol", CAROL_PW)
    asyncio.run(
        rig.accounts.set_password("bob", "bob's new password", actor="bob", keep_session=through)
    )
    assert rig.logins.resolve(through, "console") is not None
    assert rig.logins.resolve(other, "cli") is None
    assert rig.logins.resolve(carol, "console") is not None
    # Set by someone else: every session of bob's ends.
    asyncio.run(rig.accounts.set_password("bob", "bob's third password", actor="carol"))
    assert rig.logins.resolve(through, "console") is None


def test_a_role_change_ends_every_session(rig: Rig) -> None:
    token, _ = rig.login()
    asyncio.run(rig.accounts.set_role("bob", "viewer", actor="carol"))  # no change: it stays
    assert rig.logins.resolve(token, "console") is not None
    asyncio.run(rig.accounts.set_role("bob", "admin", actor="carol", **rig.confirm))
    assert rig.logins.resolve(token, "console") is None
    token, _ = rig.login()
    asyncio.run(rig.accounts.update("bob", role="viewer", actor="carol"))
    assert rig.logins.resolve(token, "console") is None


def test_a_removal_ends_every_session(rig: Rig) -> None:
    token, _ = rig.login()
    rig.accounts.remove("bob", actor="carol")
    assert rig.store.list_login_sessions() == []
    assert rig.logins.resolve(token, "console") is None


def test_an_admin_password_change_ends_admin_s_sessions(rig: Rig) -> None:
    through, _ = rig.login("admin", rig.admin_pw)
    other, _ = rig.login("admin", rig.admin_pw, kind="cli")
    bob, _ = rig.login()
    asyncio.run(
        rig.password.change(
            rig.admin_pw, "the second admin password", actor="admin", keep_session=through
        )
    )
    assert rig.logins.resolve(through, "console") is not None
    assert rig.logins.resolve(other, "cli") is None
    assert rig.logins.resolve(bob, "console") is not None
    asyncio.run(
        rig.password.change("the second admin password", "the third admin password", actor="x")
    )
    assert rig.logins.resolve(through, "console") is None


def test_a_refused_change_ends_nothing(rig: Rig) -> None:
    token, _ = rig.login()
    with pytest.raises(PasswordError, match="at least 12 characters"):
        asyncio.run(rig.accounts.set_password("bob", "short", actor="carol"))
    with pytest.raises(ValueError, match="unknown role 'root'"):
        asyncio.run(rig.accounts.set_role("bob", "root", actor="carol"))
    assert rig.logins.resolve(token, "console") is not None


# --------------------------------------------------------------- rate limits


def test_an_account_locks_after_its_failures_and_refuses_its_right_password(
    rig: Rig, clock: Clock
) -> None:
    for i in range(5):
        assert isinstance(rig.refused(addr=f"198.51.100.{i}"), LoginRefused)
    checked = rig.verified
    locked = rig.refused("bob", BOB_PW, addr="198.51.100.77")
    assert isinstance(locked, LoginThrottled) and locked.retry_after == 900
    assert str(locked).startswith(
        "too many failed logins for account 'bob'; logins and password confirmations are "
        "locked for 15 min: try again then (at "
    )
    assert rig.verified == checked  # the password was not even checked
    clock.advance(899)
    throttled = rig.refused("bob", BOB_PW)
    assert isinstance(throttled, LoginThrottled) and throttled.retry_after == 1
    assert "locked for 1 s" in str(throttled)
    clock.advance(1)
    token, _ = rig.login()  # the lock has lifted
    assert rig.logins.resolve(token, "console") is not None
    # Another account was never locked.
    rig.login("carol", CAROL_PW, addr="198.51.100.0")


def test_the_failures_count_within_the_window_only(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    rig = _small(store, clock, tmp_path, failures_per_account=3, failure_window=60.0)
    rig.refused()
    rig.refused()
    clock.advance(60)  # the window of the first failure is over: a new count
    assert isinstance(rig.refused(), LoginRefused)
    assert isinstance(rig.refused(), LoginRefused)
    assert rig.store.login_failures("account:bob") == 2
    assert isinstance(rig.refused(), LoginRefused)  # the third within a window: locked
    assert isinstance(rig.refused("bob", BOB_PW), LoginThrottled)


def test_a_success_takes_back_its_own_attempt_only(rig: Rig) -> None:
    for _ in range(4):
        rig.refused()
    rig.login()
    # The four failures still count in their window, on the account and on the address.
    assert rig.store.login_failures("account:bob") == 4
    assert rig.store.login_failures(f"addr:{ADDR}") == 4
    assert isinstance(rig.refused(), LoginRefused)  # the fifth failure locks
    assert isinstance(rig.refused("bob", BOB_PW), LoginThrottled)


def test_an_address_locks_for_every_name(store: Store, clock: Clock, tmp_path: Path) -> None:
    rig = _small(store, clock, tmp_path, failures_per_address=3, lockout=120.0)
    for name in ("alice", "dave", "erin"):  # probing names: one failure each
        assert isinstance(rig.refused(name, "some guess here"), LoginRefused)
    checked = rig.verified
    locked = rig.refused("carol", CAROL_PW)
    assert isinstance(locked, LoginThrottled) and locked.retry_after == 120
    assert str(locked).startswith(f"too many failed logins from address {ADDR}; logins and ")
    assert rig.verified == checked
    rig.login("carol", CAROL_PW, addr="192.0.2.1")  # another address logs in
    clock.advance(120)
    rig.login("carol", CAROL_PW)


def test_an_ipv6_64_locks_as_one_address(store: Store, clock: Clock, tmp_path: Path) -> None:
    rig = _small(store, clock, tmp_path, failures_per_address=3)
    for host, name in (("::1", "dave"), ("::2", "erin"), ("::3", "frank")):  # names probed
        assert isinstance(rig.refused(name, "some guess", addr=f"2001:db8:1:2{host}"), LoginRefused)
    locked = rig.refused("carol", CAROL_PW, addr="2001:db8:1:2:ffff:ffff:ffff:ffff")
    assert isinstance(locked, LoginThrottled)
    assert str(locked).startswith("too many failed logins from addresses 2001:db8:1:2::/64; ")
    rig.login("carol", CAROL_PW, addr="2001:db8:1:3::1")  # the next /64 is another address
    assert rig.events("login_locked")[0][0] == "2001:db8:1:2::/64"


def test_a_lock_is_one_event(store: Store, clock: Clock, tmp_path: Path) -> None:
    rig = _small(store, clock, tmp_path, failures_per_account=3, failures_per_address=5)
    for _ in range(3):
        rig.refused(addr="192.0.2.1")
    for _ in range(10):  # refused while locked: no more events
        assert isinstance(rig.refused(addr="192.0.2.2"), LoginThrottled)
    locks = rig.events("login_locked")
    assert len(locks) == 1
    subject, message, actor = locks[0]
    assert (subject, actor) == ("bob", "")
    assert message.startswith(
        "account locked after 3 failed logins (the last a login from 192.0.2.1)"
    )
    # An unknown name locks too, but only the log says so.
    for _ in range(3):
        rig.refused("nobody", "some guess here", addr="192.0.2.3")
    assert isinstance(rig.refused("nobody", "x", addr="192.0.2.4"), LoginThrottled)
    assert len(rig.events("login_locked")) == 1
    # An address's lock is an event about the address.
    for name in ("p1", "p2"):
        rig.refused(name, "some guess here", addr="192.0.2.3")
    addr_locks = [e for e in rig.events("login_locked") if e[0] == "192.0.2.3"]
    assert len(addr_locks) == 1
    assert addr_locks[0][1].startswith("address locked after 5 failed logins")
    # Failures are no events at all.
    assert {e.kind for e in rig.store.list_events(limit=1000)} <= {
        "admin_password_changed",
        "login_locked",
        "operator_added",
    }


def test_a_right_password_checked_as_the_limit_is_reached_lifts_the_lock_it_shared(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    rig = _small(store, clock, tmp_path, failures_per_account=3)
    verify = rig.accounts.verify
    # Two guesses arrive while bob's own login is checked: the third attempt locks, the
    # account is locked until the answers come in, and a fourth is refused unchecked.
    during: list[Exception] = []

    async def meanwhile(name: object, password: object) -> Any:
        if password == BOB_PW:
            for guess in ("guess one here", "guess two here"):
                during.append(await _refusal(rig.logins.login("bob", guess, addr=ADDR, kind="cli")))
            during.append(await _refusal(rig.logins.login("bob", BOB_PW, addr=ADDR, kind="cli")))
        return await verify(name, password)

    rig.accounts.verify = meanwhile  # type: ignore[method-assign]
    rig.login()
    assert [type(e) for e in during] == [LoginRefused, LoginRefused, LoginThrottled]
    # Two failures of three: bob's right password does not leave the account locked.
    assert rig.store.login_failures("account:bob") == 2
    assert rig.store.login_locked_until(["account:bob"], clock()) is None
    assert len(rig.events("login_locked")) == 1  # it was locked while bob's was checked
    assert isinstance(rig.refused(), LoginRefused)  # the third failure locks it now
    assert isinstance(rig.refused("bob", BOB_PW), LoginThrottled)
    assert len(rig.events("login_locked")) == 2


async def _refusal(login: Any) -> Exception:
    try:
        await login
    except (LoginRefused, LoginThrottled) as exc:
        return exc
    raise AssertionError("the login was let in")


def test_logins_at_once_on_several_instances_are_checked_at_most_the_limit(
    store: Store, location: Location, clock: Clock, tmp_path: Path
) -> None:
    """Four control-plane instances on one database (threads, a store each), 39 wrong
    passwords for bob sent at once, spread over them, and held in their checks: five are
    checked, the others refused unchecked; then the right password, sent while the five are
    still being checked, gets the very answer the wrong ones got, and does after them too."""
    Rig(store, clock, tmp_path, LoginPolicy())  # the accounts, in the shared database
    gate = threading.Event()
    lock = threading.Lock()
    checked: list[str] = []
    answers: list[object] = []
    instances: list[tuple[Store, Logins]] = []
    for _ in range(5):  # the fifth sends the right password
        mine = Store.open(location, clock=clock)
        accounts = OperatorAccounts(mine)
        verify = accounts.verify

        async def held(name: object, password: object, verify: Any = verify) -> Any:
            with lock:
                checked.append(str(password))
            await asyncio.to_thread(gate.wait, 60)
            return await verify(name, password)

        accounts.verify = held  # type: ignore[method-assign]
        instances.append((mine, Logins(mine, accounts, LoginPolicy(), clock=clock)))

    def instance(index: int, passwords: list[str]) -> None:
        async def attempt(logins: Logins, password: str) -> None:
            try:
                answer: object = await logins.login("bob", password, addr=ADDR, kind="cli")
            except (LoginRefused, LoginThrottled) as exc:
                answer = exc
            with lock:
                answers.append(answer)

        async def all_of_them() -> None:
            await asyncio.gather(*(attempt(instances[index][1], pw) for pw in passwords))

        asyncio.run(all_of_them())

    wrong = [f"wrong guess {i:02}" for i in range(39)]
    threads = [
        threading.Thread(target=instance, args=(i, wrong[i::4]), daemon=True) for i in range(4)
    ]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while len(checked) + len(answers) < 39 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(checked) == 5 and len(answers) == 34
        refusals = {str(a) for a in answers}
        assert all(isinstance(a, LoginThrottled) for a in answers) and len(refusals) == 1
        # The right password while the five are checked: refused alike, never checked.
        right = threading.Thread(target=instance, args=(4, [BOB_PW]))
        right.start()
        right.join(timeout=30)
        assert len(checked) == 5 and len(answers) == 35
        assert isinstance(answers[-1], LoginThrottled) and str(answers[-1]) in refusals
        gate.set()
        for thread in threads:
            thread.join(timeout=60)
        assert sorted(type(a).__name__ for a in answers[-5:]) == ["LoginRefused"] * 5
        after = threading.Thread(target=instance, args=(4, [BOB_PW]))
        after.start()
        after.join(timeout=30)
        assert isinstance(answers[-1], LoginThrottled) and str(answers[-1]) in refusals
        assert [e[0] for e in Rig.events_of(store, "login_locked")] == ["bob"]
    finally:
        gate.set()
        for thread in threads:
            thread.join(timeout=60)
        for mine, _ in instances:
            mine.close()


# --------------------------------------------------------------------- prune


def test_prune_deletes_lapsed_sessions_and_spent_counters(rig: Rig, clock: Clock) -> None:
    idle, _ = rig.login()
    cli, _ = rig.login(kind="cli")
    for _ in range(5):
        rig.refused("carol", "a wrong password", addr="192.0.2.1")  # carol: locked
    rig.refused("nobody", "some guess here", addr="192.0.2.2")
    clock.advance(1000)  # past the window and the lock
    live, _ = rig.login("carol", CAROL_PW, addr="192.0.2.9")
    clock.advance(2700)  # idle's hour is over; live has 900 s left
    assert rig.logins.prune() == 1 + 3  # idle; the counters of nobody and both addresses
    assert {s.token_hash for s in rig.store.list_login_sessions()} == {
        hash_session_token(cli),
        hash_session_token(live),
    }
    assert rig.logins.resolve(live, "console") is not None
    assert rig.logins.resolve(cli, "cli") is not None
    assert rig.logins.resolve(idle, "console") is None
    assert rig.logins.prune() == 0
    clock.advance(30 * 86400)
    assert rig.logins.prune() == 2
    assert rig.store.list_login_sessions() == []
