"""The lockout (llmgw.server.accounts.lockout): addresses keyed per IPv4 address and per IPv6 /64, a
locked account's owner still signing in from a fresh address with its ctl credential (and
nobody else), and the second secrets (the admin password's checks, account confirmations)
counted in the same lockout as logins, a locked one answered alike whatever the secret."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import llmgw.server.accounts.passwords as passwords_module
from llmgw.errors import PasswordError
from llmgw.server.accounts.lockout import Lockout, LockoutPolicy, LoginThrottled, address_key
from llmgw.server.accounts.logins import LoginPolicy, LoginRefused, Logins
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.accounts.passwords import PASSWORD_FILE, AdminPassword
from llmgw.server.store import Store
from tests.unit.clock import Clock

CAROL_PW = "carol's long password"


@pytest.mark.parametrize(
    ("addr", "key"),
    [
        ("192.0.2.7", "addr:192.0.2.7"),
        ("2001:db8:1:2:3:4:5:6", "addr:2001:db8:1:2::/64"),
        ("2001:DB8:1:2::ffff", "addr:2001:db8:1:2::/64"),
        ("::ffff:192.0.2.7", "addr:192.0.2.7"),  # an IPv4 client of a dual-stack socket
        ("fe80::1%eth0", "addr:fe80::/64"),
        ("::1", "addr:::/64"),
        ("", "addr:"),
        ("not an address", "addr:not an address"),
    ],
)
def test_addresses_are_keyed_per_ipv4_address_and_per_ipv6_64(addr: str, key: str) -> None:
    assert address_key(addr) == key


class Rig:
    """Accounts admin (the admin password) and carol (admin), logins, the admin password and
    the accounts all over one store, one lockout policy and the test's clock."""

    def __init__(self, store: Store, clock: Clock, tmp_path: Path, **policy: Any) -> None:
        self.store = store
        self.clock = clock
        self.policy = LoginPolicy(**policy)
        lockout = Lockout(store, self.policy, clock=clock)
        self.password = AdminPassword(store, tmp_path / PASSWORD_FILE, lockout=lockout)
        self.password.start()
        self.admin_pw = (tmp_path / PASSWORD_FILE).read_text().strip()
        self.accounts = OperatorAccounts(store, self.password)
        self.accounts.ensure_first_admin()
        asyncio.run(
            self.accounts.add(
                "carol",
                "admin",
                CAROL_PW,
                actor="admin",
                confirm_as="admin",
                confirm_password=self.admin_pw,
            )
        )
        self.logins = Logins(store, self.accounts, self.policy, clock=clock)

    def login(
        self, name: str, password: str, *, addr: str, vouched: bool = False
    ) -> str | Exception:
        """The session's account, or the refusal."""
        try:
            _token, session = asyncio.run(
                self.logins.login(name, password, addr=addr, kind="cli", vouched=vouched)
            )
        except (LoginRefused, LoginThrottled) as exc:
            return exc
        return session.operator

    def locks(self) -> list[tuple[str, str]]:
        return [
            (e.subject, e.message)
            for e in reversed(self.store.list_events(limit=1000))
            if e.kind == "login_locked"
        ]


def _kinds(answers: list[Any]) -> list[str]:
    return [a if isinstance(a, str) else type(a).__name__ for a in answers]


# ---------------------------------------------------- a locked account's owner


