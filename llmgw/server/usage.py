"""Usage accounting: each key's requests, tokens and errors per model and UTC day, added up
in memory on the request path and flushed to the store once a second.

Never a database write per request: :meth:`UsageBook.record` adds to a dict, and
:meth:`UsageBook.flush` (every ``FLUSH_EVERY`` seconds, and once more at shutdown) writes
what piled up in one transaction, as additions to the store's rows, so that every gateway
instance adds its own counts to the same rows. A process killed without its shutdown (a
SIGKILL, a power cut) loses at most the last interval's counts. A flush the store refuses
(the database is away) keeps the counts for the next.

Each flush also reads back, for the keys with a budget, what they spent in their period
across all instances (:meth:`llmgw.server.limits.Limits.confirm`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable
from typing import Protocol

from llmgw.contracts.keypolicy import UsageRow, usage_day
from llmgw.errors import LlmgwError
from llmgw.log import kv
from llmgw.server.limits import Limits

__all__ = ["FLUSH_EVERY", "UsageBook", "UsageStore"]

log = logging.getLogger("llmgw.server.usage")

FLUSH_EVERY = 1.0
"""Seconds between flushes: what a crash may lose."""

_REQUESTS, _PROMPT, _COMPLETION, _CACHED, _ERRORS = range(5)


class UsageStore(Protocol):
    def add_usage(self, rows: Iterable[UsageRow]) -> None: ...

    def tokens_since(
        self, since_day: str, key_ids: Collection[str] | None = None
    ) -> dict[str, int]: ...


class UsageBook:
    """What this instance served and has not stored yet."""

    def __init__(
        self,
        store: UsageStore,
        limits: Limits | None = None,
        *,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.limits = limits
        self.wall = wall
        self._pending: dict[tuple[str, str, str], list[int]] = {}
        self._names: dict[str, str] = {}
        self._day = ""
        self._day_ends = 0.0
        self.flushes = 0
        self.failed_flushes = 0

    def _today(self) -> str:
        wall = self.wall()
        if wall >= self._day_ends:
            self._day = usage_day(wall)
            self._day_ends = (wall // 86400 + 1) * 86400
        return self._day

    def record(
        self,
        key_id: str,
        key_name: str,
        model: str,
        *,
        prompt: int = 0,
        completion: int = 0,
        cached: int = 0,
        error: bool = False,
    ) -> None:
        """One request of ``key_id`` to ``model`` ended (``error``: it failed, by the
        gateway's refusal, the engine's error status or a broken stream)."""
        entry = self._pending.get((day := self._today(), key_id, model))
        if entry is None:
            entry = self._pending[(day, key_id, model)] = [0, 0, 0, 0, 0]
            self._names[key_id] = key_name
        entry[_REQUESTS] += 1
        entry[_PROMPT] += prompt
        entry[_COMPLETION] += completion
        entry[_CACHED] += cached
        if error:
            entry[_ERRORS] += 1

    def pending(self) -> list[UsageRow]:
        """What is held and not stored yet (the admin API adds it to the store's rows)."""
        return [self._row(k, v) for k, v in self._pending.items()]

    def _row(self, key: tuple[str, str, str], v: list[int]) -> UsageRow:
        day, key_id, model = key
        return UsageRow(
            day,
            key_id,
            model,
            requests=v[_REQUESTS],
            prompt_tokens=v[_PROMPT],
            completion_tokens=v[_COMPLETION],
            cached_tokens=v[_CACHED],
            errors=v[_ERRORS],
            key_name=self._names.get(key_id, ""),
        )

    def flush(self) -> int:
        """Store what is held (one transaction) and refresh the budgets' totals; how many
        rows were stored. Raises the store's error, the counts kept for the next flush."""
        taken, self._pending = self._pending, {}
        rows = [self._row(k, v) for k, v in taken.items()]
        if rows:
            try:
                self.store.add_usage(rows)
            except BaseException:
                self._put_back(taken)
                raise
        self.flushes += 1
        if self.limits is not None:
            flushed: dict[str, int] = {}
            for (_day, key_id, _model), v in taken.items():
                flushed[key_id] = flushed.get(key_id, 0) + v[_PROMPT] + v[_COMPLETION]
            budgeted = self.limits.budgeted()
            totals = {
                since: self.store.tokens_since(since, [s.id for s in states])
                for since, states in budgeted.items()
            }
            self.limits.confirm(flushed, totals)
        return len(rows)

    def _put_back(self, taken: dict[tuple[str, str, str], list[int]]) -> None:
        for key, v in taken.items():
            entry = self._pending.get(key)
            if entry is None:
                self._pending[key] = v
            else:
                for i, n in enumerate(v):
                    entry[i] += n

    async def run(self, every: float = FLUSH_EVERY) -> None:
        """Flush every ``every`` seconds until cancelled; the caller flushes once more at
        shutdown."""
        while True:
            await asyncio.sleep(every)
            if not self._pending and (self.limits is None or not self.limits.budgeted()):
                continue
            try:
                self.flush()
            except LlmgwError as exc:
                self.failed_flushes += 1
                if self.failed_flushes == 1 or self.failed_flushes % 60 == 0:
                    log.warning(
                        "cannot store usage; kept in memory for the next flush",
                        extra=kv(error=str(exc), failed=self.failed_flushes),
                    )
            else:
                if self.failed_flushes:
                    log.info("usage stored again", extra=kv(after=self.failed_flushes))
                self.failed_flushes = 0
