"""The state database as the tables' modules see it, whichever engine holds it: statements
with ``?`` parameter markers, rows read by column name, transactions that nest, the clock rows are
stamped with, and every engine's error as a :class:`~llmgw.errors.StoreError` that says what
to do.

Two engines implement it: a SQLite file (:mod:`.sqlite`, the embedded default) and a
PostgreSQL database (:mod:`.postgres`, for several control-plane instances);
:meth:`~.store.Store.open` picks one by the database's :mod:`.location`. Writes on either are serialised as SQLite's ``BEGIN
IMMEDIATE`` does, so that the tables' read-then-write steps mean the same on both.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from llmgw.server.store.location import Location

__all__ = ["TABLE_NOUNS", "Cursor", "Database", "Row"]


TABLE_NOUNS = {
    "meta": "meta entry",
    "nodes": "node",
    "models": "model",
    "replicas": "replica",
    "shards": "shard",
    "api_keys": "API key",
    "events": "event",
    "join_tokens": "join token",
    "certificates": "certificate",
    "instances": "control-plane instance",
    "usage": "usage row",
    "login_sessions": "login session",
    "login_failures": "login failure count",
}
"""What a refused change calls a row of each table, in either engine's error messages."""


class Row(Protocol):
    """One row: by column name (``row["id"]``) or position (``row[0]``)."""

    def __getitem__(self, key: int | str) -> Any: ...

    def keys(self) -> list[str]: ...


class Cursor(Protocol):
    """What a statement left: the rows it changed, and those it returned."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> Sequence[Any]: ...


class Database(abc.ABC):
    """One state database, the clock its rows are stamped with, and the transaction in
    progress. Use from one thread.

    Never ``await`` inside :meth:`write`: other coroutines would write into the transaction.
    """

    engine: str
    """``sqlite`` or ``postgresql``: what the schema's statements are translated for."""

    def __init__(self, location: Location, *, clock: Callable[[], float] = time.time) -> None:
        self.location = location
        self.path = location.display
        self.clock = clock
        # Called at the start of each outermost write transaction, once the writers' lock
        # is held: the leadership's fencing check (raises to refuse the write).
        self.fence: Callable[[Database], None] | None = None

    # ---------------------------------------------------------------- statements

    @abc.abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> Cursor:
        """Run one statement; inside :meth:`write` when it changes anything."""

    @abc.abstractmethod
    def executemany(self, sql: str, params: list[tuple[Any, ...]]) -> Cursor: ...

    def one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        row: Row | None = self.execute(sql, params).fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        return list(self.execute(sql, params).fetchall())

    @abc.abstractmethod
    def insert_id(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run an INSERT into a table whose ``id`` the database numbers; the new row's id."""

    @abc.abstractmethod
    def write(self) -> contextlib.AbstractContextManager[None]:
        """A transaction: all changes inside commit together or not at all; nested ones use
        savepoints. The outermost one holds the writers' lock (one writer at a time, every
        process on the database included) from its first statement."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the database; later calls raise :class:`~llmgw.errors.StoreError`."""

    # ------------------------------------------------------------------- schema

    @abc.abstractmethod
    def schema_version(self) -> int:
        """The version of the schema the database has (0: empty)."""

    @abc.abstractmethod
    def set_schema_version(self, version: int) -> None:
        """Record *version*, inside the migration's :meth:`write`."""

    @abc.abstractmethod
    def run_script(self, statements: list[str]) -> None:
        """Run a migration's statements (SQLite's dialect), inside :meth:`write`."""

    @abc.abstractmethod
    def table_names(self) -> list[str]:
        """The tables the database holds (the schema's bookkeeping table excluded)."""

    def server_time(self) -> float:
        """Now, by the database's clock where several machines share it (a lease's expiry
        is judged by one clock); by :attr:`clock` for a database only this process uses."""
        return self.clock()

    # -------------------------------------------------------------------- misc

    def unused_id(self, table: str, make: Callable[[], str]) -> str:
        """The first id from ``make`` (a fresh random one each call) that no row of ``table``
        holds yet. Call it inside :meth:`write` and insert the row in the same transaction,
        so that no other writer takes the id in between."""
        if not table.isidentifier():
            raise ValueError(f"{table!r} is not a table name")
        while True:
            candidate = make()
            if self.one(f"SELECT 1 FROM {table} WHERE id = ?", (candidate,)) is None:
                return candidate

    @contextlib.contextmanager
    def unfenced(self) -> Iterator[None]:
        """Writes inside are not fenced (the leadership's own lease writes)."""
        fence, self.fence = self.fence, None
        try:
            yield
        finally:
            self.fence = fence
