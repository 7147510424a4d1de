"""The control plane's side of signed updates: the store's update rows (migration 4, counters
that only grow), and no order for a release newer than the control plane's own."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import cast

import pytest

from llmgw import pki
from llmgw.errors import Conflict
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.fleet.updates import Updates, version_problem
from llmgw.server.joining.bundles import Bundle
from llmgw.server.store import MIGRATIONS, Store
from llmgw.server.store.states import NodeState

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


# ------------------------------------------ an order for a release newer than the control plane


class _Accounts:
    """The orderer's password, accepted (the checks themselves are
    tests/unit/server/test_operators.py's)."""

    async def confirm(self, name: str, password: object, *, refused: str, source: str = "") -> None:
        assert (name, password, refused) == ("admin", "pw", "nothing was signed")


def _updates(store: Store, tmp_path: Path, served_version: str, server_version: str) -> Updates:
    ca, _server, _client = pki.ensure_server_identity(tmp_path / "pki", hosts=["127.0.0.1"])
    bundle = Bundle(
        rid="linux-x64",
        version=served_version,
        path=tmp_path / f"llmgw-agent-{served_version}-linux-x64.tar.gz",
        sha256="ab" * 32,
        size=1,
    )

    async def served() -> list[Bundle]:
        return [bundle]

    store.upsert_node(
        "gpu-1",
        dataplane_addr="10.0.0.1:9443",
        agent_version="0.1.0",
        inventory={"arch": "x86_64"},
        connected=False,
    )
    store.set_node_state("gpu-1", NodeState.APPROVED)
    return Updates(
        store,
        accounts=cast(OperatorAccounts, _Accounts()),
        ca=ca,
        epoch=1,
        sessions={},
        served=served,
        download_base=lambda: "http://cp:8080",
        bundle_dir=tmp_path,
        server_version=server_version,
    )


@pytest.mark.parametrize("version", ["0.2.0", "0.2.0rc1", "0.1.1", "1.0.0"])
def test_an_order_for_a_newer_release_is_refused_before_anything_is_signed(
    store: Store, tmp_path: Path, version: str
) -> None:
    # The bundle is even served: only the control plane's own version stands in the way.
    updates = _updates(store, tmp_path, version, server_version="0.1.0")
    with pytest.raises(Conflict) as info:
        asyncio.run(
            updates.order(["gpu-1"], version=version, password="pw", account="admin", actor="token")
        )
    assert str(info.value) == (
        f"version {version} is newer than this control plane (llmgw 0.1.0), which would refuse "
        f"agents at {version}; upgrade the control plane to {version} or later first, then "
        "update the agents"
    )
    assert store.get_update("gpu-1") is None
    assert store.next_update_counter("gpu-1") == 1  # no counter was spent
    assert [e for e in store.list_events() if e.kind == "update_ordered"] == []


@pytest.mark.parametrize(
    ("version", "server_version"),
    [("0.1.0", "0.1.0"), ("0.1.0+local", "0.1.0"), ("0.1.0", "0.1.0.dev2"), ("0.0.9", "0.1.0")],
)
def test_an_order_for_the_control_planes_release_or_older_is_signed(
    store: Store, tmp_path: Path, version: str, server_version: str
) -> None:
    updates = _updates(store, tmp_path, version, server_version=server_version)
    (out,) = asyncio.run(
        updates.order(["gpu-1"], version=version, password="pw", account="admin", actor="token")
    )
    assert (out["node"], out["version"], out["counter"], out["state"]) == (
        "gpu-1",
        version,
        1,
        "queued",
    )


def test_version_problem_is_none_within_the_release() -> None:
    assert version_problem("0.3.0+build.7", "0.3.0") is None
    assert version_problem("0.3.1", "0.3.0") is not None


def test_orders_carry_the_rotation_only_while_it_lasts(tmp_path: Path) -> None:
    """What lets a root helper that still trusts the old CA follow a rotation: the new CA's
    pin, its certificate and the old CA's cross-certificate, signed into the order; nothing
    before a rotation or after the old CA was dropped (older helpers refuse unknown fields)."""
    from llmgw import pki
    from llmgw.contracts.update_order import trust_move, verify_order
    from llmgw.server.fleet.updates import rotation_fields, sign_order
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
