"""The state database in PostgreSQL (several control-plane instances on one database): a
psycopg 3 connection pool, transactions serialised by one advisory lock, the schema's version
in a table of its own, and every psycopg error as a :class:`~llmgw.errors.StoreError` that
says what to do, naming the servers and never the password.

Writes take ``pg_advisory_xact_lock`` first: one writer at a time across every instance, as
SQLite's ``BEGIN IMMEDIATE`` is for one file, so that the tables' read-then-write steps (a
counter that only grows, an id nobody holds, a token spent once) mean the same here, and so
that migrations run once when two instances start together. The control plane's writes are
few and small; the gateway's request path never writes.

When the database stops answering (a restart, a fail-over), calls fail at once with
:class:`~llmgw.errors.StoreUnavailable` instead of each waiting out a timeout on the event
loop, and a background thread probes until it answers again (:attr:`unreachable_since`), then
puts a new pool in place of the broken one, whose own reconnection has backed off meanwhile.
libpq's multiple hosts with ``target_session_attrs=read-write`` find the new primary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import psycopg
import psycopg.errors as pgerr
from psycopg import sql as pgsql
from psycopg.adapt import Dumper
from psycopg_pool import ConnectionPool, PoolTimeout

from llmgw.errors import ConfigError, Conflict, StoreError, StoreUnavailable
from llmgw.log import kv
from llmgw.server.store.database import TABLE_NOUNS, Database
from llmgw.server.store.dialect import for_engine, psycopg_params
from llmgw.server.store.location import Location

__all__ = ["PostgresDatabase", "connect_once", "ensure_notifications", "listen_async"]

log = logging.getLogger("llmgw.server.store")

WRITE_LOCK = 0x6C6C6D67  # 'llmg': the advisory lock every write transaction takes
SCHEMA_TABLE = "llmgw_schema"
CONNECT_TIMEOUT = 3  # seconds, per host tried
POOL_TIMEOUT = 1.0  # seconds the event loop may wait for a connection when one broke
PROBE_INTERVAL = 1.0

_DEFAULTS = {
    "connect_timeout": str(CONNECT_TIMEOUT),
    "application_name": "llmgw-server",
    # A partitioned or vanished server is noticed in seconds, not after the kernel's hours.
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "5000",
}


class _Row(tuple):
    """A row by position and by column name, as sqlite3.Row."""

    _index: dict[str, int]

    def __new__(cls, values: Sequence[Any], index: dict[str, int]) -> _Row:
        row = super().__new__(cls, values)
        row._index = index
        return row

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            try:
                return tuple.__getitem__(self, self._index[key])
            except KeyError:
                raise IndexError(f"no column {key!r}") from None
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


def _row_factory(cursor: Any) -> Callable[[Sequence[Any]], _Row]:
    names = [c.name for c in cursor.description] if cursor.description else []
    index = {name: i for i, name in enumerate(names)}
    return lambda values: _Row(values, index)


class _BoolAsInt(Dumper):
    """Booleans as 0/1: the schema's flags are integers, as SQLite's."""

    oid = psycopg.adapters.types["int8"].oid

    def dump(self, obj: Any) -> bytes:
        return b"1" if obj else b"0"


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.adapters.register_dumper(bool, _BoolAsInt)


class _Result:
    """A statement's outcome, read in full before the connection goes back to the pool."""

    def __init__(self, rowcount: int, rows: list[Any]) -> None:
        self.rowcount = rowcount
        self._rows = rows

    def fetchone(self) -> Any:
        return self._rows[0] if self._rows else None

    def fetchall(self) -> list[Any]:
        return self._rows


def _conninfo(location: Location, **extra: str) -> str:
    params = {**_DEFAULTS, **location.conninfo, **extra}
    password = location.read_password()
    if password is not None:
        params["password"] = password
    return psycopg.conninfo.make_conninfo(**params)


