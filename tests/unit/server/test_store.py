"""Tests for the control plane's SQLite state store."""

from __future__ import annotations

import sqlite3
import stat
from pathlib import Path

import pytest

from llmgw.errors import Conflict, NotFound, StoreError
from llmgw.server.store import (
    MAX_EVENT_MESSAGE,
    MIGRATIONS,
    ApiKey,
    Event,
    Model,
    Node,
    Replica,
    Shard,
    Store,
    hash_api_key,
)
from tests.unit.clock import Clock


def _node(store: Store, node_id: str = "gpu1", **kw: object) -> Node:
    args: dict[str, object] = {
        "dataplane_addr": "10.0.0.1:9000",
        "agent_version": "0.1.0",
        "inventory": {"gpus": [{"name": "H100", "memory_mib": 81920}]},
        "connected": True,
    }
    args.update(kw)
    return store.upsert_node(node_id, **args)  # type: ignore[arg-type]


def _replica_with_shards(store: Store) -> tuple[Replica, list[Shard]]:
    _node(store, "gpu1")
    _node(store, "gpu2")
    store.put_model("llama", engine="vllm", params={"tp": 2}, replicas=1)
    rep = store.add_replica("llama")
    shards = [store.add_shard(rep.id, "gpu1", rank=0), store.add_shard(rep.id, "gpu2", rank=1)]
    return rep, shards


# ------------------------------------------------------------------ opening


def test_wal_mode_and_pragmas(store: Store, db_path: Path) -> None:
    assert store.journal_mode() == "wal"
    assert store._one("PRAGMA foreign_keys")[0] == 1  # type: ignore[index]
    assert store._one("PRAGMA synchronous")[0] == 1  # type: ignore[index]  # NORMAL
    assert store._one("PRAGMA busy_timeout")[0] == 5000  # type: ignore[index]
    # WAL is persistent: a plain sqlite3 connection sees it too.
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        conn.close()


def test_file_mode_0600(store: Store, db_path: Path) -> None:
    store.set_meta("x", "y")
    assert stat.S_IMODE(db_path.stat().st_mode) == 0o600
    wal = db_path.with_name(db_path.name + "-wal")
    if wal.exists():
        assert stat.S_IMODE(wal.stat().st_mode) & 0o077 == 0


