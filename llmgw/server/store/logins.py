"""The login tables: operators' login sessions (console cookies, ``llmgw ctl login`` tokens)
and the failed logins counted per key (a source address, an account name).

A session is stored by the SHA-256 of its token, never the token, so that a copy of the
database logs nobody in. The failure counters live here rather than in memory so that a
lockout holds on every control-plane instance sharing a PostgreSQL database; each counter's
read-then-write runs under the writers' lock, so two instances counting at once lose no
attempt. An attempt is counted before its password is checked and taken back when the
password was right (:mod:`llmgw.server.accounts.lockout`), so that attempts made at once cannot all
be checked before the first failure is counted. The policy (how long a session lasts, how many failures lock) is the caller's
(:mod:`llmgw.server.accounts.logins`): these methods take the times and limits they apply.
"""

from __future__ import annotations

import hashlib

from llmgw.server.store.database import Database
from llmgw.server.store.rows import LOGIN_KINDS, StoredLogin

__all__ = ["MAX_LOGIN_AGENT", "LoginTables", "hash_session_token"]

MAX_LOGIN_AGENT = 200
"""Characters of a session's User-Agent kept (what the console shows of a session)."""
_MAX_ADDR = 255


def hash_session_token(token: str) -> str:
    """The hex SHA-256 of a session token: what the store keeps and looks it up by."""
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()


