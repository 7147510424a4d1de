"""Fixtures of the state store's tests: the store on each engine (a SQLite file in tmp_path,
and a fresh database of the session's throwaway PostgreSQL cluster), its time the clock the
test moves, and the rows most tests start from.

Every test that takes ``store`` or ``db_location`` runs on both engines; one about SQLite's
file alone takes ``sqlite_store`` (tests/unit/server/conftest.py's ``store``, by that name).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmgw.server.store import Node, Replica, Shard, Store
from llmgw.server.store.location import Location, parse_location
from tests.unit.clock import Clock


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_location(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Location:
    """Where a fresh, empty state database is, on the test's engine."""
    if backend == "sqlite":
        return parse_location(f"sqlite://{tmp_path}/state.db")
    cluster = request.getfixturevalue("pg_cluster")
    name = cluster.fresh_database()
    return parse_location(
        cluster.url(name, password=False), password_file=cluster.password_file(tmp_path)
    )


@pytest.fixture
def store(db_location: Location, clock: Clock) -> Iterator[Store]:
    """A store on a fresh database of the test's engine, its time the ``clock`` fixture's."""
    s = Store.open(db_location, clock=clock)
    yield s
    s.close()


def stored_bytes(store: Store, location: Location) -> bytes:
    """Everything the database holds, as bytes to search for a secret: a SQLite file's and
    its WAL's bytes (after the store is closed), or every row of every table PostgreSQL has."""
    if location.engine == "sqlite":
        store.close()  # checkpoints the WAL into the main file
        path = Path(location.path)
        return b"".join(p.read_bytes() for p in [path, *path.parent.glob(path.name + "-*")])
    tables = store.database.table_names()
    rows = [repr(list(r)) for t in tables for r in store.database.all(f"SELECT * FROM {t}")]
    return "\n".join(rows).encode()


def database_size(store: Store, location: Location) -> int:
    """Bytes the database takes: the file and its WAL, or PostgreSQL's own count."""
    if location.engine == "sqlite":
        path = Path(location.path)
        wal = path.with_name(path.name + "-wal")
        return path.stat().st_size + (wal.stat().st_size if wal.exists() else 0)
    row = store.database.one("SELECT pg_database_size(current_database())")
    assert row is not None
    return int(row[0])


@pytest.fixture
def sqlite_store(db_path: Path, clock: Clock) -> Iterator[Store]:
    """A store on a fresh SQLite file at ``db_path`` (tests of SQLite's own behaviour)."""
    s = Store.open(db_path, clock=clock)
    yield s
    s.close()


@pytest.fixture
def make_node(store: Store) -> Callable[..., Node]:
    """``make_node(node_id="gpu1", **changes)``: a connected node as its agent reports it."""

    def make(node_id: str = "gpu1", **kw: object) -> Node:
        args: dict[str, object] = {
            "dataplane_addr": "10.0.0.1:9000",
            "agent_version": "0.1.0",
            "inventory": {"gpus": [{"name": "H100", "memory_mib": 81920}]},
            "connected": True,
        }
        args.update(kw)
        return store.upsert_node(node_id, **args)  # type: ignore[arg-type]

    return make


@pytest.fixture
def replica_with_shards(
    store: Store, make_node: Callable[..., Node]
) -> Callable[[], tuple[Replica, list[Shard]]]:
    """``replica_with_shards()``: model llama's one replica, its ranks on gpu1 and gpu2."""

    def make() -> tuple[Replica, list[Shard]]:
        make_node("gpu1")
        make_node("gpu2")
        store.put_model("llama", engine="vllm", params={"tp": 2}, replicas=1)
        rep = store.add_replica("llama")
        shards = [store.add_shard(rep.id, "gpu1", rank=0), store.add_shard(rep.id, "gpu2", rank=1)]
        return rep, shards

    return make
