"""Copying a whole state database from one engine to another: a single control plane's SQLite
file into an empty PostgreSQL database (``llmgw server migrate``), every table the schema has,
in one PostgreSQL transaction that commits only once the copy is checked.

What it refuses, each before a row is written to the target:

- a source that is not a SQLite file, or is missing (it is never created);
- a source in use: a control plane holds its state directory's ``leader.lock``. The lock is
  held for the copy (a control plane started meanwhile waits as a standby) and no longer;
- a source of a newer schema than this llmgw's. One of an older schema is migrated in place
  first, as the control plane of this release does on its next start anyway: the copy is then
  of one schema into the same schema, column by column, and the file left behind as the
  backup is one this release runs on;
- a target that holds anything but what the migrations themselves put in an empty database
  (the leader's lease row at epoch 0): it names the tables with rows and how to start empty.

The tables are iterated, never listed here, so that one a later migration adds is copied too;
a table or column on one side only fails loudly. Parents are copied before children (the
target's foreign keys give the order), identity sequences are moved past the ids copied (and
past any id SQLite handed out and deleted since, as its AUTOINCREMENT would), and every table's
row count is compared on both sides before the commit.
"""

from __future__ import annotations

import contextlib
import graphlib
import os
import re
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.contracts.paths import DEFAULT_SERVER_STATE_DIR
from llmgw.errors import ConfigError, Conflict, StoreError
from llmgw.server.store.database import Database, Row
from llmgw.server.store.location import Location
from llmgw.server.store.lock import LOCK_FILE, try_lock
from llmgw.server.store.schema import MIGRATIONS, migrate
from llmgw.server.store.sqlite import SQLiteDatabase
from llmgw.server.store.store import Store

__all__ = ["Transfer", "copy_database", "migrate_to_postgresql"]

_NAME = re.compile(r"[a-z_][a-z0-9_]*")


@dataclass(frozen=True)
class Transfer:
    """What :func:`migrate_to_postgresql` did."""

    source: str
    target: str
    schema_version: int
    upgraded_from: int
    """The source's schema version before (``schema_version``: it was not migrated first)."""
    rows: dict[str, int]
    """Rows copied, by table (every table of the schema, in name order)."""


def migrate_to_postgresql(
    source: Location, target: Location, *, state_dir: Path | None = None
) -> Transfer:
    """Copy the SQLite database *source* into the empty PostgreSQL database *target*.

    *state_dir* is the control plane's state directory, whose ``leader.lock`` says whether it
    runs (default: the SQLite file's directory, as in the default layout)."""
    if source.engine != "sqlite" or source.path == ":memory:":
        raise ConfigError(
            f"the source {source.display} is not a SQLite file; migrate copies a control "
            f"plane's sqlite:///PATH (by default sqlite://{DEFAULT_SERVER_STATE_DIR}/llmgw.db) "
            "into PostgreSQL"
        )
    if not target.is_postgresql:
        raise ConfigError(
            f"the target {target.display} is not a PostgreSQL database; give "
            "postgresql://USER@HOST[:PORT]/DBNAME"
        )
    path = Path(source.path)
    if not path.is_file():
        raise ConfigError(
            f"there is no state database at {path}; give the control plane's SQLite file "
            f"(by default {DEFAULT_SERVER_STATE_DIR}/llmgw.db)"
        )
    with _stopped(state_dir or path.absolute().parent):
        before = _version_of(source)
        known = len(MIGRATIONS)
        if before > known:
            raise StoreError(
                f"{path} has schema version {before}, newer than this llmgw's ({known}); run "
                "migrate with the llmgw release that wrote it (a database is never downgraded)"
            )
        with contextlib.ExitStack() as stack:
            # The target first: a refusal there leaves the source as it was.
            into = stack.enter_context(Store.open(target))
            _refuse_unless_empty(into.database, _seeded())
            src = stack.enter_context(Store.open(source))
            rows = copy_database(src.database, into.database)
            version = into.schema_version()
    return Transfer(
        source=source.display,
        target=target.display,
        schema_version=version,
        upgraded_from=before,
        rows=rows,
    )


def copy_database(source: Database, target: Database) -> dict[str, int]:
    """Copy every row of *source* (SQLite) into *target* (PostgreSQL, empty but for what its
    migrations seeded), both at the same schema version, in one transaction of each; the rows
    copied, by table. Nothing is left in *target* when anything fails."""
    if source.engine != "sqlite" or target.engine != "postgresql":
        raise ValueError("copy_database copies a SQLite database into a PostgreSQL one")
    if source.schema_version() != target.schema_version():
        raise StoreError(
            f"{source.path} has schema version {source.schema_version()} and {target.path} "
            f"{target.schema_version()}; open both with this llmgw first (Store.open migrates)"
        )
    # The source under its writers' lock: nothing changes it while it is read.
    with source.write(), target.write():
        tables = _tables(source, target)
        _refuse_unless_empty(target, _seeded())
        for table in reversed(tables):
            target.execute(f"DELETE FROM {_quote(table)}")  # the migrations' seed rows
        for table in tables:
            _copy_table(source, target, table)
        _reset_identities(source, target)
        return _verify(source, target, sorted(tables))


