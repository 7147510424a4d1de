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
(:class:`~llmgw.server.accounts.operators.OperatorAccounts` and
:meth:`~llmgw.server.accounts.passwords.AdminPassword.change` do it, in the change's transaction).

Failed logins count against the source address and the account name (an unknown name
too, so that probing names is limited as well), in :mod:`llmgw.server.accounts.lockout`: each login
is counted before its password is checked and taken back when it was right, so a locked
address or account is refused with :class:`LoginThrottled` before any password is checked,
the right password included, however many logins arrive at once.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmgw.errors import LlmgwError
from llmgw.log import kv
from llmgw.server.accounts.lockout import Lockout, LockoutPolicy, LoginThrottled
from llmgw.server.accounts.principals import Principal
from llmgw.server.store import LOGIN_KINDS, StoredLogin, hash_session_token

if TYPE_CHECKING:
    from llmgw.server.accounts.operators import OperatorAccounts
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
_MAX_AGENT = 200


@dataclass(frozen=True)
class LoginPolicy(LockoutPolicy):
    """How long sessions last and how many failed logins lock (server.yaml's ``console:``);
    every duration in seconds."""

    session_idle: float = 3600.0
    """A console session unused this long lapses."""
    session_lifetime: float = 12 * 3600.0
    """A console session lapses this long after its login, used or not."""
    cli_idle: float = 7 * 86400.0
    """An ``llmgw ctl login`` token unused this long lapses."""
    cli_lifetime: float = 30 * 86400.0

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
        :data:`~llmgw.server.accounts.principals.VIA_CONSOLE` or ``VIA_CLI``)."""
        return Principal(name=self.operator, role=self.role, via=self.kind)


class LoginRefused(LlmgwError):
    """The account name or the password is wrong (the message never says which)."""


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
        self.lockout = Lockout(store, policy, clock=clock)

    async def login(
        self,
        name: str,
        password: str,
        *,
        addr: str,
        kind: str,
        agent: str = "",
        vouched: bool = False,
    ) -> tuple[str, LoginSession]:
        """A new session for account *name* when *password* is its password: the token
        (given to the caller once, never stored) and the session. :class:`LoginThrottled`
        while the address or the account is locked (the password unchecked),
        :class:`LoginRefused` for a wrong name or password. *vouched*: the request carries
        a valid ctl credential of *name* (see :mod:`llmgw.server.accounts.lockout`)."""
        _check_kind(kind)
        found = await self.lockout.check(
            name, addr, lambda: self.operators.verify(name, password), vouched=vouched
        )
        if found is None:
            raise LoginRefused(
                "wrong account name or password; check both and try again (repeated "
                "failures lock logins for a while)"
            )
        now = self.clock()
        token = secrets.token_urlsafe(32)
        csrf = secrets.token_urlsafe(32) if kind == "console" else ""
        with self.store.transaction():
            stored = self.store.add_login_session(
                hash_session_token(token),
                found.id,
                kind,
                csrf=csrf,
                now=now,
                expires_at=now + self.policy.lifetime(kind),
                addr=_printable(addr),
                agent=_printable(agent)[:_MAX_AGENT],
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
        if not _token_like(token) or kind not in LOGIN_KINDS:
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
        if not _token_like(token):
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


def _token_like(token: object) -> bool:
    """Whether *token* could be a session token: a cookie or header that is not even ASCII
    (aiohttp keeps undecodable bytes as surrogates) names no session."""
    return isinstance(token, str) and bool(token) and token.isascii()


def _printable(text: str) -> str:
    """A header's text as the store can keep it: bytes that were not UTF-8 replaced."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _check_kind(kind: str) -> None:
    if kind not in LOGIN_KINDS:
        raise ValueError(f"unknown login kind {kind!r}; use one of {', '.join(LOGIN_KINDS)}")
