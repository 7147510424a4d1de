"""The events table: what happened to nodes and models, newest first, for operators.

It is bounded: a long message is cut, and every :attr:`Events.trim_every` insertions the
oldest events go, keeping at most :attr:`Events.max_events` of them and
:attr:`Events.max_bytes` characters over all.
"""

from __future__ import annotations

from llmgw.server.store.database import Database
from llmgw.server.store.rows import Event

__all__ = ["MAX_EVENTS", "MAX_EVENT_BYTES", "MAX_EVENT_MESSAGE", "MAX_EVENT_SUBJECT", "Events"]

MAX_EVENTS = 10_000
"""Events kept; older ones are trimmed every :attr:`Events.trim_every` inserts."""
MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Characters of kind, subject and message kept over all events (trimmed with the count)."""
MAX_EVENT_MESSAGE = 1000
"""Characters of one event's message; a longer one is cut (ending in '…')."""
MAX_EVENT_SUBJECT = 255


class Events:
    """The event log, bounded in count and size."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self.trim_every = 100
        """Insertions between two trims of the events table."""
        self.max_events = MAX_EVENTS
        self.max_bytes = MAX_EVENT_BYTES
        self._since_trim = self.trim_every  # trim on the first insert

    def add_event(self, kind: str, subject: str, message: str, actor: str = "") -> Event:
        """Record an event that *actor* (an operator, ``token``, '' for the control plane)
        caused, its message cut to :data:`MAX_EVENT_MESSAGE` characters (and its subject to
        :data:`MAX_EVENT_SUBJECT`); the oldest are trimmed to keep at most
        :attr:`max_events` events and :attr:`max_bytes` characters of them."""
        kind, subject = _cut(kind, 64), _cut(subject, MAX_EVENT_SUBJECT)
        message, actor = _cut(message, MAX_EVENT_MESSAGE), _cut(actor, 64)
        with self._db.write():
            event_id = self._db.insert_id(
                "INSERT INTO events(ts, kind, subject, message, actor) VALUES (?, ?, ?, ?, ?)",
                (self._db.clock(), kind, subject, message, actor),
            )
            self._since_trim += 1
            if self._since_trim >= self.trim_every:
                self._db.execute(
                    "DELETE FROM events WHERE id <= "
                    "(SELECT id FROM events ORDER BY id DESC LIMIT 1 OFFSET ?)",
                    (self.max_events,),
                )
                # The newest events up to max_bytes stay; older ones go.
                self._db.execute(
                    "DELETE FROM events WHERE id <= (SELECT id FROM (SELECT id, SUM("
                    "length(kind) + length(subject) + length(message)) OVER (ORDER BY id DESC) "
                    "AS total FROM events) AS sized WHERE total > ? ORDER BY id DESC LIMIT 1)",
                    (self.max_bytes,),
                )
                self._since_trim = 0
            row = self._db.one("SELECT * FROM events WHERE id = ?", (event_id,))
        assert row is not None
        return Event.from_row(row)

    def list_events(
        self,
        limit: int = 100,
        subject: str | None = None,
        *,
        kind: str | None = None,
        actor: str | None = None,
    ) -> list[Event]:
        """The most recent events, newest first, optionally only those about *subject*, of
        *kind* or taken by *actor* (each an exact match)."""
        where, args = _filters(subject=subject, kind=kind, actor=actor)
        rows = self._db.all(f"SELECT * FROM events{where} ORDER BY id DESC LIMIT ?", (*args, limit))
        return [Event.from_row(r) for r in rows]

    def events_after(self, after: int, limit: int = 100) -> list[Event]:
        """The events newer than the id *after*, oldest first (a live view's next ones)."""
        rows = self._db.all("SELECT * FROM events WHERE id > ? ORDER BY id LIMIT ?", (after, limit))
        return [Event.from_row(r) for r in rows]


def _filters(**equal: str | None) -> tuple[str, tuple[str, ...]]:
    """A WHERE clause of the columns given (names from the code, never from a request)."""
    given = [(column, value) for column, value in equal.items() if value is not None]
    if not given:
        return "", ()
    return " WHERE " + " AND ".join(f"{c} = ?" for c, _v in given), tuple(v for _c, v in given)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"