def test_missing_directory_refused(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        Store.open(tmp_path / "nope" / "state.db")


def test_not_a_database_refused(tmp_path: Path) -> None:
    path = tmp_path / "junk.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.raises(StoreError, match="not a readable SQLite database") as info:
        Store.open(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


def test_memory_database() -> None:
    with Store.open(":memory:") as s:
        assert s.schema_version() == len(MIGRATIONS)
        s.put_model("m", engine="vllm", params={}, replicas=0)
        assert [m.name for m in s.list_models()] == ["m"]


def test_migrations_idempotent(db_path: Path) -> None:
    s = Store.open(db_path)
    assert s.schema_version() == len(MIGRATIONS)
    s.put_model("m", engine="vllm", params={"a": 1}, replicas=2)
    s.close()
    s = Store.open(db_path)
    assert s.schema_version() == len(MIGRATIONS)
    assert s.migrate() == len(MIGRATIONS)
    assert s.get_model("m").params == {"a": 1}
    s.close()


def test_future_schema_refused(db_path: Path) -> None:
    Store.open(db_path).close()
    conn = sqlite3.connect(db_path)
    conn.execute(f"PRAGMA user_version={len(MIGRATIONS) + 5}")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError) as info:
        Store.open(db_path)
    assert str(info.value) == (
        f"state database {db_path} has schema version {len(MIGRATIONS) + 5}, newer than this "
        f"llmgw ({len(MIGRATIONS)}); upgrade llmgw or restore a backup"
    )


def test_closed_store_raises_store_error(db_path: Path) -> None:
    s = Store.open(db_path)
    s.close()
    s.close()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        s.list_nodes()


def test_locked_database_is_store_error(db_path: Path) -> None:
    s = Store.open(db_path)
    other = sqlite3.connect(db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    try:
        s._db.execute("PRAGMA busy_timeout=50")
        with pytest.raises(StoreError, match="locked") as info:
            s.set_meta("k", "v")
        assert str(db_path) in str(info.value)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
    finally:
        other.execute("ROLLBACK")
        other.close()
    s.set_meta("k", "v")  # usable again once the lock is gone
    assert s.get_meta("k") == "v"
    s.close()


# --------------------------------------------------------------------- meta


def test_meta(store: Store) -> None:
    assert store.get_meta("missing") is None
    assert store.get_meta("missing", "dflt") == "dflt"
    store.set_meta("k", "v1")
    store.set_meta("k", "v2")
    assert store.get_meta("k") == "v2"


def test_cluster_id_stable_across_reopen(db_path: Path) -> None:
    s = Store.open(db_path)
    cid = s.cluster_id()
    assert len(cid) == 36
    assert s.cluster_id() == cid
    s.close()
    s = Store.open(db_path)
    assert s.cluster_id() == cid
    s.close()


def test_bump_epoch_persists(db_path: Path) -> None:
    s = Store.open(db_path)
    assert s.epoch() == 0
    assert s.bump_epoch() == 1
    assert s.bump_epoch() == 2
    assert s.epoch() == 2
    s.close()
    s = Store.open(db_path)
    assert s.epoch() == 2
    assert s.bump_epoch() == 3
    s.close()


# -------------------------------------------------------------------- nodes


def test_upsert_node_creates_then_keeps_uid_and_state(store: Store, clock: Clock) -> None:
    n = _node(store)
    assert isinstance(n, Node)
    assert n.id == "gpu1"
    assert len(n.uid) == 32
    assert n.state == "approved"
    assert n.connected is True
    assert n.draining is False
    assert n.inventory == {"gpus": [{"name": "H100", "memory_mib": 81920}]}
    assert n.last_seen == n.created_at == 1000.0
    assert n.fingerprint is None

    store.set_node_state("gpu1", "revoked")
    clock.advance(5)
    n2 = _node(store, agent_version="0.2.0", inventory={"gpus": []}, connected=False)
    assert n2.uid == n.uid
    assert n2.state == "revoked"
    assert n2.agent_version == "0.2.0"
    assert n2.inventory == {"gpus": []}
    assert n2.connected is False
    assert n2.created_at == 1000.0
    assert n2.last_seen == 1005.0


def test_node_setters(store: Store, clock: Clock) -> None:
    _node(store, "a")
    _node(store, "b")
    store.set_node_connected("a", False)
    assert store.get_node("a").connected is False
    clock.advance(10)
    store.touch_node("a")
    assert store.get_node("a").last_seen == 1010.0
    store.set_node_state("a", "pending")
    assert store.get_node("a").state == "pending"
    store.set_node_draining("a", True)
    assert store.get_node("a").draining is True
    store.set_node_fingerprint("a", "ab:cd")
    assert store.get_node("a").fingerprint == "ab:cd"
    assert [n.id for n in store.list_nodes()] == ["a", "b"]
    store.set_all_disconnected()
    assert not any(n.connected for n in store.list_nodes())


def test_node_invalid_state(store: Store) -> None:
    _node(store)
    with pytest.raises(ValueError, match="not a node state"):
        store.set_node_state("gpu1", "banned")


def test_node_not_found(store: Store) -> None:
    msg = "no node named ghost; 'llmgw ctl nodes' lists them"
    with pytest.raises(NotFound) as info:
        store.get_node("ghost")
    assert str(info.value) == msg
    for call in (
        lambda: store.set_node_connected("ghost", True),
        lambda: store.touch_node("ghost"),
        lambda: store.set_node_state("ghost", "approved"),
        lambda: store.set_node_draining("ghost", True),
        lambda: store.delete_node("ghost"),
    ):
        with pytest.raises(NotFound, match="no node named ghost"):
            call()


def test_delete_node(store: Store) -> None:
    _rep, shards = _replica_with_shards(store)
    with pytest.raises(Conflict, match="still hosts 1 shard"):
        store.delete_node("gpu1")
    store.delete_shard(shards[0].id)
    store.delete_node("gpu1")
    assert [n.id for n in store.list_nodes()] == ["gpu2"]


# ------------------------------------------------------------------- models


def test_put_get_list_model(store: Store, clock: Clock) -> None:
    m = store.put_model("llama", engine="vllm", params={"max_len": 4096}, replicas=2)
    assert m == Model("llama", "vllm", {"max_len": 4096}, 2, 1000.0, 1000.0)
    clock.advance(3)
    m2 = store.put_model("llama", engine="sglang", params={}, replicas=0)
    assert m2 == Model("llama", "sglang", {}, 0, 1000.0, 1003.0)
    store.put_model("alpha", engine="vllm", params={}, replicas=1)
    assert [m.name for m in store.list_models()] == ["alpha", "llama"]
    assert store.get_model("llama") == m2


def test_put_model_negative_replicas(store: Store) -> None:
    with pytest.raises(Conflict, match="replicas must be a whole number of 0 or more"):
        store.put_model("m", engine="vllm", params={}, replicas=-1)
    assert store.list_models() == []


def test_put_model_params_must_be_json(store: Store) -> None:
    with pytest.raises(ValueError, match="JSON"):
        store.put_model("m", engine="vllm", params={"x": object()}, replicas=1)


def test_model_not_found(store: Store) -> None:
    with pytest.raises(NotFound) as info:
        store.get_model("ghost")
    assert str(info.value) == "no model named ghost; 'llmgw ctl models' lists them"
    with pytest.raises(NotFound, match="no model named ghost"):
        store.delete_model("ghost")
    with pytest.raises(NotFound, match="no model named ghost"):
        store.add_replica("ghost")


def test_delete_model_cascades(store: Store) -> None:
    rep, shards = _replica_with_shards(store)
    store.put_model("other", engine="vllm", params={}, replicas=1)
    other = store.add_replica("other")
    store.add_shard(other.id, "gpu1")
    store.delete_model("llama")
    assert [r.id for r in store.list_replicas()] == [other.id]
    assert [s.replica_id for s in store.list_shards()] == [other.id]
    with pytest.raises(NotFound):
        store.get_replica(rep.id)
    for s in shards:
        with pytest.raises(NotFound):
            store.get_shard(s.id)
    # Nodes are not touched by the cascade.
    assert {n.id for n in store.list_nodes()} == {"gpu1", "gpu2"}


# ----------------------------------------------------------------- replicas


def test_replicas(store: Store, clock: Clock) -> None:
    store.put_model("llama", engine="vllm", params={}, replicas=2)
    store.put_model("qwen", engine="vllm", params={}, replicas=1)
    r1 = store.add_replica("llama")
    clock.advance(1)
    r2 = store.add_replica("llama")
    r3 = store.add_replica("qwen")
    assert isinstance(r1, Replica)
    assert r1.id.startswith("llama-") and len(r1.id) == len("llama-") + 6
    int(r1.id.removeprefix("llama-"), 16)
    assert r1.state == "pending" and r1.model == "llama"
    assert r1.id != r2.id
    assert [r.id for r in store.list_replicas("llama")] == [r1.id, r2.id]
    assert [r.id for r in store.list_replicas("qwen")] == [r3.id]
    assert len(store.list_replicas()) == 3
    assert store.list_replicas("ghost") == []

    clock.advance(1)
    store.set_replica_state(r1.id, "ready")
    got = store.get_replica(r1.id)
    assert got.state == "ready" and got.updated_at == 1002.0 and got.created_at == 1000.0
    with pytest.raises(ValueError, match="not a replica state"):
        store.set_replica_state(r1.id, "exited")

    store.delete_replica(r2.id)
    assert [r.id for r in store.list_replicas("llama")] == [r1.id]


def test_replica_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.get_replica("ghost")
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.set_replica_state("ghost", "ready")
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.delete_replica("ghost")


def test_delete_replica_cascades_to_shards(store: Store) -> None:
    rep, _ = _replica_with_shards(store)
    store.delete_replica(rep.id)
    assert store.list_shards() == []


# ------------------------------------------------------------------- shards


def test_shards(store: Store, clock: Clock) -> None:
    rep, (s0, s1) = _replica_with_shards(store)
    assert s0 == Shard(
        id=f"{rep.id}-s0",
        replica_id=rep.id,
        node_id="gpu1",
        rank=0,
        state="pending",
        port=None,
        pid=None,
        exit_code=None,
        reason="",
        restarts=0,
        op_id=None,
        updated_at=1000.0,
    )
    assert s1.id == f"{rep.id}-s1" and s1.node_id == "gpu2" and s1.rank == 1
    assert store.get_shard(s0.id) == s0
    assert store.list_shards(replica_id=rep.id) == [s0, s1]
    assert store.list_shards(node_id="gpu2") == [s1]
    assert store.list_shards(node_id="gpu2", replica_id=rep.id) == [s1]
    assert store.list_shards(node_id="nobody") == []

    clock.advance(7)
    updated = store.update_shard(
        s0.id, state="ready", port=8001, pid=4242, op_id="op-1", restarts=1
    )
    assert (updated.state, updated.port, updated.pid, updated.op_id, updated.restarts) == (
        "ready",
        8001,
        4242,
        "op-1",
        1,
    )
    assert updated.updated_at == 1007.0
    store.update_shard(s0.id, state="exited", exit_code=137, reason="killed (OOM)")
    got = store.get_shard(s0.id)
    assert (got.state, got.exit_code, got.reason, got.port) == ("exited", 137, "killed (OOM)", 8001)

    store.delete_shard(s1.id)
    assert store.list_shards() == [got]


def test_update_shard_rejects_unknown_fields(store: Store) -> None:
    _, (s0, _) = _replica_with_shards(store)
    with pytest.raises(ValueError, match="node_id"):
        store.update_shard(s0.id, node_id="gpu2")
    with pytest.raises(ValueError, match="not a shard state"):
        store.update_shard(s0.id, state="bogus")
    assert store.get_shard(s0.id) == s0


def test_shard_errors(store: Store) -> None:
    rep, _ = _replica_with_shards(store)
    with pytest.raises(Conflict, match=f"replica {rep.id} already has a shard of rank 0"):
        store.add_shard(rep.id, "gpu2", rank=0)
    with pytest.raises(NotFound, match="no node named ghost"):
        store.add_shard(rep.id, "ghost", rank=5)
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.add_shard("ghost", "gpu1")
    with pytest.raises(ValueError, match="rank"):
        store.add_shard(rep.id, "gpu1", rank=-1)
    with pytest.raises(NotFound, match="no shard named ghost"):
        store.get_shard("ghost")
    with pytest.raises(NotFound, match="no shard named ghost"):
        store.update_shard("ghost", state="ready")
    with pytest.raises(NotFound, match="no shard named ghost"):
        store.delete_shard("ghost")
    assert len(store.list_shards()) == 2


# ----------------------------------------------------------------- api keys


def test_api_key_lifecycle(store: Store, clock: Clock) -> None:
    key, secret = store.create_api_key("ci")
    assert isinstance(key, ApiKey)
    assert secret.startswith("sk-llmgw-") and len(secret) > 40
    assert key.name == "ci"
    assert key.prefix == secret[:12]
    assert key.hash == hash_api_key(secret)
    assert key.revoked_at is None and not key.revoked
    assert store.verify_api_key(secret) == key
    assert store.verify_api_key(secret + "x") is None
    assert store.active_key_hashes() == {key.hash}

    clock.advance(1)
    key2, secret2 = store.create_api_key("laptop")
    assert secret2 != secret and key2.id != key.id
    assert [k.id for k in store.list_api_keys()] == [key.id, key2.id]

    clock.advance(60)
    revoked = store.revoke_api_key(key.id)
    assert revoked.revoked and revoked.revoked_at == 1061.0
    assert store.verify_api_key(secret) is None
    assert store.active_key_hashes() == {key2.hash}
    assert [k.id for k in store.list_api_keys()] == [key2.id]
    assert [k.id for k in store.list_api_keys(include_revoked=True)] == [key.id, key2.id]

    # Revoke by prefix.
    store.revoke_api_key(key2.prefix)
    assert store.active_key_hashes() == set()


def test_api_key_secret_never_stored(store: Store, db_path: Path) -> None:
    secrets_made = [store.create_api_key(f"k{i}")[1] for i in range(5)]
    store.close()  # checkpoints the WAL into the main file
    files = [db_path, *db_path.parent.glob(db_path.name + "-*")]
    blob = b"".join(p.read_bytes() for p in files)
    for secret in secrets_made:
        assert secret.encode() not in blob
        assert secret[12:].encode() not in blob  # not even the part after the prefix
        assert hash_api_key(secret).encode() in blob


def test_revoke_twice_conflict(store: Store) -> None:
    key, _ = store.create_api_key("ci")
    store.revoke_api_key(key.id)
    with pytest.raises(Conflict, match="already revoked") as info:
        store.revoke_api_key(key.id)
    assert "'llmgw ctl keys'" in str(info.value)


def test_revoke_unknown_key(store: Store) -> None:
    with pytest.raises(NotFound, match="no API key with id or prefix nope"):
        store.revoke_api_key("nope")


def test_revoke_ambiguous_prefix(store: Store) -> None:
    k1, _ = store.create_api_key("a")
    k2, _ = store.create_api_key("b")
    k3, _ = store.create_api_key("c")
    # Force a prefix collision (3 random characters are in a prefix; collisions happen).
    store._db.execute("UPDATE api_keys SET prefix = ? WHERE id = ?", (k1.prefix, k2.id))
    with pytest.raises(Conflict, match="2 API keys have prefix"):
        store.revoke_api_key(k1.prefix)
    with pytest.raises(Conflict, match="2 API keys have prefix"):
        store.get_api_key(k1.prefix)
    # Once one of them is revoked, the prefix names the other for revocation.
    store.revoke_api_key(k2.id)
    assert store.revoke_api_key(k1.prefix).id == k1.id
    with pytest.raises(Conflict, match="already revoked"):
        store.revoke_api_key(k1.id)
    assert store.get_api_key(k3.prefix).id == k3.id


# ------------------------------------------------------------------- events


def test_events(store: Store, clock: Clock) -> None:
    e1 = store.add_event("node", "gpu1", "connected")
    clock.advance()
    e2 = store.add_event("model", "llama", "scaled to 2")
    clock.advance()
    e3 = store.add_event("node", "gpu1", "disconnected")
    assert isinstance(e1, Event)
    assert e1.ts == 1000.0 and e1.kind == "node" and e1.subject == "gpu1"
    assert store.list_events() == [e3, e2, e1]
    assert store.list_events(limit=2) == [e3, e2]
    assert store.list_events(subject="gpu1") == [e3, e1]
    assert store.list_events(subject="nobody") == []


def test_events_trimmed(store: Store) -> None:
    store.max_events = 20
    store.event_trim_every = 10
    for i in range(95):
        store.add_event("k", "s", f"m{i}")
    events = store.list_events(limit=1000)
    assert 20 <= len(events) < 20 + 10
    assert events[0].message == "m94"
    assert [e.id for e in events] == sorted((e.id for e in events), reverse=True)


def test_a_long_event_message_is_cut_not_stored_whole(store: Store, db_path: Path) -> None:
    before = db_path.stat().st_size + _wal_size(db_path)
    for _ in range(30):
        event = store.add_event("inventory_changed", "n" * 5000, "x" * 3_000_000)
        assert len(event.message) == MAX_EVENT_MESSAGE and event.message.endswith("…")
        assert len(event.subject) == 255
    grown = db_path.stat().st_size + _wal_size(db_path) - before
    assert grown < 1024 * 1024, f"30 events of 3 MB grew the database by {grown} bytes"
    short = store.add_event("k", "s", "short message")
    assert short.message == "short message"


def test_events_are_trimmed_by_total_size_as_well_as_count(store: Store) -> None:
    store.max_event_bytes = 10_000
    store.event_trim_every = 10
    for i in range(200):
        store.add_event("k", "s", f"{i:04d}" + "y" * 496)
    events = store.list_events(limit=1000)
    total = sum(len(e.kind) + len(e.subject) + len(e.message) for e in events)
    # At most the cap, plus what arrived since the last trim.
    assert total <= 10_000 + 10 * 502, total
    assert len(events) >= 10_000 // 502 - 1
    assert events[0].message.startswith("0199")  # the newest stay
    assert [e.id for e in events] == sorted((e.id for e in events), reverse=True)


def _wal_size(db_path: Path) -> int:
    wal = db_path.with_name(db_path.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


# ------------------------------------------------------------- transactions


def test_failed_transaction_rolls_back(store: Store) -> None:
    _node(store)
    store.put_model("keep", engine="vllm", params={}, replicas=1)
    with pytest.raises(RuntimeError), store.transaction():
        store.put_model("llama", engine="vllm", params={}, replicas=1)
        rep = store.add_replica("llama")
        store.add_shard(rep.id, "gpu1")
        store.set_meta("k", "v")
        store.bump_epoch()
        store.delete_model("keep")
        store.add_event("model", "llama", "created")
        raise RuntimeError("boom")
    assert [m.name for m in store.list_models()] == ["keep"]
    assert store.list_replicas() == []
    assert store.list_shards() == []
    assert store.get_meta("k") is None
    assert store.epoch() == 0
    assert store.list_events() == []


def test_store_error_inside_transaction_rolls_back(store: Store) -> None:
    with pytest.raises(NotFound), store.transaction():
        store.put_model("llama", engine="vllm", params={}, replicas=1)
        store.add_replica("ghost")
    assert store.list_models() == []


def test_transaction_commits(store: Store, db_path: Path) -> None:
    with store.transaction() as tx:
        tx.put_model("llama", engine="vllm", params={}, replicas=1)
        tx.add_replica("llama")
    other = Store.open(db_path)
    assert [m.name for m in other.list_models()] == ["llama"]
    assert len(other.list_replicas("llama")) == 1
    other.close()


def test_nested_transaction_uses_savepoint(store: Store) -> None:
    with store.transaction():
        store.set_meta("outer", "1")
        with pytest.raises(RuntimeError), store.transaction():
            store.set_meta("inner", "1")
            raise RuntimeError("inner fails")
        store.set_meta("after", "1")
    assert store.get_meta("outer") == "1"
    assert store.get_meta("inner") is None
    assert store.get_meta("after") == "1"


def test_integrity_error_becomes_conflict(store: Store) -> None:
    key, _ = store.create_api_key("a")
    with pytest.raises(Conflict, match="API key with this hash already exists") as info:
        with store._write():
            store._db.execute(
                "INSERT INTO api_keys(id, name, prefix, hash, created_at) VALUES (?,?,?,?,?)",
                ("other", "b", "p", key.hash, 0.0),
            )
    assert isinstance(info.value.__cause__, sqlite3.IntegrityError)
    assert [k.id for k in store.list_api_keys()] == [key.id]


# ------------------------------------------------ migration 3: catalog, GPUs, lost nodes


def _v2_database(path: Path) -> None:
    """A state database as llmgw with two migrations left it, with a node, a model, a
    replica, a shard, a key and a join token in it."""
    from llmgw.server.store import _split_sql

    conn = sqlite3.connect(path, isolation_level=None)
    for script in MIGRATIONS[:2]:
        for statement in _split_sql(script):
            conn.execute(statement)
    conn.execute("PRAGMA user_version=2")
    conn.execute(
        "INSERT INTO nodes(id, uid, state, inventory, created_at) "
        "VALUES ('gpu1', 'u1', 'approved', '{\"cpus\": 8}', 1.0)"
    )
    conn.execute(
        "INSERT INTO models(name, engine, params, replicas, created_at, updated_at) "
        "VALUES ('m', 'sim', '{\"ttft_ms\": 5}', 2, 1.0, 2.0)"
    )
    conn.execute(
        "INSERT INTO replicas(id, model, state, created_at, updated_at) "
        "VALUES ('m-abc', 'm', 'ready', 1.0, 1.0)"
    )
    conn.execute(
        "INSERT INTO shards(id, replica_id, node_id, rank, state, port, updated_at) "
        "VALUES ('m-abc-s0', 'm-abc', 'gpu1', 0, 'ready', 8001, 1.0)"
    )
    conn.execute(
        "INSERT INTO api_keys(id, name, prefix, hash, created_at) "
        "VALUES ('k1', 'ci', 'sk-llmgw-abc', 'h', 1.0)"
    )
    conn.execute(
        "INSERT INTO join_tokens(id, hash, prefix, node_id, kind, created_at, expires_at) "
        "VALUES ('t1', 'th', 'llmgwjt_abc', 'gpu2', 'join', 1.0, 99.0)"
    )
    conn.close()


def test_migration_3_upgrades_a_v2_database_and_keeps_its_data(db_path: Path) -> None:
    assert len(MIGRATIONS) >= 3
    _v2_database(db_path)
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS)
        node = s.get_node("gpu1")
        assert (node.state, node.inventory, node.lost, node.lost_at) == (
            "approved",
            {"cpus": 8},
            False,
            None,
        )
        assert s.get_model("m") == Model("m", "sim", {"ttft_ms": 5}, 2, 1.0, 2.0, {}, "default")
        assert [r.id for r in s.list_replicas("m")] == ["m-abc"]
        shard = s.get_shard("m-abc-s0")
        assert (shard.state, shard.port, shard.gpus, shard.dist_init_addr) == (
            "ready",
            8001,
            (),
            "",
        )
        assert [k.id for k in s.list_api_keys()] == ["k1"]
        assert s.get_join_token("t1").node_id == "gpu2"
        # A model from before the catalog keeps deploying: its engine is its default.
        scaled = s.deploy_model("m", profile="default", replicas=3)
        assert (scaled.engine, scaled.params, scaled.replicas) == ("sim", {"ttft_ms": 5}, 3)
        with pytest.raises(NotFound, match="deployed without the catalog, with engine sim"):
            s.deploy_model("m", profile="tp2", replicas=1)


SIM_A = {"engine": "sim", "gpus": 0, "nodes": 1, "params": {"ttft_ms": "5"}, "args": []}
SIM_B = {"engine": "sim", "gpus": 0, "nodes": 1, "params": {"tps": "10"}, "args": ["--x"]}
VLLM = {"engine": "vllm", "source": "/srv/m", "gpus": 2, "nodes": 1, "args": [], "params": {}}


def test_put_catalog_model_creates_with_no_replicas(store: Store, clock: Clock) -> None:
    m = store.put_catalog_model("m", {"fast": SIM_B, "default": SIM_A})
    assert m == Model(
        "m",
        "sim",
        {"ttft_ms": "5"},
        0,
        1000.0,
        1000.0,
        {"fast": SIM_B, "default": SIM_A},
        "default",
    )
    # Without a default profile, the first one is deployed.
    other = store.put_catalog_model("o", {"big": VLLM, "small": SIM_A})
    assert (other.profile, other.engine, other.params) == ("big", "vllm", {})


def test_put_catalog_model_keeps_replicas_and_profile(store: Store, clock: Clock) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    store.deploy_model("m", profile="fast", replicas=2)
    clock.advance(5)
    changed = {**SIM_B, "params": {"tps": "20"}}
    m = store.put_catalog_model("m", {"default": SIM_A, "fast": changed, "big": VLLM})
    assert (m.replicas, m.profile, m.engine) == (2, "fast", "sim")
    assert m.params == {"tps": "20", "extra_args": ["--x"]}
    assert (m.created_at, m.updated_at) == (1000.0, 1005.0)
    assert set(m.profiles) == {"default", "fast", "big"}


def test_put_catalog_model_refuses_an_engine_change_under_running_replicas(store: Store) -> None:
    store.put_catalog_model("m", {"default": SIM_A})
    store.deploy_model("m", profile="default", replicas=1)
    # Desired but not yet placed: the engine may change.
    assert store.put_catalog_model("m", {"default": VLLM}).engine == "vllm"
    store.put_catalog_model("m", {"default": SIM_A})
    store.add_replica("m")
    with pytest.raises(Conflict) as info:
        store.put_catalog_model("m", {"default": VLLM})
    assert str(info.value) == (
        "model m runs 1 replica(s) of profile default with engine sim, and the new profile "
        "default has engine vllm; 'llmgw ctl undeploy m' (or scale it to 0) first, or give "
        "engine vllm another profile"
    )
    assert store.get_model("m").profiles == {"default": SIM_A}
    # Another profile may use another engine.
    assert store.put_catalog_model("m", {"default": SIM_A, "big": VLLM}).engine == "sim"


def test_put_catalog_model_refuses_dropping_the_deployed_profile(store: Store) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    store.deploy_model("m", profile="fast", replicas=1)
    with pytest.raises(Conflict, match="drop it; keep profile fast, or scale m to 0 first"):
        store.put_catalog_model("m", {"default": SIM_A})
    store.deploy_model("m", profile="fast", replicas=0)
    m = store.put_catalog_model("m", {"big": VLLM, "default": SIM_A})
    assert (m.profile, m.engine) == ("default", "sim")


def test_put_catalog_model_checks_its_arguments(store: Store) -> None:
    with pytest.raises(ValueError, match="non-empty mapping"):
        store.put_catalog_model("m", {})
    with pytest.raises(ValueError, match="with an engine"):
        store.put_catalog_model("m", {"default": {"gpus": 1}})
    assert store.list_models() == []


def test_deploy_model(store: Store, clock: Clock) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    clock.advance(1)
    m = store.deploy_model("m", profile="fast", replicas=3)
    assert (m.profile, m.engine, m.replicas, m.updated_at) == ("fast", "sim", 3, 1001.0)
    assert m.params == {"tps": "10", "extra_args": ["--x"]}
    with pytest.raises(NotFound) as info:
        store.deploy_model("m", profile="huge", replicas=1)
    assert str(info.value) == "model m has no profile huge; its profiles: default, fast"
    with pytest.raises(NotFound, match="no model named ghost"):
        store.deploy_model("ghost", profile="default", replicas=1)
    with pytest.raises(Conflict, match="replicas must be a whole number"):
        store.deploy_model("m", profile="fast", replicas=-1)
    assert store.get_model("m") == m


def test_a_profile_switch_keeps_the_running_replicas_and_records_each_ones_profile(
    store: Store,
) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    store.deploy_model("m", profile="default", replicas=1)
    old = store.add_replica("m")
    assert old.profile == "default"
    switched = store.deploy_model("m", profile="fast", replicas=1)
    assert switched.profile == "fast"
    # The running replica is not touched by the store: the scheduler replaces it.
    assert [r.profile for r in store.list_replicas("m")] == ["default"]
    assert store.add_replica("m").profile == "fast"
    # Scaling the deployed profile is fine.
    assert store.deploy_model("m", profile="fast", replicas=4).replicas == 4


def test_migration_5_leaves_older_replicas_without_a_profile(db_path: Path) -> None:
    # A replica placed before llmgw recorded profiles (here: from a v2 database) has none,
    # and a profile switch leaves it alone; new replicas get the deployed profile.
    _v2_database(db_path)
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS)
        assert s.get_replica("m-abc").profile is None
        assert s.add_replica("m").profile == "default"


def test_put_model_with_and_without_profiles(store: Store) -> None:
    m = store.put_model(
        "m", engine="sim", params={"ttft_ms": 5}, replicas=1, profiles={"default": SIM_A}
    )
    assert (m.profiles, m.profile) == ({"default": SIM_A}, "default")
    # Replaced without profiles, it is a model outside the catalog again.
    assert store.put_model("m", engine="sim", params={}, replicas=1).profiles == {}
    with pytest.raises(ValueError, match="must include 'default'"):
        store.put_model("m", engine="sim", params={}, replicas=1, profiles={"fast": SIM_B})


def test_update_shard_gpus_and_dist_init_addr(store: Store) -> None:
    _, (s0, _) = _replica_with_shards(store)
    got = store.update_shard(s0.id, gpus=["GPU-a", "GPU-b"], dist_init_addr="10.0.0.1:29500")
    assert (got.gpus, got.dist_init_addr) == (("GPU-a", "GPU-b"), "10.0.0.1:29500")
    assert store.update_shard(s0.id, gpus=()).gpus == ()
    with pytest.raises(ValueError, match="list of GPU uuids"):
        store.update_shard(s0.id, gpus="GPU-a")
    with pytest.raises(ValueError, match="list of GPU uuids"):
        store.update_shard(s0.id, gpus=[0, 1])
    with pytest.raises(ValueError, match="host:port string"):
        store.update_shard(s0.id, dist_init_addr=None)
    assert store.get_shard(s0.id).dist_init_addr == "10.0.0.1:29500"


def test_set_node_lost(store: Store, clock: Clock) -> None:
    _node(store)
    store.set_node_lost("gpu1", True)
    node = store.get_node("gpu1")
    assert (node.lost, node.lost_at) == (True, 1000.0)
    clock.advance(10)
    store.set_node_lost("gpu1", True)  # still lost since it was first found lost
    assert store.get_node("gpu1").lost_at == 1000.0
    store.set_node_lost("gpu1", False)
    node = store.get_node("gpu1")
    assert (node.lost, node.lost_at) == (False, None)
    with pytest.raises(NotFound, match="no node named ghost"):
        store.set_node_lost("ghost", True)


def test_catalog_changes_roll_back_together(store: Store) -> None:
    store.put_catalog_model("a", {"default": SIM_A})
    store.deploy_model("a", profile="default", replicas=1)
    store.add_replica("a")
    with pytest.raises(Conflict), store.transaction():
        store.put_catalog_model("b", {"default": SIM_B})
        store.put_catalog_model("a", {"default": VLLM})
    assert [m.name for m in store.list_models()] == ["a"]
