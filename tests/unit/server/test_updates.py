"""The control plane's side of signed updates: the store's update rows (migration 4, counters
that only grow)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from llmgw.errors import Conflict
from llmgw.server.store import MIGRATIONS, Store

ORDER = {"order": b'{"counter":1}', "signature": b"sig", "expires": 2000.0}


def test_migration_4_adds_update_rows_to_a_v3_database(tmp_path: Path) -> None:
    path = tmp_path / "v3.db"
    conn = sqlite3.connect(path)
    for script in MIGRATIONS[:3]:
        conn.executescript(script)
    conn.execute("PRAGMA user_version=3")
    conn.execute("INSERT INTO nodes(id, uid, created_at) VALUES ('gpu-1', 'u1', 1.0)")
    conn.commit()
    conn.close()
    with Store.open(path) as s:
        assert s.schema_version() == len(MIGRATIONS) >= 4
        assert s.get_node("gpu-1").uid == "u1"
        assert s.get_update("gpu-1") is None
        assert s.list_updates() == []
        assert s.next_update_counter("gpu-1") == 1


def test_counters_only_grow_per_node(store: Store) -> None:
    assert [store.next_update_counter("a") for _ in range(3)] == [1, 2, 3]
    assert store.next_update_counter("b") == 1
    # A reserved counter not used for an order is skipped, never given out again.
    assert store.get_update("a") is None
    with store.transaction():
        counter = store.next_update_counter("a")
        store.put_update(
            "a", counter=counter, version="0.2.0", state="queued", message="m", op_id="op", **ORDER
        )
    update = store.get_update("a")
    assert update is not None
    assert (update.counter, update.version, update.state, update.order) == (
        4,
        "0.2.0",
        "queued",
        b'{"counter":1}',
    )
    assert store.next_update_counter("a") == 5


def test_a_stale_counter_is_not_recorded(store: Store) -> None:
    first = store.next_update_counter("a")
    store.next_update_counter("a")
    with pytest.raises(Conflict, match="no longer the latest"):
        store.put_update(
            "a", counter=first, version="0.2.0", state="queued", message="", op_id="", **ORDER
        )
    assert store.get_update("a") is None


def test_update_state_is_set_only_for_the_latest_order(store: Store) -> None:
    counter = store.next_update_counter("a")
    store.put_update(
        "a", counter=counter, version="0.2.0", state="sent", message="", op_id="op", **ORDER
    )
    assert store.set_update_state("a", counter, "done", "upgraded to 0.2.0")
    assert not store.set_update_state("a", counter - 1 if counter > 1 else 99, "refused", "old")
    update = store.get_update("a")
    assert update is not None and (update.state, update.message) == ("done", "upgraded to 0.2.0")
    assert [u.node_id for u in store.list_updates()] == ["a"]


def test_update_rows_outlive_the_node(store: Store) -> None:
    store.upsert_node(
        "gpu-1", dataplane_addr="a:1", agent_version="0.1.0", inventory={}, connected=True
    )
    assert store.next_update_counter("gpu-1") == 1
    store.delete_node("gpu-1")
    assert store.next_update_counter("gpu-1") == 2


def test_orders_carry_the_rotation_only_while_it_lasts(tmp_path: Path) -> None:
    """What lets a root helper that still trusts the old CA follow a rotation: the new CA's
    pin, its certificate and the old CA's cross-certificate, signed into the order; nothing
    before a rotation or after the old CA was dropped (older helpers refuse unknown fields)."""
    from llmgw import pki
    from llmgw.contracts.update_order import trust_move, verify_order
    from llmgw.server.updates import rotation_fields, sign_order
    from tests.unit.orders import order_for

    d = tmp_path / "pki"
    old = pki.init_ca(d)
    assert rotation_fields(old) == {}
    pki.rotate_ca(d, overlap=3600)
    new = pki.load_ca(d)
    fields = rotation_fields(new)
    assert fields["ca_pin"] == new.ca_hash()
    certs = [pki.load_certs(p.encode())[0] for p in fields["ca_certs"]]
    assert certs == [new.cert, pki.load_cert(d / pki.CROSS_CERT)]
    data, signature = sign_order(new.key, order_for(**fields))
    order = verify_order(pki.cert_pem(old.cert), data, signature)  # a helper on the old CA
    assert trust_move(order, pki.cert_pem(old.cert)) == (new.ca_hash(), pki.cert_pem(new.cert))
    pki.finish_rotation(d)
    assert rotation_fields(new) == {}
