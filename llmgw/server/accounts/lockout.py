"""The lockout that bounds password guesses: every check of an operator's password (a
login, and the confirmation that a CA export, a signed update, an admin password change or
a role grant asks for) counts against its source address and its account, and a key that
reaches its limit within the failure window is locked for the lockout.

An attempt is counted (reserved) before its password is checked, in the transaction that
finds neither key locked, and taken back when the password was right. So attempts sent at
once cannot all pass the lock check before the first failure is counted, and a locked key
is answered :class:`LoginThrottled` before any password is read: the same answer for the
right password as for a wrong one. A lock is earned by failures: when a right password
takes its attempt back and what is left is under the limit, the lock it took part in lifts.
The counters live in the store (:mod:`llmgw.server.store.logins`), whose writes are
serialised on SQLite and on PostgreSQL alike, so the limit holds across the control-plane
instances that share a database.

Addresses are keyed per IPv4 address and per IPv6 /64 (one host commonly holds a whole /64).
A locked account is no lever against its owner: from an address with no failure counted, a
login carrying a valid ctl credential of the account (``llmgw ctl login`` while signed in as
it, or the admin token for ``admin``) is checked although the account is locked. Those
attempts count against a key of their own (``ctl:account:NAME``, the account's limit), so a
stolen ctl token does not reopen guessing; and the account's lock runs its course.

Failures are logged; a lock is an event (``login_locked``) once, of an address or of an
existing account (an unknown name's lock is logged only, so a guesser cannot fill the
events).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from llmgw.errors import LlmgwError
from llmgw.log import kv

if TYPE_CHECKING:
    from llmgw.server.store import Store

__all__ = [
    "Attempt",
    "Lockout",
    "LockoutPolicy",
    "LoginThrottled",
    "account_key",
    "address_key",
]

log = logging.getLogger("llmgw.server.lockout")

T = TypeVar("T")

_MAX_NAME = 64  # an operator name's longest: a longer one is no account's, counted cut
_MAX_ADDR = 255
_ADDR = "addr:"
_ACCOUNT = "account:"
_VOUCHED = "ctl:"


@dataclass(frozen=True)
class LockoutPolicy:
    """How many failed password checks lock, and for how long (server.yaml's ``console:``
    ``login_*`` keys); durations in seconds."""

    failures_per_address: int = 20
    """Failed checks from one address within :attr:`failure_window` that lock it."""
    failures_per_account: int = 5
    """Failed checks for one account name within :attr:`failure_window` that lock it."""
    failure_window: float = 900.0
    lockout: float = 900.0
    """How long a locked address or account stays locked."""


class LoginThrottled(LlmgwError):
    """Too many failed logins from the address or for the account: ``retry_after`` seconds
    until the lock lifts."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def address_key(addr: str) -> str:
    """The counter a source address counts against: an IPv4 address itself, an IPv6 one's
    /64 (an IPv4-mapped one as IPv4), anything else (unknown: '') as given."""
    try:
        ip = ipaddress.ip_address(addr.partition("%")[0])  # a zone (fe80::1%eth0) is no host
    except ValueError:
        return _ADDR + addr[:_MAX_ADDR]
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _ADDR + str(ip.ipv4_mapped)
    if isinstance(ip, ipaddress.IPv6Address):
        return _ADDR + str(ipaddress.IPv6Network((ip, 64), strict=False))
    return _ADDR + str(ip)


def account_key(name: object) -> str:
    """The counter an account name counts against (an unknown name's too)."""
    return _ACCOUNT + (name[:_MAX_NAME] if isinstance(name, str) else "")


@dataclass(frozen=True)
class _Counted:
    key: str
    began: float  # when the count it went into began (what a refund names)
    limit: int
    locked: bool  # this attempt reached the limit


@dataclass(frozen=True)
class Attempt:
    """One password check, counted before it runs."""

    account: str
    addr: str
    counted: tuple[_Counted, ...]