class LoginTables:
    """Login sessions and failure counters, over one database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    # ---------------------------------------------------------------- sessions

    def add_login_session(
        self,
        token_hash: str,
        operator_id: int,
        kind: str,
        *,
        csrf: str,
        now: float,
        expires_at: float,
        addr: str,
        agent: str,
    ) -> StoredLogin:
        """A new session of account *operator_id*, seen at *now*, over at *expires_at*."""
        if kind not in LOGIN_KINDS:
            raise ValueError(f"unknown login kind {kind!r}; use one of {', '.join(LOGIN_KINDS)}")
        with self._db.write():
            self._db.execute(
                "INSERT INTO login_sessions(token_hash, operator_id, kind, csrf, created_at, "
                "seen_at, expires_at, addr, agent) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    token_hash,
                    operator_id,
                    kind,
                    csrf,
                    now,
                    now,
                    expires_at,
                    addr[:_MAX_ADDR],
                    agent[:MAX_LOGIN_AGENT],
                ),
            )
            made = self.find_login_session(token_hash)
        assert made is not None
        return made

    def find_login_session(self, token_hash: str) -> StoredLogin | None:
        """The session stored under *token_hash* with its account's name, role and
        whether it is still active, or None."""
        row = self._db.one(
            "SELECT s.*, o.name, o.role, o.removed_at FROM login_sessions AS s "
            "JOIN operators AS o ON o.id = s.operator_id WHERE s.token_hash = ?",
            (token_hash,),
        )
        return None if row is None else StoredLogin.from_row(row)

    def list_login_sessions(self, operator_id: int | None = None) -> list[StoredLogin]:
        """Every session (or *operator_id*'s), oldest first."""
        sql = (
            "SELECT s.*, o.name, o.role, o.removed_at FROM login_sessions AS s "
            "JOIN operators AS o ON o.id = s.operator_id"
        )
        if operator_id is None:
            rows = self._db.all(sql + " ORDER BY s.created_at, s.token_hash")
        else:
            rows = self._db.all(
                sql + " WHERE s.operator_id = ? ORDER BY s.created_at, s.token_hash",
                (operator_id,),
            )
        return [StoredLogin.from_row(r) for r in rows]

    def touch_login_session(self, token_hash: str, seen_at: float) -> None:
        """Record that the session was used at *seen_at* (its idle expiry counts from it)."""
        with self._db.write():
            self._db.execute(
                "UPDATE login_sessions SET seen_at = ? WHERE token_hash = ?",
                (seen_at, token_hash),
            )

    def delete_login_session(self, token_hash: str) -> bool:
        """End one session; False when there was none."""
        with self._db.write():
            cur = self._db.execute("DELETE FROM login_sessions WHERE token_hash = ?", (token_hash,))
        return cur.rowcount > 0

    def delete_login_sessions_of(self, operator_id: int, *, keep: str | None = None) -> int:
        """End every session of account *operator_id* but the one stored as *keep*; how
        many ended."""
        with self._db.write():
            cur = self._db.execute(
                "DELETE FROM login_sessions WHERE operator_id = ? AND token_hash != ?",
                (operator_id, keep or ""),
            )
        return cur.rowcount

    def prune_login_sessions(self, now: float, *, idle: dict[str, float]) -> int:
        """Delete the sessions over by *now*: past their absolute expiry, or unused for
        their kind's *idle* seconds; how many went."""
        deleted = 0
        with self._db.write():
            for kind in LOGIN_KINDS:
                cur = self._db.execute(
                    "DELETE FROM login_sessions WHERE kind = ? AND (expires_at <= ? OR "
                    "seen_at <= ?)",
                    (kind, now, now - idle[kind]),
                )
                deleted += cur.rowcount
        return deleted

    # ---------------------------------------------------------------- failures

    def login_locked_until(self, keys: list[str], now: float) -> tuple[str, float] | None:
        """The key of *keys* locked longest past *now* and when its lock lifts, or None
        when none is locked."""
        if not keys:
            return None
        marks = ", ".join("?" for _ in keys)
        row = self._db.one(
            f"SELECT key, locked_until FROM login_failures WHERE key IN ({marks}) AND "
            "locked_until > ? ORDER BY locked_until DESC, key LIMIT 1",
            (*keys, now),
        )
        return None if row is None else (str(row["key"]), float(row["locked_until"]))

    def login_counter(self, key: str) -> tuple[int, float, float] | None:
        """*key*'s counter as stored: (attempts counted, when its window began, until when it
        is locked; 0: not), or None when nothing is counted against it."""
        row = self._db.one(
            "SELECT failures, first_at, locked_until FROM login_failures WHERE key = ?", (key,)
        )
        if row is None:
            return None
        return int(row["failures"]), float(row["first_at"]), float(row["locked_until"])

    def count_login_attempt(
        self, key: str, now: float, *, window: float, limit: int, lockout: float
    ) -> tuple[float, bool]:
        """Count one attempt against *key* before its password is checked (a success takes
        it back: :meth:`refund_login_attempt`). A count starts afresh when *window* seconds
        have passed since its first attempt or its lock has lifted; the *limit*-th attempt
        within the window locks *key* until *now* + *lockout*, the count kept (so that a
        refund can tell whether the failures alone reach the limit). The caller has checked,
        in the same transaction, that *key* is not locked. Returns when this count began
        (what a refund names) and whether this attempt locked *key*."""
        with self._db.write():
            found = self.login_counter(key)
            locked_until = 0.0
            if found is None or _spent(found, now, window):
                failures, first_at = 1, now
            else:
                failures, first_at, locked_until = found[0] + 1, found[1], found[2]
            # A lock in force is never pushed back (the caller should not count then).
            locks = failures >= limit and locked_until <= now
            if locks:
                locked_until = now + lockout
            self._db.execute(
                "INSERT INTO login_failures(key, failures, first_at, locked_until) "
                "VALUES (?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET failures = "
                "excluded.failures, first_at = excluded.first_at, "
                "locked_until = excluded.locked_until",
                (key, failures, first_at, locked_until),
            )
        return first_at, locks

    def refund_login_attempt(self, key: str, began: float, *, limit: int) -> bool:
        """Take back one attempt counted against *key* in the count that began at *began*
        (its password was right): a lock lifts when the attempts left fall below *limit*,
        since a lock is earned by failures, and this attempt was none. A count begun since
        (the window passed, the lock lifted) is left alone. True when a lock lifted."""
        with self._db.write():
            found = self.login_counter(key)
            if found is None or found[1] != began:
                return False
            failures, _first_at, locked_until = found
            failures = max(0, failures - 1)
            lifts = locked_until > 0 and failures < limit
            if failures == 0 and (lifts or locked_until == 0):
                # Nothing counted any more: as if no attempt had been made.
                self._db.execute("DELETE FROM login_failures WHERE key = ?", (key,))
            else:
                self._db.execute(
                    "UPDATE login_failures SET failures = ?, locked_until = ? WHERE key = ?",
                    (failures, 0.0 if lifts else locked_until, key),
                )
        return lifts

    def login_failures(self, key: str) -> int:
        """The attempts counted against *key* in its current count (failures, and attempts
        whose password is being checked); 0 for none."""
        row = self._db.one("SELECT failures FROM login_failures WHERE key = ?", (key,))
        return 0 if row is None else int(row["failures"])

    def prune_login_failures(self, now: float, *, window: float) -> int:
        """Delete the counters that no longer count: no lock in force and their window
        over; how many went."""
        with self._db.write():
            cur = self._db.execute(
                "DELETE FROM login_failures WHERE locked_until <= ? AND first_at <= ?",
                (now, now - window),
            )
        return cur.rowcount


def _spent(counter: tuple[int, float, float], now: float, window: float) -> bool:
    """Whether a counter no longer counts: its window is over, or its lock has lifted."""
    _failures, first_at, locked_until = counter
    return first_at + window <= now or 0 < locked_until <= now