def test_a_locked_account_signs_in_from_a_fresh_address_with_its_ctl_credential(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    rig = Rig(store, clock, tmp_path)
    for i in range(5):  # a guesser locks carol from one address
        assert isinstance(rig.login("carol", f"guess {i}", addr="198.51.100.1"), LoginRefused)
    answers = [
        rig.login("carol", CAROL_PW, addr="192.0.2.10"),  # fresh, no credential
        rig.login("carol", CAROL_PW, addr="198.51.100.1", vouched=True),  # the failed one
        rig.login("carol", CAROL_PW, addr="192.0.2.11", vouched=True),  # fresh: in
        rig.login("carol", CAROL_PW, addr="192.0.2.11", vouched=True),  # and again
        rig.login("carol", "a wrong one", addr="192.0.2.12", vouched=True),  # checked
        rig.login("carol", CAROL_PW, addr="192.0.2.12", vouched=True),  # has failed now
        rig.login("carol", CAROL_PW, addr="192.0.2.13"),  # the lock itself holds
    ]
    assert _kinds(answers) == [
        "LoginThrottled",
        "LoginThrottled",
        "carol",
        "carol",
        "LoginRefused",
        "LoginThrottled",
        "LoginThrottled",
    ]
    assert len({str(a) for a in answers if isinstance(a, LoginThrottled)}) == 1
    clock.advance(900)  # after the lock's time, from anywhere
    assert rig.login("carol", CAROL_PW, addr="198.51.100.1") == "carol"


def test_a_stolen_ctl_token_does_not_reopen_guessing(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    rig = Rig(store, clock, tmp_path, failures_per_account=3)
    for i in range(3):
        rig.login("carol", f"guess {i}", addr="198.51.100.1")
    # The holder of carol's token guesses from one fresh address after another: three
    # failures lock that way in too, and its owner waits out the lock like everyone.
    tries = [
        rig.login("carol", f"token guess {i}", addr=f"192.0.2.{i}", vouched=True) for i in range(4)
    ]
    assert _kinds(tries) == ["LoginRefused"] * 3 + ["LoginThrottled"]
    assert isinstance(rig.login("carol", CAROL_PW, addr="192.0.2.50", vouched=True), LoginThrottled)
    subjects = [s for s, _ in rig.locks()]
    assert subjects == ["carol", "carol"]
    assert "someone holds a ctl token of it" in rig.locks()[1][1]


# ----------------------------------------------------------- second secrets


@pytest.fixture
def scrypt_checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The admin password checks that ran scrypt."""
    ran: list[str] = []
    real = passwords_module.check_password

    def counted(stored: str, password: str) -> bool:
        ran.append(password)
        return real(stored, password)

    monkeypatch.setattr(passwords_module, "check_password", counted)
    return ran


def test_guessing_the_admin_password_locks_it_and_the_right_one_then_answers_alike(
    store: Store, clock: Clock, tmp_path: Path, scrypt_checks: list[str]
) -> None:
    rig = Rig(store, clock, tmp_path)
    scrypt_checks.clear()

    def export(password: object, source: str = "192.0.2.1") -> str:
        try:
            asyncio.run(rig.password.check(password, refused="nothing was exported", source=source))
        except (PasswordError, LoginThrottled) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "exported"

    answers = [export(f"guess {i}") for i in range(30)]
    assert [a.split(":")[0] for a in answers] == ["PasswordError"] * 5 + ["LoginThrottled"] * 25
    assert len(scrypt_checks) == 5  # the others were never checked
    right = [export(rig.admin_pw), export(""), export(None), export(rig.admin_pw, "192.0.2.9")]
    assert set(right) == {answers[-1]}  # whatever the secret, from wherever
    assert len(scrypt_checks) == 5
    ((subject, message),) = rig.locks()
    assert subject == "admin"
    assert message.startswith(
        "account locked after 5 failed logins (the last an admin password confirmation "
        "(nothing was exported) from 192.0.2.1)"
    )
    # A login as admin is locked too: it is the same secret.
    assert isinstance(rig.login("admin", rig.admin_pw, addr="192.0.2.77"), LoginThrottled)


def test_an_account_confirmation_counts_against_the_account_and_the_source(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    rig = Rig(store, clock, tmp_path, failures_per_account=3, failures_per_address=4)

    def grant(by: str, password: str, source: str) -> str:
        try:
            asyncio.run(
                rig.accounts.set_role(
                    "dave" if by == "carol" else "erin",
                    "admin",
                    actor=by,
                    confirm_as=by,
                    confirm_password=password,
                    source=source,
                )
            )
        except (PasswordError, LoginThrottled) as exc:
            return type(exc).__name__
        return "granted"

    for name in ("dave", "erin"):
        asyncio.run(rig.accounts.add(name, "viewer", "a long enough password", actor="admin"))
    # carol's password guessed three times: carol is locked, from any source, right or not.
    assert [grant("carol", f"guess {i}", "192.0.2.1") for i in range(3)] == ["PasswordError"] * 3
    assert grant("carol", CAROL_PW, "192.0.2.2") == "LoginThrottled"
    assert grant("carol", "", "192.0.2.2") == "LoginThrottled"
    # The source's fourth failure (on another account) locks the source for every account.
    assert grant("admin", "a guess", "192.0.2.1") == "PasswordError"
    assert grant("admin", rig.admin_pw, "192.0.2.1") == "LoginThrottled"
    assert grant("admin", rig.admin_pw, "192.0.2.3") == "granted"
    assert [s for s, _ in rig.locks()] == ["carol", "192.0.2.1"]


def test_a_right_confirmation_takes_its_attempt_back(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    rig = Rig(store, clock, tmp_path)
    for _ in range(6):  # more than the account's limit: each was taken back
        asyncio.run(rig.password.check(rig.admin_pw, source="192.0.2.1"))
    assert store.login_counter("account:admin") is None
    assert store.login_counter("addr:192.0.2.1") is None


def test_a_lockout_without_a_policy_has_the_default_limits(store: Store) -> None:
    assert Lockout(store).policy == LockoutPolicy()
    assert AdminPassword(store, Path("/nonexistent")).lockout.policy == LockoutPolicy()