# ------------------------------------------------------------------------------ checks


@contextlib.contextmanager
def _stopped(state_dir: Path) -> Iterator[None]:
    """Hold the state directory's leader lock for the copy, refused while a control plane
    holds it."""
    lock = state_dir / LOCK_FILE
    existed = lock.exists()
    try:
        fd = try_lock(state_dir)
    except OSError as exc:
        raise StoreError(
            f"cannot open {lock} ({exc.strerror}) to see whether a control plane runs there; "
            "run migrate as the control plane's user (sudo -u llmgw llmgw server migrate ...), "
            "or give its state directory with --state-dir"
        ) from exc
    if fd is None:
        raise StoreError(
            f"a control plane is running on {state_dir} (it holds {lock}); stop the control "
            "plane first (systemctl stop llmgw-server), then run migrate again"
        )
    try:
        made = os.fstat(fd)
        if (
            not existed
            and os.geteuid() == 0
            and stat.S_ISREG(made.st_mode)
            and made.st_uid == 0
            and made.st_nlink == 1
        ):
            # Made by root here (this very file: a regular one, root's, no other name): the
            # control plane's user must still open it when it starts.
            st = state_dir.stat()
            os.fchown(fd, st.st_uid, st.st_gid)
        yield
    finally:
        os.close(fd)


def _version_of(location: Location) -> int:
    """The schema version of the SQLite file at *location*, without migrating it."""
    db = SQLiteDatabase.open(location)
    try:
        return db.schema_version()
    finally:
        db.close()


def _seeded() -> dict[str, Counter[tuple[tuple[str, Any], ...]]]:
    """The rows the migrations put in an empty database (migration 8's lease at epoch 0),
    by table: an empty SQLite database in memory, migrated."""
    db = SQLiteDatabase.open(Location("sqlite", ":memory:", path=":memory:"))
    try:
        migrate(db)
        return {
            t: Counter(_key(r) for r in db.all(f"SELECT * FROM {_quote(t)}"))
            for t in db.table_names()
        }
    finally:
        db.close()


def _refuse_unless_empty(
    target: Database, seeded: dict[str, Counter[tuple[tuple[str, Any], ...]]]
) -> None:
    """Conflict naming each table of *target* that holds a row the migrations did not put."""
    full: list[str] = []
    for table in target.table_names():
        seeds = seeded.get(table, Counter())
        count = _count(target, table)
        if count == 0:
            continue
        if count <= seeds.total():
            rows = Counter(_key(r) for r in target.all(f"SELECT * FROM {_quote(table)}"))
            if not rows - seeds:
                continue
        full.append(f"{table} ({count} row{'' if count == 1 else 's'})")
    if full:
        dbname = target.location.conninfo.get("dbname", "DBNAME")
        raise Conflict(
            f"database {target.path} is not empty: {', '.join(full)}; migrate only into an "
            f"empty database: drop and create it again (dropdb {dbname} && createdb -O "
            f"{target.location.conninfo.get('user', 'USER')} {dbname}), or give another "
            "database name; nothing was written"
        )


def _tables(source: Database, target: Database) -> list[str]:
    """Every table, parents before children; a table on one side only is an error."""
    ours, theirs = set(source.table_names()), set(target.table_names())
    if ours != theirs:
        raise StoreError(
            f"{source.path} and {target.path} have the same schema version but not the same "
            f"tables (only in {source.path}: {', '.join(sorted(ours - theirs)) or 'none'}; "
            f"only in {target.path}: {', '.join(sorted(theirs - ours)) or 'none'}); this is a "
            "bug: report it, nothing was written"
        )
    sorter: graphlib.TopologicalSorter[str] = graphlib.TopologicalSorter()
    for table in sorted(ours):
        sorter.add(table)
    for row in target.all(
        "SELECT child.relname, parent.relname FROM pg_constraint c "
        "JOIN pg_class child ON child.oid = c.conrelid "
        "JOIN pg_class parent ON parent.oid = c.confrelid "
        "JOIN pg_namespace n ON n.oid = child.relnamespace "
        "WHERE c.contype = 'f' AND n.nspname = current_schema()"
    ):
        if row[0] != row[1]:
            sorter.add(str(row[0]), str(row[1]))
    order: list[str] = []
    sorter.prepare()
    while sorter.is_active():
        ready = sorted(sorter.get_ready())
        order.extend(ready)
        sorter.done(*ready)
    return order


