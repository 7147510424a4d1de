"""Login sessions of operator accounts: a console cookie or an ``llmgw ctl login`` token
made from an account's name and password, resolved back to the account on each request,
and the rate limits that keep a guesser from trying many passwords.

A token is ``secrets.token_urlsafe(32)``; the store keeps only its SHA-256, so a copy of
the database logs nobody in. A console session also has a CSRF token (random, compared by
the console's forms); a ctl token has none (it is a bearer token, never sent by a browser).

Each session lapses when unused for its kind's idle time or at its absolute lifetime,
whichever comes first. :meth:`Logins.resolve` records a use at most once a minute per
session (:data:`SEEN_EVERY`), so that a console polling every few seconds does not write on
every request: the idle expiry is exact to a minute (a session may lapse up to a minute
early). The account's role is read with the session on every resolve, so a demotion takes
effect at once; a removal, a role change or a password change ends the account's sessions
(:class:`~llmgw.server.operators.OperatorAccounts` and
:meth:`~llmgw.server.passwords.AdminPassword.change` do it, in the change's transaction).

Failed logins count against the source address and the account name (an unknown name
too, so probing names is limited as well). A key that reaches its limit within the
failure window is locked for the lockout: a login then is refused with
:class:`LoginThrottled` before the password is checked, the right password included, so a
locked account cannot be guessed at. The counters live in the store, so the limit holds
across the control-plane instances that share a PostgreSQL database. Failures are logged;
only a lock is an event (``login_locked``, once per lock of an existing account or of an
address), so that a guesser cannot flood the events.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.errors import LlmgwError
from llmgw.log import kv
from llmgw.server.principals import Principal
from llmgw.server.store import LOGIN_KINDS, StoredLogin, hash_session_token

if TYPE_CHECKING:
    from llmgw.server.operators import OperatorAccounts
    from llmgw.server.store import Store

__all__ = [
    "SEEN_EVERY",
    "LoginPolicy",
    "LoginRefused",
    "LoginSession",
    "LoginThrottled",
    "Logins",
]

log = logging.getLogger("llmgw.server.logins")

SEEN_EVERY = 60.0
"""Seconds between two writes of a session's last use (its idle expiry's precision)."""
_MAX_NAME = 64  # an operator name's longest: a longer one is no account's, counted cut


@dataclass(frozen=True)
class LoginPolicy:
    """How long sessions last and how many failed logins lock (server.yaml's ``console:``);
    every duration in seconds."""

    session_idle: float = 3600.0
    """A console session unused this long lapses."""
    session_lifetime: float = 12 * 3600.0
    """A console session lapses this long after its login, used or not."""
    cli_idle: float = 7 * 86400.0
    """An ``llmgw ctl login`` token unused this long lapses."""
    cli_lifetime: float = 30 * 86400.0
    failures_per_address: int = 20
    """Failed logins from one address within :attr:`failure_window` that lock it."""
    failures_per_account: int = 5
    """Failed logins for one account name within :attr:`failure_window` that lock it."""
    failure_window: float = 900.0
    lockout: float = 900.0
    """How long a locked address or account stays locked."""

    def idle(self, kind: str) -> float:
        return self.session_idle if kind == "console" else self.cli_idle

    def lifetime(self, kind: str) -> float:
        return self.session_lifetime if kind == "console" else self.cli_lifetime


@dataclass(frozen=True)
class LoginSession:
    """What a session token stands for: the account (its role as it is now), the kind of
    session, its CSRF token ('' for cli), and when it lapses (the earlier of the two)."""

    operator: str
    role: str
    kind: str
    csrf: str
    created_at: float
    expires_at: float
    idle_expires_at: float

    @property
    def principal(self) -> Principal:
        """Whom a request with this session acts as (its ``via`` the session's kind:
        :data:`~llmgw.server.principals.VIA_CONSOLE` or ``VIA_CLI``)."""
        return Principal(name=self.operator, role=self.role, via=self.kind)


class LoginRefused(LlmgwError):
    """The account name or the password is wrong (the message never says which)."""


class LoginThrottled(LlmgwError):
    """Too many failed logins from the address or for the account: ``retry_after`` seconds
    until the lock lifts."""

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Logins:
    """The login sessions and login rate limits of one control plane, over ``store``."""

    def __init__(
        self,
        store: Store,
        operators: OperatorAccounts,
        policy: LoginPolicy,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.operators = operators
        self.policy = policy
        self.clock = clock

    async def login(
        self, name: str, password: str, *, addr: str, kind: str, agent: str = ""
    ) -> tuple[str, LoginSession]:
        """A new session for account *name* when *password* is its password: the token
        (given to the caller once, never stored) and the session. :class:`LoginThrottled`
        while the address or the account is locked (the password unchecked),
        :class:`LoginRefused` for a wrong name or password."""
        _check_kind(kind)
        keys = _keys(name, addr)
        self._refuse_if_locked(keys, self.clock())  # before the (slow) scrypt check
        found = await self.operators.verify(name, password)
        now = self.clock()
        if found is None:
            self._count_failure(name, addr, kind, now)
            raise LoginRefused(
                "wrong account name or password; check both and try again (repeated "
                "failures lock logins for a while)"
            )
        token = secrets.token_urlsafe(32)
        csrf = secrets.token_urlsafe(32) if kind == "console" else ""
        with self.store.transaction():
            # Another instance, or a concurrent attempt, may have locked it meanwhile.
            self._refuse_if_locked(keys, now)
            self.store.clear_login_failures(keys[1], now)
            stored = self.store.add_login_session(
                hash_session_token(token),
                found.id,
                kind,
                csrf=csrf,
                now=now,
                expires_at=now + self.policy.lifetime(kind),
                addr=addr,
                agent=agent,
            )
            self.store.add_event(
                "operator_login", found.name, f"{kind} login from {addr or 'unknown'}", found.name
            )
        log.info("operator logged in", extra=kv(account=found.name, kind=kind, addr=addr))
        return token, self._session(stored, now)

    def resolve(self, token: str, kind: str) -> LoginSession | None:
        """The session *token* stands for, or None: unknown, lapsed (idle or absolute),
        of another kind, or its account removed. Records the use (at most once every
        :data:`SEEN_EVERY` seconds)."""
        if not isinstance(token, str) or not token or kind not in LOGIN_KINDS:
            return None
        token_hash = hash_session_token(token)
        stored = self.store.find_login_session(token_hash)
        if stored is None or stored.kind != kind or not stored.active:
            return None
        now = self.clock()
        if now >= stored.expires_at or now >= stored.seen_at + self.policy.idle(kind):
            self.store.delete_login_session(token_hash)
            return None
        seen = stored.seen_at
        if now - seen >= SEEN_EVERY:
            self.store.touch_login_session(token_hash, now)
            seen = now
        return self._session(stored, seen)

    def logout(self, token: str) -> None:
        """End the session *token* stands for (nothing when there is none)."""
        if not isinstance(token, str) or not token:
            return
        stored = self.store.find_login_session(hash_session_token(token))
        if stored is not None and self.store.delete_login_session(stored.token_hash):
            log.info("operator logged out", extra=kv(account=stored.operator, kind=stored.kind))

    def end_sessions_of(self, name: str, *, except_token: str | None = None) -> int:
        """End every session of the active account *name* but *except_token*'s; how many
        ended (0 for an unknown name)."""
        found = self.store.find_operator(name)
        if found is None:
            return 0
        keep = None if except_token is None else hash_session_token(except_token)
        ended = self.store.delete_login_sessions_of(found.id, keep=keep)
        if ended:
            log.info("operator sessions ended", extra=kv(account=name, sessions=ended))
        return ended

    def prune(self) -> int:
        """Delete the lapsed sessions and the failure counters that no longer count; how
        many rows went (the periodic clean-up: a lapsed session is refused without it)."""
        now = self.clock()
        policy = self.policy
        idle = {kind: policy.idle(kind) for kind in LOGIN_KINDS}
        with self.store.transaction():
            sessions = self.store.prune_login_sessions(now, idle=idle)
            failures = self.store.prune_login_failures(now, window=policy.failure_window)
        if sessions or failures:
            log.info("logins pruned", extra=kv(sessions=sessions, failure_counters=failures))
        return sessions + failures

    # ------------------------------------------------------------------ helpers

    def _session(self, stored: StoredLogin, seen_at: float) -> LoginSession:
        idle_end = min(seen_at + self.policy.idle(stored.kind), stored.expires_at)
        return LoginSession(
            operator=stored.operator,
            role=stored.role,
            kind=stored.kind,
            csrf=stored.csrf,
            created_at=stored.created_at,
            expires_at=stored.expires_at,
            idle_expires_at=idle_end,
        )

    def _refuse_if_locked(self, keys: list[str], now: float) -> None:
        locked = self.store.login_locked_until(keys, now)
        if locked is None:
            return
        key, until = locked
        wait = max(1, math.ceil(until - now))
        what = (
            f"from address {key.removeprefix('addr:')}"
            if key.startswith("addr:")
            else f"for account {key.removeprefix('account:')!r}"
        )
        raise LoginThrottled(
            f"too many failed logins {what}; logins are locked for {_span(wait)}: try again "
            f"then (at {_utc(until)}), or ask an admin to check the events",
            retry_after=wait,
        )

    def _count_failure(self, name: str, addr: str, kind: str, now: float) -> None:
        policy = self.policy
        addr_key, account_key = _keys(name, addr)
        with self.store.transaction():
            addr_locked = self.store.count_login_failure(
                addr_key,
                now,
                window=policy.failure_window,
                limit=policy.failures_per_address,
                lockout=policy.lockout,
            )
            account_locked = self.store.count_login_failure(
                account_key,
                now,
                window=policy.failure_window,
                limit=policy.failures_per_account,
                lockout=policy.lockout,
            )
            until = f"locked until {_utc(now + policy.lockout)}"
            if addr_locked:
                self.store.add_event(
                    "login_locked",
                    addr or "unknown",
                    f"address locked after {policy.failures_per_address} failed logins; {until}",
                )
            # An unknown name's lock is logged only: names made up by a guesser would
            # otherwise fill the events.
            known = isinstance(name, str) and self.store.find_operator(name) is not None
            if account_locked and known:
                self.store.add_event(
                    "login_locked",
                    name,
                    f"account locked after {policy.failures_per_account} failed logins "
                    f"(the last from {addr or 'unknown'}); {until}",
                )
        log.warning(
            "login failed",
            extra=kv(
                account=account_key.removeprefix("account:"),
                addr=addr,
                kind=kind,
                address_locked=addr_locked,
                account_locked=account_locked,
            ),
        )


def _keys(name: str, addr: str) -> list[str]:
    """The failure counters a login from *addr* for *name* counts against."""
    account = name[:_MAX_NAME] if isinstance(name, str) else ""
    return [f"addr:{addr}", f"account:{account}"]


def _check_kind(kind: str) -> None:
    if kind not in LOGIN_KINDS:
        raise ValueError(f"unknown login kind {kind!r}; use one of {', '.join(LOGIN_KINDS)}")


def _span(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds} s"
    return f"{math.ceil(seconds / 60)} min"


def _utc(when: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(when))