def _open_pool(location: Location) -> ConnectionPool:
    """The store's pool, open with its first connection (PoolTimeout when none comes)."""
    pool = ConnectionPool(
        _conninfo(location),
        min_size=1,
        max_size=4,
        open=False,
        timeout=POOL_TIMEOUT,
        configure=_configure,
        check=ConnectionPool.check_connection,
        kwargs={"autocommit": True, "row_factory": _row_factory},
        name="llmgw-store",
    )
    try:
        pool.open(wait=True, timeout=POOL_TIMEOUT * 2)
    except PoolTimeout:
        pool.close()
        raise
    return pool


def connect_once(location: Location, **extra: str) -> psycopg.Connection[Any]:
    """One connection outside the pool (start-up checks, the migrate command, LISTEN), its
    failure as the error that says which of the usual causes it is."""
    try:
        conn = psycopg.connect(_conninfo(location, **extra), autocommit=True)
    except psycopg.Error as exc:
        raise _connect_error(exc, location) from exc
    _configure(conn)
    conn.row_factory = _row_factory
    return conn


class PostgresDatabase(Database):
    """A pool of connections to one PostgreSQL database (its URL may name several hosts)."""

    engine = "postgresql"

    def __init__(
        self, pool: ConnectionPool, location: Location, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(location, clock=clock)
        self._pool: ConnectionPool | None = pool
        self._tx: psycopg.Connection[Any] | None = None
        self.unreachable_since: float | None = None
        # time.monotonic() when the database answered again after an outage (None: never
        # away): the leadership gives the incumbent a moment to renew first.
        self.recovered_at: float | None = None
        self.last_error = ""
        self._probe: threading.Thread | None = None
        self._swap = threading.Lock()  # the probe's new pool against close()

    @classmethod
    def open(
        cls, location: Location, *, clock: Callable[[], float] = time.time
    ) -> PostgresDatabase:
        """Connect (one connection first, so that a refusal says why), then open the pool."""
        unverified = location.unverified_network_hosts
        if unverified:  # parse_location let it through: sslmode was stated in the URL
            log.warning(
                "the database is reached over the network without verifying its server's "
                "certificate and name, as the URL's sslmode says; use sslmode=verify-full "
                "with sslrootcert unless the network between is trusted",
                extra=kv(
                    database=location.display,
                    hosts=",".join(unverified),
                    sslmode=location.conninfo.get("sslmode", ""),
                ),
            )
        first = connect_once(location)
        first.close()
        try:
            pool = _open_pool(location)
        except PoolTimeout as exc:
            raise StoreUnavailable(
                f"database {location.display} accepted one connection but the pool could not "
                "open; check the server's max_connections and retry"
            ) from exc
        return cls(pool, location, clock=clock)

    def close(self) -> None:
        with self._swap:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=2.0)

    @property
    def pool(self) -> ConnectionPool:
        if self._pool is None:
            raise StoreError(
                f"state database {self.path} is closed; this is a bug in the caller, "
                "report it with the traceback"
            )
        return self._pool

    # ------------------------------------------------------------- availability

    def _unavailable(self) -> StoreUnavailable:
        since = time.strftime("%H:%M:%S", time.localtime(self.unreachable_since or time.time()))
        return StoreUnavailable(
            f"database {self.path} unreachable since {since} ({self.last_error}); llmgw retries "
            "on its own: check that PostgreSQL runs and that this machine reaches "
            f"{', '.join(self.location.hosts())}"
        )

    def _lost(self, exc: BaseException) -> StoreUnavailable:
        if self.unreachable_since is None:
            self.unreachable_since = time.time()
            log.warning(
                "the database does not answer; scheduling and admin writes pause until it does",
                extra=kv(database=self.path, error=_first_line(exc)),
            )
        self.last_error = _first_line(exc)
        self._start_probe()
        return self._unavailable()

    def _start_probe(self) -> None:
        if self._probe is not None and self._probe.is_alive():
            return
        self._probe = threading.Thread(target=self._run_probe, name="llmgw-db-probe", daemon=True)
        self._probe.start()

    def _run_probe(self) -> None:
        while self._pool is not None and self.unreachable_since is not None:
            time.sleep(PROBE_INTERVAL)
            try:
                with contextlib.closing(psycopg.connect(_conninfo(self.location))):
                    pass
            except psycopg.Error as exc:
                self.last_error = _first_line(exc)
                continue
            except ConfigError:
                continue
            if not self._renew_pool():
                continue
            down = time.time() - (self.unreachable_since or time.time())
            self.recovered_at = time.monotonic()
            self.unreachable_since = None
            log.warning(
                "the database answers again", extra=kv(database=self.path, down_s=round(down, 1))
            )

    def _renew_pool(self) -> bool:
        """Put a new pool, opened, in place of the one the outage broke: after an outage of
        seconds the old pool's own reconnection backs off for as long again, and every call
        meanwhile would find it empty and report the database away once more. False when the
        new pool cannot open yet (the probe tries again) or the database was closed."""
        try:
            fresh = _open_pool(self.location)
        except (PoolTimeout, ConfigError) as exc:
            self.last_error = _first_line(exc)
            return False
        with self._swap:
            old, self._pool = self._pool, (fresh if self._pool is not None else None)
        if old is None:
            fresh.close(timeout=2.0)
            return False
        # Connections still out are closed as they come back.
        old.close(timeout=2.0)
        return True

    @contextlib.contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        if self._tx is not None:
            yield self._tx
            return
        pool = self.pool  # a closed store says so, outage or not
        if self.unreachable_since is not None:
            raise self._unavailable()
        try:
            with pool.connection() as conn:
                yield conn
        except PoolTimeout as exc:
            raise self._lost(exc) from exc
        except psycopg.OperationalError as exc:
            raise self._lost(exc) from exc

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Translate the psycopg errors raised inside."""
        try:
            yield
        except (psycopg.OperationalError, PoolTimeout) as exc:
            if isinstance(exc, psycopg.OperationalError) and _is_query_error(exc):
                raise _translate(exc, self.path) from exc
            raise self._lost(exc) from exc
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.ProgrammingError) and not isinstance(
                exc, pgerr.UndefinedTable | pgerr.UndefinedColumn | pgerr.InsufficientPrivilege
            ):
                raise
            raise _translate(exc, self.path) from exc

    # --------------------------------------------------------------- statements

    def execute(self, sql: str, params: Sequence[Any] = ()) -> _Result:
        query = psycopg_params(sql)
        with self.guard(), self._connection() as conn:
            cur = conn.execute(query, tuple(params))
            rows = cur.fetchall() if cur.description is not None else []
            return _Result(cur.rowcount, rows)

    def executemany(self, sql: str, params: list[tuple[Any, ...]]) -> _Result:
        query = psycopg_params(sql)
        with self.guard(), self._connection() as conn, conn.cursor() as cur:
            cur.executemany(query, params)
            return _Result(cur.rowcount, [])

    def insert_id(self, sql: str, params: Sequence[Any] = ()) -> int:
        row = self.execute(sql.rstrip().rstrip(";") + " RETURNING id", params).fetchone()
        if row is None:
            raise StoreError(f"no row was inserted by {sql[:60]!r}; this is a bug, report it")
        return int(row[0])

    @contextlib.contextmanager
    def write(self) -> Iterator[None]:
        if self._tx is not None:  # nested: a savepoint
            with self.guard(), self._tx.transaction():
                yield
            return
        with self.guard(), self._connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
            self._tx = conn
            try:
                if self.fence is not None:
                    self.fence(self)
                yield
            finally:
                self._tx = None

    def server_time(self) -> float:
        row = self.one("SELECT extract(epoch FROM clock_timestamp())::float8")
        assert row is not None
        return float(row[0])

    # -------------------------------------------------------------------- schema

    def schema_version(self) -> int:
        # A scan of the catalog, not to_regclass(): that reads the relation cache, which may
        # not yet know of a table another instance's migration has just committed.
        row = self.one(
            "SELECT 1 FROM pg_catalog.pg_tables WHERE schemaname = current_schema() "
            "AND tablename = ?",
            (SCHEMA_TABLE,),
        )
        if row is None:
            return 0
        row = self.one(f"SELECT max(version) FROM {SCHEMA_TABLE}")
        return 0 if row is None or row[0] is None else int(row[0])

    def set_schema_version(self, version: int) -> None:
        self.execute(
            f"CREATE TABLE IF NOT EXISTS {SCHEMA_TABLE} (version BIGINT NOT NULL, "
            "applied_at DOUBLE PRECISION NOT NULL)"
        )
        self.execute(f"DELETE FROM {SCHEMA_TABLE}")
        self.execute(f"INSERT INTO {SCHEMA_TABLE} VALUES (?, ?)", (int(version), time.time()))

    def run_script(self, statements: list[str]) -> None:
        for statement in for_engine(statements, "postgresql"):
            with self.guard(), self._connection() as conn:
                conn.execute(pgsql.SQL(statement))

    def table_names(self) -> list[str]:
        rows = self.all(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() "
            "AND tablename <> ? ORDER BY tablename",
            (SCHEMA_TABLE,),
        )
        return [str(r[0]) for r in rows]


# ------------------------------------------------------------------------------ errors


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _is_query_error(exc: psycopg.OperationalError) -> bool:
    """An OperationalError about the statement (a lock timeout, a cancelled query), not the
    connection."""
    return isinstance(exc, pgerr.QueryCanceled | pgerr.LockNotAvailable | pgerr.DeadlockDetected)


def _translate(exc: psycopg.Error, where: str) -> StoreError:
    diag = exc.diag
    table = diag.table_name or ""
    noun = TABLE_NOUNS.get(table, table or "row")
    if isinstance(exc, pgerr.UniqueViolation):
        detail = diag.message_detail or ""
        column = ""
        if detail.startswith("Key (") and ")=" in detail:
            column = detail[5 : detail.index(")=")]
        column = column or (diag.constraint_name or "key")
        return Conflict(f"a {noun} with this {column} already exists; choose another {column}")
    if isinstance(exc, pgerr.NotNullViolation):
        column = diag.column_name or "value"
        return Conflict(f"a {noun} needs a {column}; give one")
    if isinstance(exc, pgerr.ForeignKeyViolation):
        return Conflict(
            "the change refers to a node, model or replica that does not exist, or removes one "
            "that is still in use; check the 'llmgw ctl' listings and retry"
        )
    if isinstance(exc, pgerr.CheckViolation):
        return Conflict(f"a value is out of range ({_first_line(exc)}); correct it and retry")
    if isinstance(exc, pgerr.IntegrityError):
        return Conflict(f"the change contradicts what is stored ({_first_line(exc)})")
    if isinstance(exc, pgerr.InsufficientPrivilege):
        return StoreError(
            f"database {where}: {_first_line(exc)}; grant the control plane's role the "
            "privileges on its database (it owns its tables)"
        )
    if isinstance(exc, pgerr.ReadOnlySqlTransaction):
        return StoreUnavailable(
            f"database {where} is a read-only standby; add target_session_attrs=read-write to "
            "the URL so that libpq finds the primary"
        )
    return StoreError(f"database {where}: {_first_line(exc)}; check the database and retry")


# What libpq says when the server's certificate or the settings to check it are wrong.
_TLS_SIGNS = (
    "certificate verify failed",
    "does not match host name",
    "root certificate file",
    "server does not support SSL",
    "sslrootcert",
)


def _connect_error(exc: psycopg.Error, location: Location) -> StoreError | ConfigError:
    text = str(exc)
    hosts = ", ".join(location.hosts())
    user = location.conninfo.get("user", "the current user")
    dbname = location.conninfo.get("dbname", "")
    first = _first_line(exc)
    if "password authentication failed" in text or "no password supplied" in text:
        return ConfigError(
            f"database {location.display} refused the credentials of role {user} ({first}); "
            "check the password in password_file (or ~/.pgpass) and the role's name",
            key="database",
        )
    if isinstance(exc, pgerr.InvalidCatalogName) or (
        "database" in text and "does not exist" in text
    ):
        return ConfigError(
            f"database {dbname!r} does not exist on {hosts}; create it: "
            f"createdb -O {user} {dbname}",
            key="database",
        )
    if "role" in text and "does not exist" in text:
        return ConfigError(
            f"role {user!r} does not exist on {hosts}; create it: createuser --pwprompt {user}",
            key="database",
        )
    if any(sign in text for sign in _TLS_SIGNS):
        return ConfigError(
            f"database {location.display} at {hosts} failed the TLS check the URL asks for "
            f"(sslmode={location.conninfo.get('sslmode', 'prefer')}): {first}; sslrootcert "
            "must name the CA that signed the server's certificate (readable by the control "
            "plane's user), and that certificate must name the host the URL gives",
            key="database",
        )
    if "no pg_hba.conf entry" in text:
        return ConfigError(
            f"{hosts} does not let role {user} connect from this machine ({first}); add a line "
            "for it to the server's pg_hba.conf",
            key="database",
        )
    if "read-write" in text or "session is read-only" in text:
        return StoreUnavailable(
            f"no server of {hosts} accepts writes now ({first}); llmgw needs the primary: "
            "wait for the fail-over to finish, or list the primary in the URL"
        )
    return StoreUnavailable(
        f"cannot reach database {location.display} at {hosts} ({first}); check that "
        "PostgreSQL runs there and that this machine reaches it (firewall, listen_addresses)"
    )


# ------------------------------------------------------------------------ notifications

_NOTIFY_FUNCTION = """
CREATE OR REPLACE FUNCTION llmgw_notify() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify('llmgw_changes', TG_TABLE_NAME);
    RETURN NULL;
