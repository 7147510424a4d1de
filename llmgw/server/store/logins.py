"""The login tables: operators' login sessions (console cookies, ``llmgw ctl login`` tokens)
and the failed logins counted per key (a source address, an account name).

A session is stored by the SHA-256 of its token, never the token, so that a copy of the
database logs nobody in. The failure counters live here rather than in memory so that a
lockout holds on every control-plane instance sharing a PostgreSQL database; each counter's
read-then-write runs under the writers' lock, so two instances counting at once lose no
failure. The policy (how long a session lasts, how many failures lock) is the caller's
(:mod:`llmgw.server.logins`): these methods take the times and limits they apply.
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
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


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

    def count_login_failure(
        self, key: str, now: float, *, window: float, limit: int, lockout: float
    ) -> bool:
        """Count one failed login against *key*; at the *limit*-th failure within *window*
        seconds of the first, lock it until *now* + *lockout* (its count starts again).
        True when this failure locked it."""
        with self._db.write():
            row = self._db.one(
                "SELECT failures, first_at, locked_until FROM login_failures WHERE key = ?",
                (key,),
            )
            if row is None:
                failures, first_at = 1, now
            elif float(row["first_at"]) + window <= now:
                failures, first_at = 1, now  # the window has passed: a new count
            else:
                failures, first_at = int(row["failures"]) + 1, float(row["first_at"])
            locks = failures >= limit
            if locks:
                failures, first_at, locked_until = 0, now, now + lockout
            else:  # not locked now: callers do not count while a lock holds
                locked_until = 0.0 if row is None else float(row["locked_until"])
            self._db.execute(
                "INSERT INTO login_failures(key, failures, first_at, locked_until) "
                "VALUES (?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET failures = "
                "excluded.failures, first_at = excluded.first_at, "
                "locked_until = excluded.locked_until",
                (key, failures, first_at, locked_until),
            )
        return locks

    def login_failures(self, key: str) -> int:
        """The failures counted against *key* in its current window (0: none, or locked)."""
        row = self._db.one("SELECT failures FROM login_failures WHERE key = ?", (key,))
        return 0 if row is None else int(row["failures"])

    def clear_login_failures(self, key: str, now: float) -> None:
        """Forget *key*'s failures (a success), unless it is locked at *now*: a lock runs
        its course."""
        with self._db.write():
            self._db.execute(
                "DELETE FROM login_failures WHERE key = ? AND locked_until <= ?", (key, now)
            )

    def prune_login_failures(self, now: float, *, window: float) -> int:
        """Delete the counters that no longer count: no lock in force and their window
        over; how many went."""
        with self._db.write():
            cur = self._db.execute(
                "DELETE FROM login_failures WHERE locked_until <= ? AND first_at <= ?",
                (now, now - window),
            )
        return cur.rowcount