class Lockout:
    """The password-guess limits of one control plane over ``store``, as ``policy`` sets
    them (server.yaml's ``console:``)."""

    def __init__(
        self,
        store: Store,
        policy: LockoutPolicy | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.policy = policy or LockoutPolicy()
        self.clock = clock

    async def check(
        self,
        account: str,
        addr: str,
        verify: Callable[[], Awaitable[T]],
        *,
        what: str = "a login",
        vouched: bool = False,
    ) -> T:
        """``verify()``'s answer (falsy: a wrong password), counted against *account* and
        *addr* while it runs: :class:`LoginThrottled` while either is locked, unchecked.
        *what* names the check in the log and the events ("a login", "a password
        confirmation"); *vouched*: the request carries a valid ctl credential of
        *account*."""
        attempt = self.reserve(account, addr, vouched=vouched)
        # An error or a cancel (the client went away) leaves the attempt counted: a guess
        # whose answer was not read is a guess all the same.
        result = await verify()
        if result:
            self.refund(attempt)
        else:
            self.failed(attempt, what)
        return result

    def refuse_if_locked(self, account: str, addr: str) -> None:
        """:class:`LoginThrottled` while *account* or *addr* is locked (for a request that
        has no password to check, so that it too gets the locked answer)."""
        now = self.clock()
        locked = self.store.login_locked_until([address_key(addr), account_key(account)], now)
        if locked is not None:
            raise self._throttled(*locked, now)

    def reserve(self, account: str, addr: str, *, vouched: bool = False) -> Attempt:
        """Count an attempt against *addr* and *account*, or :class:`LoginThrottled` (nothing
        counted) while either is locked; a *vouched* attempt from an address with nothing
        counted against it counts against the account's ctl key instead of its lock."""
        policy = self.policy
        now = self.clock()
        addr_key, acct_key = address_key(addr), account_key(account)
        keys = [(addr_key, policy.failures_per_address), (acct_key, policy.failures_per_account)]
        with self.store.transaction():
            locked = self.store.login_locked_until([addr_key, acct_key], now)
            if (
                vouched
                and locked is not None
                and locked[0] == acct_key
                and self._unfailed(addr_key, now)
            ):
                keys[1] = (_VOUCHED + acct_key, policy.failures_per_account)
                locked = self.store.login_locked_until([keys[1][0]], now)
                if locked is not None:  # answered as the account's lock is
                    locked = (acct_key, locked[1])
            if locked is not None:
                raise self._throttled(*locked, now)
            counted = []
            for key, limit in keys:
                began, locks = self.store.count_login_attempt(
                    key, now, window=policy.failure_window, limit=limit, lockout=policy.lockout
                )
                counted.append(_Counted(key, began, limit, locks))
        return Attempt(account, addr, tuple(counted))

    def refund(self, attempt: Attempt) -> None:
        """Take *attempt* back: its password was right."""
        with self.store.transaction():
            for counted in attempt.counted:
                self.store.refund_login_attempt(counted.key, counted.began, limit=counted.limit)

    def failed(self, attempt: Attempt, what: str) -> None:
        """*attempt* was a wrong password: it stays counted; a lock it set that still holds
        is an event."""
        now = self.clock()
        locked: list[str] = []
        with self.store.transaction():
            for counted in attempt.counted:
                if counted.locked and self.store.login_locked_until([counted.key], now):
                    locked.append(counted.key)
                    self._lock_event(attempt, counted, what, now)
        log.warning(
            "password check failed",
            extra=kv(
                what=what,
                account=account_key(attempt.account).removeprefix(_ACCOUNT),
                addr=attempt.addr,
                locked=",".join(locked),
            ),
        )

    # ------------------------------------------------------------------ helpers

    def _unfailed(self, key: str, now: float) -> bool:
        """Whether no failure counts against *key* now (none in its window, no lock)."""
        counter = self.store.login_counter(key)
        if counter is None:
            return True
        failures, first_at, locked_until = counter
        if locked_until > now:
            return False
        return failures == 0 or first_at + self.policy.failure_window <= now

    def _lock_event(self, attempt: Attempt, counted: _Counted, what: str, now: float) -> None:
        until = f"locked until {_utc(now + self.policy.lockout)}"
        source = attempt.addr or "unknown"
        if counted.key.startswith(_ADDR):
            self.store.add_event(
                "login_locked",
                counted.key.removeprefix(_ADDR) or "unknown",
                f"address locked after {counted.limit} failed logins (the last a {what}); {until}",
            )
            return
        name = attempt.account
        if self.store.find_operator(name) is None:
            return  # names made up by a guesser would otherwise fill the events
        if counted.key.startswith(_VOUCHED):
            message = (
                f"ctl logins of the locked account from new addresses locked after "
                f"{counted.limit} failures (the last from {source}): someone holds a ctl "
                f"token of it and guesses its password; {until}"
            )
        else:
            message = (
                f"account locked after {counted.limit} failed logins (the last {what} from "
                f"{source}); {until}"
            )
        self.store.add_event("login_locked", name, message)

    def _throttled(self, key: str, until: float, now: float) -> LoginThrottled:
        wait = max(1, math.ceil(until - now))
        if key.startswith(_ADDR):
            where = key.removeprefix(_ADDR)
            who = f"from addresses {where}" if "/" in where else f"from address {where}"
        else:
            who = f"for account {key.removeprefix(_ACCOUNT)!r}"
        return LoginThrottled(
            f"too many failed logins {who}; logins and password confirmations are locked for "
            f"{_span(wait)}: try again then (at {_utc(until)}), or ask an admin to check the "
            "events",
            retry_after=wait,
        )


def _span(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds} s"
    return f"{math.ceil(seconds / 60)} min"


def _utc(when: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(when))