END
$fn$
"""

# What a standby routes by: a change to any of these is announced (once per statement; an
# agent's heartbeat, which updates only last_seen, is not).
_NOTIFY_ON = {
    "replicas": "INSERT OR DELETE OR UPDATE OF state, model",
    "shards": "INSERT OR DELETE OR UPDATE OF state, port, node_id",
    "nodes": "INSERT OR DELETE OR UPDATE OF state, dataplane_addr, lost, draining",
    "models": "INSERT OR DELETE OR UPDATE",
    "api_keys": "INSERT OR DELETE OR UPDATE",
    "certificates": "INSERT OR DELETE OR UPDATE OF revoked_at",
}


def ensure_notifications(db: PostgresDatabase) -> None:
    """The triggers that announce changes on ``llmgw_changes`` (made again at every open:
    they are not data, and a later llmgw may announce more)."""
    with db.unfenced(), db.write(), db.guard():
        conn = db._tx
        assert conn is not None
        conn.execute(pgsql.SQL(_NOTIFY_FUNCTION))
        for table, events in _NOTIFY_ON.items():
            name = f"llmgw_notify_{table}"
            conn.execute(pgsql.SQL(f"DROP TRIGGER IF EXISTS {name} ON {table}"))
            conn.execute(
                pgsql.SQL(
                    f"CREATE TRIGGER {name} AFTER {events} ON {table} "
                    "FOR EACH STATEMENT EXECUTE FUNCTION llmgw_notify()"
                )
            )


async def listen_async(
    db: Database, channel: str, *, listening: asyncio.Event | None = None
) -> AsyncIterator[str]:
    """The payloads of *channel*'s notifications, on a connection of its own (it ends when
    that connection does); *listening* is set once the LISTEN is in place (what is notified
    from then on is heard)."""
    if not isinstance(db, PostgresDatabase):
        raise StoreError("notifications are PostgreSQL's; this database is SQLite")
    conn = await psycopg.AsyncConnection.connect(_conninfo(db.location), autocommit=True)
    try:
        await conn.execute(pgsql.SQL(f"LISTEN {channel}"))
        if listening is not None:
            listening.set()
        async for notify in conn.notifies():
            yield notify.payload
    finally:
        await conn.close()
