"""The operators table (llmgw.server.store.operators), on both engines: names unique among
the active accounts, roles checked, the last admin kept, a removed row kept."""

from __future__ import annotations

import pytest

from llmgw.errors import Conflict, NotFound
from llmgw.server.store import Store
from tests.unit.clock import Clock


def test_add_get_and_list(store: Store, clock: Clock) -> None:
    made = store.add_operator("alice", "admin", "scrypt$h1", "token")
    assert (made.name, made.role, made.created_by, made.removed_at) == (
        "alice",
        "admin",
        "token",
        None,
    )
    assert made.created_at == made.password_changed_at == clock()
    store.add_operator("bob", "viewer", "scrypt$h2", "alice")
    assert [o.name for o in store.list_operators()] == ["alice", "bob"]
    assert store.get_operator("bob").password_hash == "scrypt$h2"
    assert "scrypt$h2" not in repr(store.get_operator("bob"))


def test_refusals(store: Store) -> None:
    store.add_operator("alice", "admin", "h", "token")
    with pytest.raises(Conflict, match="operator 'alice' exists already"):
        store.add_operator("alice", "viewer", "h", "token")
    with pytest.raises(ValueError, match="bad operator name 'Al ice': 1 to 64 characters"):
        store.add_operator("Al ice", "viewer", "h", "token")
    with pytest.raises(ValueError, match="unknown role 'root'; use one of admin, viewer"):
        store.add_operator("carol", "root", "h", "token")
    with pytest.raises(NotFound, match="no operator 'nobody'"):
        store.get_operator("nobody")
    assert store.find_operator("nobody") is None


def test_the_last_admin_is_neither_removed_nor_demoted(store: Store) -> None:
    store.add_operator("alice", "admin", "h", "token")
    with pytest.raises(Conflict, match="'alice' is the last admin and cannot be removed"):
        store.remove_operator("alice")
    with pytest.raises(Conflict, match="'alice' is the last admin and cannot be demoted"):
        store.set_operator_role("alice", "viewer")
    store.add_operator("bob", "admin", "h", "token")
    assert store.set_operator_role("alice", "viewer").role == "viewer"
    with pytest.raises(Conflict, match="'bob' is the last admin"):
        store.remove_operator("bob")


def test_a_removed_name_can_be_taken_again(store: Store, clock: Clock) -> None:
    store.add_operator("bob", "viewer", "h1", "token")
    clock.advance(5)
    removed = store.remove_operator("bob")
    assert removed.removed_at == clock()
    assert store.find_operator("bob") is None and store.list_operators() == []
    again = store.add_operator("bob", "admin", "h2", "token")
    assert again.id != removed.id and again.password_hash == "h2"
    assert store.count_operators() == 2


def test_a_password_change_is_stamped(store: Store, clock: Clock) -> None:
    store.add_operator("bob", "viewer", "h1", "token")
    clock.advance(7)
    changed = store.set_operator_password("bob", "h2")
    assert changed.password_hash == "h2" and changed.password_changed_at == clock()
    with pytest.raises(NotFound):
        store.set_operator_password("nobody", "h")


def test_an_event_keeps_its_actor(store: Store) -> None:
    store.add_event("operator_added", "bob", "role viewer", "alice")
    store.add_event("node_approved", "gpu-01", "approved")
    assert [e.actor for e in store.list_events()] == ["", "alice"]
