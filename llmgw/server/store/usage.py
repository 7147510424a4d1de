"""The API keys' usage, as stored: one row per UTC day, key and model, of the requests, the
tokens and the errors the gateway counted. Every gateway instance (a standby included) adds
its own counts, about once a second, so a row only ever grows and the writes are not
fenced: a replaced leader's counts are as true as anyone's."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Any

from llmgw.contracts.keypolicy import USAGE_COUNTS, UsageRow
from llmgw.server.store.database import Database
from llmgw.server.store.rows import usage_from_row

__all__ = ["Usage"]

_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_ADD = (
    f"INSERT INTO usage(day, key_id, model, {', '.join(USAGE_COUNTS)}) "
    f"VALUES (?, ?, ?, {', '.join('?' for _ in USAGE_COUNTS)}) "
    "ON CONFLICT(day, key_id, model) DO UPDATE SET "
    + ", ".join(f"{c} = usage.{c} + excluded.{c}" for c in USAGE_COUNTS)
)


class Usage:
    """The usage table: counts added, read back by key, model and day."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add_usage(self, rows: Iterable[UsageRow]) -> None:
        """Add *rows*' counts to the stored ones, all in one transaction (a row not stored
        yet is made). Every row is checked first: a bad one raises :class:`ValueError` and
        nothing is added."""
        params = [_params(row) for row in rows]
        if not params:
            return
        with self._db.unfenced(), self._db.write():
            self._db.executemany(_ADD, params)

    def list_usage(
        self,
        key_id: str | None = None,
        model: str | None = None,
        since_day: str | None = None,
        until_day: str | None = None,
    ) -> list[UsageRow]:
        """The rows of *key_id* and *model*, on the days from *since_day* through
        *until_day* (``YYYY-MM-DD``, both included; None: no bound), each with its key's
        name; by day, key name, key id and model."""
        where: list[str] = []
        params: list[Any] = []
        for column, value in (("u.key_id", key_id), ("u.model", model)):
            if value is not None:
                where.append(f"{column} = ?")
                params.append(value)
        if since_day is not None:
            where.append("u.day >= ?")
            params.append(_day(since_day))
        if until_day is not None:
            where.append("u.day <= ?")
            params.append(_day(until_day))
        sql = (
            "SELECT u.*, COALESCE(k.name, '') AS key_name FROM usage u "
            "LEFT JOIN api_keys k ON k.id = u.key_id"
        )
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY u.day, key_name, u.key_id, u.model"
        return [usage_from_row(r) for r in self._db.all(sql, params)]

    def tokens_since(
        self, since_day: str, key_ids: Collection[str] | None = None
    ) -> dict[str, int]:
        """Tokens (prompt + completion) of each key on the days from *since_day* on, by key
        id (keys without any absent): what a key's budget is checked against. With
        *key_ids*, only those keys (read by the key's index: what the gateway asks each
        second for the keys that have a budget)."""
        day = _day(since_day)
        sql = (
            "SELECT key_id, SUM(prompt_tokens + completion_tokens) AS tokens FROM usage "
            "WHERE day >= ?"
        )
        if key_ids is None:
            rows = self._db.all(sql + " GROUP BY key_id", (day,))
            return {str(r["key_id"]): int(r["tokens"]) for r in rows}
        ids = sorted(set(key_ids))
        out: dict[str, int] = {}
        for at in range(0, len(ids), 500):
            part = ids[at : at + 500]
            marks = ", ".join("?" * len(part))
            for r in self._db.all(sql + f" AND key_id IN ({marks}) GROUP BY key_id", (day, *part)):
                out[str(r["key_id"])] = int(r["tokens"])
        return out


def _params(row: UsageRow) -> tuple[Any, ...]:
    counts = [getattr(row, c) for c in USAGE_COUNTS]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise ValueError(f"usage counts must be whole numbers of 0 or more; got {row!r}")
    if not row.key_id or not row.model:
        raise ValueError(f"a usage row needs its key id and its model; got {row!r}")
    return (_day(row.day), row.key_id, row.model, *counts)


def _day(day: str) -> str:
    if not isinstance(day, str) or not _DAY.fullmatch(day):
        raise ValueError(f"a usage day is YYYY-MM-DD (a UTC day); got {day!r}")
    return day