def _columns(db: Database, table: str) -> list[str]:
    if db.engine == "sqlite":
        return [str(r["name"]) for r in db.all(f"PRAGMA table_info({_quote(table)})")]
    rows = db.all(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name = ? ORDER BY ordinal_position",
        (table,),
    )
    return [str(r[0]) for r in rows]


def _copy_table(source: Database, target: Database, table: str) -> None:
    columns = _columns(source, table)
    if set(columns) != set(_columns(target, table)):
        raise StoreError(
            f"table {table} has columns {', '.join(sorted(columns))} in {source.path} but "
            f"{', '.join(sorted(_columns(target, table)))} in {target.path}; this is a bug: "
            "report it, nothing was written"
        )
    names = ", ".join(_quote(c) for c in columns)
    rows = [
        tuple(r[c] for c in columns) for r in source.all(f"SELECT {names} FROM {_quote(table)}")
    ]
    if not rows:
        return
    marks = ", ".join("?" for _ in columns)
    insert = f"INSERT INTO {_quote(table)} ({names}) VALUES ({marks})"
    try:
        with target.write():  # a savepoint, so that the row refused can be looked for
            target.executemany(insert, rows)
    except StoreError as exc:
        raise _refused(source, target, table, columns, rows, insert, exc) from exc


def _refused(
    source: Database,
    target: Database,
    table: str,
    columns: list[str],
    rows: list[tuple[Any, ...]],
    insert: str,
    error: StoreError,
) -> StoreError:
    """The error naming the first row of *table* the target refuses, each tried alone (the
    transaction is rolled back all the same)."""
    where, why = "", _first_line(error.__cause__ or error)
    key = _primary_key(source, table) or columns
    for row in rows:
        try:
            with target.write():
                target.execute(insert, row)
        except StoreError as exc:
            values = dict(zip(columns, row, strict=True))
            where = " at the row " + ", ".join(f"{c} = {values[c]!r}" for c in key)
            why = _first_line(exc.__cause__ or exc)
            break
    return StoreError(
        f"copying table {table} into {target.path} failed{where} ({why}); nothing was written: "
        f"correct the row in {source.path} (sqlite3 {source.path}) and run migrate again"
    )


def _primary_key(db: Database, table: str) -> list[str]:
    """The primary key's columns of a SQLite *table*, in order."""
    info = db.all(f"PRAGMA table_info({_quote(table)})")
    return [str(r["name"]) for r in sorted(info, key=lambda r: int(r["pk"])) if int(r["pk"])]


def _reset_identities(source: Database, target: Database) -> None:
    """Move each identity sequence past the ids copied, and past any SQLite gave out (its
    AUTOINCREMENT never hands an id out twice, not even one whose row was deleted)."""
    given: dict[str, int] = {}
    if "sqlite_sequence" in {
        str(r[0]) for r in source.all("SELECT name FROM sqlite_master WHERE type = 'table'")
    }:
        given = {str(r[0]): int(r[1]) for r in source.all("SELECT name, seq FROM sqlite_sequence")}
    for row in target.all(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND is_identity = ? ORDER BY table_name",
        ("YES",),
    ):
        table, column = str(row[0]), str(row[1])
        top = target.one(f"SELECT max({_quote(column)}) FROM {_quote(table)}")
        highest = max(
            int(top[0]) if top is not None and top[0] is not None else 0, given.get(table, 0)
        )
        if highest > 0:
            target.execute(
                "SELECT setval(pg_get_serial_sequence(?, ?), ?, true)",
                (_quote(table), column, highest),
            )


def _verify(source: Database, target: Database, tables: list[str]) -> dict[str, int]:
    """Rows by table, the same on both sides, else an error (before the commit)."""
    counts: dict[str, int] = {}
    differ: list[str] = []
    for table in tables:
        ours = _count(source, table)
        theirs = _count(target, table)
        if ours != theirs:
            differ.append(f"{table} ({ours} in the source, {theirs} copied)")
        counts[table] = ours
    if differ:
        raise StoreError(
            f"the copy into {target.path} does not hold what {source.path} holds: "
            f"{', '.join(differ)}; nothing was written, this is a bug: report it"
        )
    return counts


def _count(db: Database, table: str) -> int:
    row = db.one(f"SELECT count(*) FROM {_quote(table)}")
    return 0 if row is None else int(row[0])


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _key(row: Row) -> tuple[tuple[str, Any], ...]:
    return tuple((k, row[k]) for k in sorted(row.keys()))


def _quote(name: str) -> str:
    """*name* as a quoted identifier (the schema's names are plain; a quote is refused)."""
    if not _NAME.fullmatch(name):
        raise StoreError(f"table or column name {name!r} is not one llmgw made; report it")
    return f'"{name}"'
