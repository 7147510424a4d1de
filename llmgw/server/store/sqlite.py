"""The state database in a SQLite file (the embedded default): opening it in WAL mode,
transactions (``BEGIN IMMEDIATE``: one writer at a time), and every sqlite3 error as a
:class:`~llmgw.errors.StoreError` that says what to do.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llmgw.errors import Conflict, FileError, StoreError
from llmgw.fsutil import create_file
from llmgw.server.store.database import TABLE_NOUNS, Database
from llmgw.server.store.dialect import for_engine
from llmgw.server.store.location import Location

__all__ = ["SQLiteDatabase"]


class SQLiteDatabase(Database):
    """One connection to a SQLite file."""

    engine = "sqlite"

    def __init__(
        self,
        conn: sqlite3.Connection,
        location: Location,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(location, clock=clock)
        self._conn: sqlite3.Connection | None = conn
        self._depth = 0

    @classmethod
    def open(cls, location: Location, *, clock: Callable[[], float] = time.time) -> SQLiteDatabase:
        """Open (creating if needed, mode 0600) the database at *location*, in WAL mode."""
        spath = location.path
        if spath != ":memory:":
            _create_file(Path(spath))
        try:
            conn = sqlite3.connect(
                spath, timeout=5.0, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise _translate(exc, spath) from exc
        conn.row_factory = sqlite3.Row
        db = cls(conn, location, clock=clock)
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
                if savepoint is None and self.fence is not None:
                    self.fence(self)
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

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        """Run one statement; inside :meth:`write` when it changes anything."""
        with self.guard():
            return self.conn.execute(sql, tuple(params))

    def executemany(self, sql: str, params: list[tuple[Any, ...]]) -> sqlite3.Cursor:
        with self.guard():
            return self.conn.executemany(sql, params)

    def insert_id(self, sql: str, params: Sequence[Any] = ()) -> int:
        cur = self.execute(sql, params)
        if cur.lastrowid is None:
            raise StoreError(f"no row was inserted by {sql[:60]!r}; this is a bug, report it")
        return int(cur.lastrowid)

    def pragma(self, name: str) -> Any:
        """The value of ``PRAGMA name``."""
        row = self.one(f"PRAGMA {name}")
        return None if row is None else row[0]

    def schema_version(self) -> int:
        return int(self.pragma("user_version"))

    def set_schema_version(self, version: int) -> None:
        self.execute(f"PRAGMA user_version={int(version)}")

    def run_script(self, statements: list[str]) -> None:
        for statement in for_engine(statements, "sqlite"):
            self.execute(statement)

    def table_names(self) -> list[str]:
        rows = self.all(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
            "ORDER BY name"
        )
        return [str(r[0]) for r in rows]


# --------------------------------------------------------------------------- errors

_CONSTRAINT_RE = re.compile(r"(UNIQUE|NOT NULL) constraint failed: (\w+)\.(\w+)")


def _integrity_message(exc: sqlite3.IntegrityError) -> str:
    text = str(exc)
    m = _CONSTRAINT_RE.search(text)
    if m:
        kind, table, column = m.groups()
        noun = TABLE_NOUNS.get(table, table)
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
