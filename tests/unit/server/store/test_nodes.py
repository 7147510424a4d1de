"""Tests for the nodes table: agent reports, approval states, loss, and enrolment."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.errors import Conflict, NotFound, TokenError
from llmgw.server.store import (
    Node,
    Replica,
    Shard,
    Store,
)
from tests.unit.clock import Clock


def test_upsert_node_creates_then_keeps_uid_and_state(
    store: Store, clock: Clock, make_node: Callable[..., Node]
) -> None:
    n = make_node()
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
    n2 = make_node(agent_version="0.2.0", inventory={"gpus": []}, connected=False)
    assert n2.uid == n.uid
    assert n2.state == "revoked"
    assert n2.agent_version == "0.2.0"
    assert n2.inventory == {"gpus": []}
    assert n2.connected is False
    assert n2.created_at == 1000.0
    assert n2.last_seen == 1005.0


def test_node_setters(store: Store, clock: Clock, make_node: Callable[..., Node]) -> None:
    make_node("a")
    make_node("b")
    store.set_node_connected("a", False)
    assert store.get_node("a").connected is False
    clock.advance(10)
    assert store.touch_nodes({"a": 1010.0}) == 1
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


def test_touch_nodes_writes_a_batch_in_one_go_and_never_back_in_time(
    store: Store, make_node: Callable[..., Node]
) -> None:
    for name in ("a", "b", "c"):
        make_node(name)
    base = store.get_node("a").last_seen
    assert base is not None
    assert store.touch_nodes({}) == 0
    # An unknown node (deleted meanwhile) is skipped, not an error for the whole batch.
    assert store.touch_nodes({"a": base + 5, "b": base + 7, "ghost": base + 9}) == 2
    assert [store.get_node(n).last_seen for n in ("a", "b", "c")] == [base + 5, base + 7, base]
    # A flush that was overtaken (an older time than the row's) leaves the newer time.
    assert store.touch_nodes({"a": base + 1, "c": base + 2}) == 1
    assert [store.get_node(n).last_seen for n in ("a", "c")] == [base + 5, base + 2]


def test_node_invalid_state(store: Store, make_node: Callable[..., Node]) -> None:
    make_node()
    with pytest.raises(ValueError, match="not a node state"):
        store.set_node_state("gpu1", "banned")


def test_node_not_found(store: Store) -> None:
    msg = "no node named ghost; 'llmgw ctl nodes' lists them"
    with pytest.raises(NotFound) as info:
        store.get_node("ghost")
    assert str(info.value) == msg
    for call in (
        lambda: store.set_node_connected("ghost", True),
        lambda: store.set_node_state("ghost", "approved"),
        lambda: store.set_node_draining("ghost", True),
        lambda: store.delete_node("ghost"),
    ):
        with pytest.raises(NotFound, match="no node named ghost"):
            call()


def test_delete_node(
    store: Store, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    _rep, shards = replica_with_shards()
    with pytest.raises(Conflict, match="still hosts 1 shard"):
        store.delete_node("gpu1")
    store.delete_shard(shards[0].id)
    store.delete_node("gpu1")
    assert [n.id for n in store.list_nodes()] == ["gpu2"]


def test_set_node_lost(store: Store, clock: Clock, make_node: Callable[..., Node]) -> None:
    make_node()
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


def test_enrol_new_node_is_pending(store: Store, clock: Clock) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:aa", rekey=False, node_uid=None, require_approval=False
    )
    assert (node.id, node.state, node.fingerprint) == ("gpu-1", "pending", "sha256:aa")
    assert len(node.uid) == 32 and int(node.uid, 16) >= 0
    assert node.created_at == clock.t
    assert not node.connected


@pytest.mark.parametrize("old_state", ["approved", "revoked", "pending"])
def test_fresh_join_of_known_node_replaces_identity(store: Store, old_state: str) -> None:
    old = store.enrol_node(
        "gpu-1", fingerprint="sha256:old", rekey=False, node_uid=None, require_approval=False
    )
    store.set_node_state("gpu-1", old_state)
    store.add_certificate(
        "aa", node_id="gpu-1", fingerprint="sha256:old", not_before=1.0, not_after=2.0
    )
    new = store.enrol_node(
        "gpu-1", fingerprint="sha256:new", rekey=False, node_uid=None, require_approval=False
    )
    assert new.uid != old.uid
    assert (new.state, new.fingerprint, new.created_at) == ("pending", "sha256:new", old.created_at)
    assert store.is_revoked("aa")
    assert store.list_certificates("gpu-1")[0].reason == "replaced by a fresh join"


def test_rekey_keeps_uid_and_state(store: Store) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
    )
    store.set_node_state("gpu-1", "approved")
    again = store.enrol_node(
        "gpu-1", fingerprint="sha256:b", rekey=True, node_uid=node.uid, require_approval=False
    )
    assert (again.uid, again.state, again.fingerprint) == (node.uid, "approved", "sha256:b")
    pending = store.enrol_node(
        "gpu-1", fingerprint="sha256:c", rekey=True, node_uid=node.uid, require_approval=True
    )
    assert (pending.uid, pending.state, pending.fingerprint) == (node.uid, "pending", "sha256:c")


def test_rekey_refusals(store: Store) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
    )
    with pytest.raises(TokenError) as info:
        store.enrol_node(
            "gpu-1", fingerprint="sha256:b", rekey=True, node_uid="other", require_approval=False
        )
    assert info.value.code == "node_uid_mismatch"
    assert f"node gpu-1 has uid {node.uid}, not other" in str(info.value)

    with pytest.raises(TokenError) as info:
        store.enrol_node(
            "gpu-9", fingerprint="sha256:b", rekey=True, node_uid="x", require_approval=False
        )
    assert info.value.code == "node_unknown"
    assert "join-command --node gpu-9" in str(info.value)

    store.set_node_state("gpu-1", "revoked")
    with pytest.raises(TokenError) as info:
        store.enrol_node(
            "gpu-1", fingerprint="sha256:b", rekey=True, node_uid=node.uid, require_approval=False
        )
    assert info.value.code == "node_revoked"
    assert "a revoked node can come back only through a fresh join" in str(info.value)
    assert store.get_node("gpu-1").fingerprint == "sha256:a"


def test_enrol_node_inside_a_failed_transaction_leaves_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError), store.transaction():
        store.enrol_node(
            "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
        )
        raise RuntimeError("signing failed")
    assert store.list_nodes() == []
