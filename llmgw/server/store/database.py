"""The state database's connection: opening the SQLite file, transactions, and turning
every sqlite3 error into a :class:`~llmgw.errors.StoreError` that says what to do.

With :mod:`llmgw.server.store.schema` this is where the store is SQLite: the tables'
modules write portable SQL through :meth:`Database.one`, :meth:`Database.all` and
:meth:`Database.execute` inside :meth:`Database.write`.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from llmgw.errors import Conflict, FileError, StoreError
from llmgw.fsutil import create_file

__all__ = ["Database"]


class Database:
    """One connection to the state database, the clock its rows are stamped with, and the
    transaction in progress. Use from one thread.

    Never ``await`` inside :meth:`write`: other coroutines would write into the transaction.
    """

    def __init__(
        self, conn: sqlite3.Connection, path: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._conn: sqlite3.Connection | None = conn
        self.path = path
        self.clock = clock
        self._depth = 0

    @classmethod
    def open(cls, path: Path | str, *, clock: Callable[[], float] = time.time) -> Database:
        """Open (creating if needed, mode 0600) the database at *path*, in WAL mode."""
        spath = str(path)
        if spath != ":memory:":
            _create_file(Path(spath))
        try:
            conn = sqlite3.connect(
                spath, timeout=5.0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise _translate(exc, spath) from exc
        conn.row_factory = sqlite3.Row
        db = cls(conn, spath, clock=clock)
        try:
            with db.guard():
                conn.execute("PRAGMA busy_timeout=5000")
                conn.execute("PRAGMA journal_mode=WAL").fetchone()
                conn.execute("PRAGMA synchronous=NORMAL")
                conn.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            conn.close()
            raise
        return db

    def close(self) -> None:
        """Close the connection; later calls raise :class:`StoreError`."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.close()

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreError(
                f"state database {self.path} is closed; this is a bug in the caller, "
                "report it with the traceback"
            )
        return self._conn

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Translate the sqlite3 errors raised inside (misuse of the API excepted)."""
        try:
            yield
        except sqlite3.Error as exc:
            if isinstance(exc, sqlite3.ProgrammingError | sqlite3.InterfaceError):
                raise
            raise _translate(exc, self.path) from exc

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        """A transaction: all changes inside commit together or not at all; nested ones
        use savepoints."""
        db = self.conn
        with self.guard():
            if self._depth == 0:
                db.execute("BEGIN IMMEDIATE")
                savepoint = None
            else:
                savepoint = f"sp{self._depth}"
                db.execute(f"SAVEPOINT {savepoint}")
        self._depth += 1
        try:
            with self.guard():
                yield
        except BaseException:
            self._depth -= 1
            with contextlib.suppress(sqlite3.Error):
                if savepoint is None:
                    db.execute("ROLLBACK")
                else:
                    db.execute(f"ROLLBACK TO {savepoint}")
                    db.execute(f"RELEASE {savepoint}")
            raise
        self._depth -= 1
        with self.guard():
            if savepoint is None:
                try:
                    db.execute("COMMIT")
                except sqlite3.Error:
                    with contextlib.suppress(sqlite3.Error):
                        db.execute("ROLLBACK")
                    raise
            else:
                db.execute(f"RELEASE {savepoint}")

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        """Run one statement; inside :meth:`write` when it changes anything."""
        with self.guard():
            return self.conn.execute(sql, params)

    def executemany(self, sql: str, params: list[tuple[Any, ...]]) -> sqlite3.Cursor:
        with self.guard():
            return self.conn.executemany(sql, params)

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> sqlite3.Row | None:
        with self.guard():
            row: sqlite3.Row | None = self.conn.execute(sql, params).fetchone()
            return row

    def all(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self.guard():
            return list(self.conn.execute(sql, params).fetchall())

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

    def pragma(self, name: str) -> Any:
        """The value of ``PRAGMA name``."""
        row = self.one(f"PRAGMA {name}")
        return None if row is None else row[0]


# --------------------------------------------------------------------------- errors

_TABLE_NOUNS = {
    "meta": "meta entry",
    "nodes": "node",
    "models": "model",
    "replicas": "replica",
    "shards": "shard",
    "api_keys": "API key",
    "events": "event",
    "join_tokens": "join token",
    "certificates": "certificate",
}

_CONSTRAINT_RE = re.compile(r"(UNIQUE|NOT NULL) constraint failed: (\w+)\.(\w+)")


def _integrity_message(exc: sqlite3.IntegrityError) -> str:
    text = str(exc)
    m = _CONSTRAINT_RE.search(text)
    if m:
        kind, table, column = m.groups()
        noun = _TABLE_NOUNS.get(table, table)
        if kind == "UNIQUE":
            return f"a {noun} with this {column} already exists; choose another {column}"
        return f"a {noun} needs a {column}; give one"
    if "FOREIGN KEY" in text:
        return (
            "the change refers to a node, model or replica that does not exist, or removes one "
            "that is still in use; check the 'llmgw ctl' listings and retry"
        )
    if "CHECK" in text:
        return f"a value is out of range ({text}); correct it and retry"
    return f"the change contradicts what is stored ({text})"


def _translate(exc: sqlite3.Error, path: str) -> StoreError:
    if isinstance(exc, sqlite3.IntegrityError):
        return Conflict(_integrity_message(exc))
    text = str(exc)
    if "locked" in text or "busy" in text:
        return StoreError(
            f"state database {path} is locked by another process; stop any other llmgw "
            "server using it, or wait and retry"
        )
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return StoreError(
            f"state database {path} is not a readable SQLite database ({text}); "
            "restore a backup or move the file aside to start empty"
        )
    if "readonly" in text or "unable to open" in text or "disk I/O" in text or "full" in text:
        return StoreError(
            f"state database {path} cannot be read or written ({text}); check its permissions, "
            "its directory's and the free disk space"
        )
    return StoreError(
        f"state database {path}: {text}; check the file and its directory, or restore a backup"
    )


def _create_file(path: Path) -> None:
    parent = path.parent
    if not parent.is_dir():
        raise StoreError(
            f"directory {parent} for the state database does not exist; create it "
            "(mode 0700, owned by the llmgw user) or choose another path"
        )
    try:
        create_file(path, b"", mode=0o600)
    except FileError as exc:
        cause = exc.__cause__
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(exc)
        raise StoreError(
            f"cannot create state database {path}: {reason}; check the permissions of {parent}"
        ) from exc
