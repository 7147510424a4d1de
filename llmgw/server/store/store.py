"""The control plane's state store: one object that opens the database, migrates it,
hands out transactions, and answers for every table.

Each group of tables is a small class of its own (:class:`~.nodes.Nodes`,
:class:`~.models.Models`, :class:`~.credentials.ApiKeys`, :class:`~.usage.Usage`,
:class:`~.logins.LoginTables`, ...) over the one
:class:`~.database.Database`; :class:`Store` composes them and offers their methods under
one name, so that callers hold one object and a transaction spans any of them.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from llmgw.server.store.credentials import ApiKeys, Certificates, JoinTokens
from llmgw.server.store.database import Database
from llmgw.server.store.demand import DemandTable
from llmgw.server.store.engines import EngineTables
from llmgw.server.store.events import Events
from llmgw.server.store.gpus import GpuCordons
from llmgw.server.store.instances import Leases
from llmgw.server.store.location import Location, parse_location
from llmgw.server.store.logins import LoginTables
from llmgw.server.store.models import Models
from llmgw.server.store.nodes import Nodes
from llmgw.server.store.operators import Operators
from llmgw.server.store.scaling import ScalingState
from llmgw.server.store.schema import migrate as migrate_schema
from llmgw.server.store.schema import schema_version as read_schema_version
from llmgw.server.store.updates import NodeUpdates
from llmgw.server.store.usage import Usage

__all__ = ["Store"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Table(Generic[_P, _R]):
    """A :class:`Store` method that is one of its tables': ``Store.put_model`` is
    ``_Table("_models", Models.put_model)``, so ``store.put_model(...)`` calls
    ``store._models.put_model(...)``, typed and documented as that method."""

    def __init__(self, table: str, method: Callable[Concatenate[Any, _P], _R]) -> None:
        self.table = table
        self.method = method
        self.__doc__ = method.__doc__

    @overload
    def __get__(self, store: None, owner: type[Any]) -> _Table[_P, _R]: ...

    @overload
    def __get__(self, store: object, owner: type[Any]) -> Callable[_P, _R]: ...

    def __get__(self, store: object | None, owner: type[Any]) -> _Table[_P, _R] | Callable[_P, _R]:
        if store is None:
            return self
        bound: Callable[_P, _R] = getattr(getattr(store, self.table), self.method.__name__)
        return bound


class Store:
    """The state database. Open with :meth:`Store.open`; use from one thread.

    Single methods commit on their own; wrap multi-step changes in :meth:`transaction`.
    Never ``await`` inside a transaction: other coroutines would write into it.
    """

    def __init__(self, db: Database) -> None:
        self._db = db
        self.path = db.path
        self._certificates = Certificates(db)
        self._nodes = Nodes(db, self._certificates)
        self._models = Models(db, self._nodes)
        self._api_keys = ApiKeys(db)
        self._join_tokens = JoinTokens(db)
        self._updates = NodeUpdates(db)
        self._events = Events(db)
        self._gpu_cordons = GpuCordons(db)
        self._leases = Leases(db)
        self._engines = EngineTables(db)
        self._usage = Usage(db)
        self._demand = DemandTable(db)
        self._scaling = ScalingState(db)
        self._operators = Operators(db)
        self._logins = LoginTables(db)

    # ---------------------------------------------------------------- lifecycle

    @classmethod
    def open(cls, where: Location | Path | str, *, clock: Callable[[], float] = time.time) -> Store:
        """Open and migrate the database *where* names: a :class:`Location`, a
        ``sqlite:///``/``postgresql://`` URL, or a SQLite file's path (created, mode 0600,
        when missing)."""
        db = open_database(_location(where), clock=clock)
        try:
            migrate_schema(db)
            if db.engine == "postgresql":
                from llmgw.server.store.postgres import PostgresDatabase, ensure_notifications

                assert isinstance(db, PostgresDatabase)
                ensure_notifications(db)
        except BaseException:
            db.close()
            raise
        return cls(db)

    def close(self) -> None:
        """Close the database; later calls raise :class:`~llmgw.errors.StoreError`."""
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def schema_version(self) -> int:
        return read_schema_version(self._db)

    @property
    def engine(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self._db.engine

    @property
    def database(self) -> Database:
        """The database under the tables (the leadership's lease, the migrate command)."""
        return self._db

    def journal_mode(self) -> str:
        row = self._db.one("PRAGMA journal_mode") if self._db.engine == "sqlite" else None
        return "" if row is None else str(row[0])

    def migrate(self) -> int:
        """Apply the missing migrations, one transaction each; return the schema version."""
        return migrate_schema(self._db)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Store]:
        """All changes inside commit together or not at all (nested ones use savepoints)."""
        with self._db.write():
            yield self

    # --------------------------------------------------------------------- meta

    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self._db.one("SELECT value FROM meta WHERE key = ?", (key,))
        return default if row is None else str(row["value"])

    def claim_meta(self, key: str, value: str) -> str:
        """Set *key* to *value* unless it is set already; the value it has now (another
        instance's, when two claimed it at once)."""
        with self._db.unfenced(), self._db.write():
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO NOTHING",
                (key, value),
            )
            row = self._db.one("SELECT value FROM meta WHERE key = ?", (key,))
        assert row is not None
        return str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        with self._db.write():
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, value),
            )

    def cluster_id(self) -> str:
        """This cluster's id: a random UUID made on first use and kept."""
        existing = self.get_meta("cluster_id")
        if existing is not None:
            return existing
        with self._db.write():
            self._db.execute(
                "INSERT INTO meta(key, value) VALUES ('cluster_id', ?) ON CONFLICT(key) DO NOTHING",
                (str(uuid.uuid4()),),
            )
            made = self.get_meta("cluster_id")
        assert made is not None
        return made

    def epoch(self) -> int:
        """The control plane's current epoch (0 before the first :meth:`bump_epoch`)."""
        row = self._db.one("SELECT epoch FROM leader_lease WHERE id = 1")
        return 0 if row is None else int(row["epoch"])

    def bump_epoch(self) -> int:
        """Atomically add one to the epoch and return the new value (a leader that holds
        its state directory's lock: SQLite; on PostgreSQL :mod:`llmgw.server.ha.lease`
        takes the lease, which bumps it)."""
        with self._db.unfenced(), self._db.write():
            self._db.execute("UPDATE leader_lease SET epoch = epoch + 1 WHERE id = 1")
            value = self.epoch()
        return value

    # -------------------------------------------------------------------- nodes

    upsert_node = _Table("_nodes", Nodes.upsert_node)
    set_node_connected = _Table("_nodes", Nodes.set_node_connected)
    touch_nodes = _Table("_nodes", Nodes.touch_nodes)
    set_node_state = _Table("_nodes", Nodes.set_node_state)
    set_node_draining = _Table("_nodes", Nodes.set_node_draining)
    set_node_fingerprint = _Table("_nodes", Nodes.set_node_fingerprint)
    set_node_lost = _Table("_nodes", Nodes.set_node_lost)
    count_connected_nodes = _Table("_nodes", Nodes.count_connected_nodes)
    set_all_disconnected = _Table("_nodes", Nodes.set_all_disconnected)
    get_node = _Table("_nodes", Nodes.get_node)
    list_nodes = _Table("_nodes", Nodes.list_nodes)
    count_nodes = _Table("_nodes", Nodes.count_nodes)
    list_draining_nodes = _Table("_nodes", Nodes.list_draining_nodes)
    delete_node = _Table("_nodes", Nodes.delete_node)
    enrol_node = _Table("_nodes", Nodes.enrol_node)

    # ------------------------------------------------- models, replicas, shards

    put_model = _Table("_models", Models.put_model)
    put_catalog_model = _Table("_models", Models.put_catalog_model)
    deploy_model = _Table("_models", Models.deploy_model)
    set_scaling = _Table("_models", Models.set_scaling)
    set_replicas = _Table("_models", Models.set_replicas)
    get_model = _Table("_models", Models.get_model)
    list_models = _Table("_models", Models.list_models)
    delete_model = _Table("_models", Models.delete_model)
    add_replica = _Table("_models", Models.add_replica)
    get_replica = _Table("_models", Models.get_replica)
    list_replicas = _Table("_models", Models.list_replicas)
    count_replicas = _Table("_models", Models.count_replicas)
    count_replicas_by_state = _Table("_models", Models.count_replicas_by_state)
    models_with_stale_replicas = _Table("_models", Models.models_with_stale_replicas)
    set_replica_state = _Table("_models", Models.set_replica_state)
    delete_replica = _Table("_models", Models.delete_replica)
    add_shard = _Table("_models", Models.add_shard)
    get_shard = _Table("_models", Models.get_shard)
    list_shards = _Table("_models", Models.list_shards)
    update_shard = _Table("_models", Models.update_shard)
    delete_shard = _Table("_models", Models.delete_shard)

    # -------------------------------------------------------------- credentials

    create_api_key = _Table("_api_keys", ApiKeys.create_api_key)
    get_api_key = _Table("_api_keys", ApiKeys.get_api_key)
    list_api_keys = _Table("_api_keys", ApiKeys.list_api_keys)
    update_api_key = _Table("_api_keys", ApiKeys.update_api_key)
    active_api_keys = _Table("_api_keys", ApiKeys.active_api_keys)
    revoke_api_key = _Table("_api_keys", ApiKeys.revoke_api_key)
    verify_api_key = _Table("_api_keys", ApiKeys.verify_api_key)
    active_key_hashes = _Table("_api_keys", ApiKeys.active_key_hashes)

    create_join_token = _Table("_join_tokens", JoinTokens.create_join_token)
    list_join_tokens = _Table("_join_tokens", JoinTokens.list_join_tokens)
    get_join_token = _Table("_join_tokens", JoinTokens.get_join_token)
    revoke_join_token = _Table("_join_tokens", JoinTokens.revoke_join_token)
    consume_join_token = _Table("_join_tokens", JoinTokens.consume_join_token)
    record_auto_approval = _Table("_join_tokens", JoinTokens.record_auto_approval)

    add_certificate = _Table("_certificates", Certificates.add_certificate)
    latest_certificate = _Table("_certificates", Certificates.latest_certificate)
    latest_certificates = _Table("_certificates", Certificates.latest_certificates)
    list_certificates = _Table("_certificates", Certificates.list_certificates)
    revoke_certificates = _Table("_certificates", Certificates.revoke_certificates)
    is_revoked = _Table("_certificates", Certificates.is_revoked)
    revoked_serials = _Table("_certificates", Certificates.revoked_serials)

    # ------------------------------------------------------------------ updates

    next_update_counter = _Table("_updates", NodeUpdates.next_update_counter)
    put_update = _Table("_updates", NodeUpdates.put_update)
    get_update = _Table("_updates", NodeUpdates.get_update)
    list_updates = _Table("_updates", NodeUpdates.list_updates)
    set_update_state = _Table("_updates", NodeUpdates.set_update_state)

    # ------------------------------------------------------------------ engines

    set_desired_engine = _Table("_engines", EngineTables.set_desired_engine)
    list_desired_engines = _Table("_engines", EngineTables.list_desired_engines)
    forget_desired_engine = _Table("_engines", EngineTables.forget_desired_engine)
    put_node_engine = _Table("_engines", EngineTables.put_node_engine)
    finish_node_engine = _Table("_engines", EngineTables.finish_node_engine)
    get_node_engine = _Table("_engines", EngineTables.get_node_engine)
    list_node_engines = _Table("_engines", EngineTables.list_node_engines)
    node_engines_by_op = _Table("_engines", EngineTables.node_engines_by_op)

    # ------------------------------------------------------- lease, instances

    lease = _Table("_leases", Leases.lease)
    take_lease = _Table("_leases", Leases.take_lease)
    renew_lease = _Table("_leases", Leases.renew_lease)
    release_lease = _Table("_leases", Leases.release_lease)
    check_epoch = _Table("_leases", Leases.check_epoch)
    register_instance = _Table("_leases", Leases.register_instance)
    set_instance_addresses = _Table("_leases", Leases.set_instance_addresses)
    touch_instance = _Table("_leases", Leases.touch_instance)
    retire_instance = _Table("_leases", Leases.retire_instance)
    retired_serials = _Table("_leases", Leases.retired_serials)
    get_instance = _Table("_leases", Leases.get_instance)
    list_instances = _Table("_leases", Leases.list_instances)
    instance_names = _Table("_leases", Leases.instance_names)

    # -------------------------------------------------------------------- usage

    add_usage = _Table("_usage", Usage.add_usage)
    put_demand = _Table("_demand", DemandTable.put_demand)
    list_demand = _Table("_demand", DemandTable.list_demand)
    scale_down_windows = _Table("_scaling", ScalingState.scale_down_windows)
    set_scale_down_window = _Table("_scaling", ScalingState.set_scale_down_window)
    learnt_host_memory = _Table("_scaling", ScalingState.learnt_host_memory)
    set_learnt_host_memory = _Table("_scaling", ScalingState.set_learnt_host_memory)
    list_usage = _Table("_usage", Usage.list_usage)
    tokens_since = _Table("_usage", Usage.tokens_since)

    # ---------------------------------------------------------------- operators

    add_operator = _Table("_operators", Operators.add_operator)
    get_operator = _Table("_operators", Operators.get_operator)
    find_operator = _Table("_operators", Operators.find_operator)
    list_operators = _Table("_operators", Operators.list_operators)
    count_operators = _Table("_operators", Operators.count_operators)
    set_operator_password = _Table("_operators", Operators.set_operator_password)
    set_operator_role = _Table("_operators", Operators.set_operator_role)
    remove_operator = _Table("_operators", Operators.remove_operator)

    # ------------------------------------------------------------------- logins

    add_login_session = _Table("_logins", LoginTables.add_login_session)
    find_login_session = _Table("_logins", LoginTables.find_login_session)
    list_login_sessions = _Table("_logins", LoginTables.list_login_sessions)
    touch_login_session = _Table("_logins", LoginTables.touch_login_session)
    delete_login_session = _Table("_logins", LoginTables.delete_login_session)
    delete_login_sessions_of = _Table("_logins", LoginTables.delete_login_sessions_of)
    prune_login_sessions = _Table("_logins", LoginTables.prune_login_sessions)
    login_locked_until = _Table("_logins", LoginTables.login_locked_until)
    login_counter = _Table("_logins", LoginTables.login_counter)
    count_login_attempt = _Table("_logins", LoginTables.count_login_attempt)
    refund_login_attempt = _Table("_logins", LoginTables.refund_login_attempt)
    login_failures = _Table("_logins", LoginTables.login_failures)
    prune_login_failures = _Table("_logins", LoginTables.prune_login_failures)

    # ------------------------------------------------------------------- events

    add_event = _Table("_events", Events.add_event)
    list_events = _Table("_events", Events.list_events)
    events_after = _Table("_events", Events.events_after)
    cordon_gpus = _Table("_gpu_cordons", GpuCordons.cordon_gpus)
    uncordon_gpus = _Table("_gpu_cordons", GpuCordons.uncordon_gpus)
    list_gpu_cordons = _Table("_gpu_cordons", GpuCordons.list_gpu_cordons)


def _location(where: Location | Path | str) -> Location:
    if isinstance(where, Location):
        return where
    text = str(where)
    if "://" in text:
        return parse_location(text)
    return Location("sqlite", text, path=text)


def open_database(location: Location, *, clock: Callable[[], float] = time.time) -> Database:
    """Open the database at *location* (a SQLite file is created, mode 0600, when missing);
    psycopg is loaded only for PostgreSQL."""
    if location.engine == "postgresql":
        from llmgw.server.store.postgres import PostgresDatabase

        return PostgresDatabase.open(location, clock=clock)
    from llmgw.server.store.sqlite import SQLiteDatabase

    return SQLiteDatabase.open(location, clock=clock)
