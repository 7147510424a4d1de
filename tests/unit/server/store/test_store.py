"""Tests for the Store itself: meta values, and transactions across its tables."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.errors import NotFound
from llmgw.server.store import (
    Node,
    Store,
)
from llmgw.server.store.credentials import ApiKeys, Certificates, JoinTokens
from llmgw.server.store.events import Events
from llmgw.server.store.location import Location
from llmgw.server.store.models import Models
from llmgw.server.store.nodes import Nodes
from llmgw.server.store.updates import NodeUpdates


def test_meta(store: Store) -> None:
    assert store.get_meta("missing") is None
    assert store.get_meta("missing", "dflt") == "dflt"
    store.set_meta("k", "v1")
    store.set_meta("k", "v2")
    assert store.get_meta("k") == "v2"


def test_cluster_id_stable_across_reopen(db_location: Location) -> None:
    s = Store.open(db_location)
    cid = s.cluster_id()
    assert len(cid) == 36
    assert s.cluster_id() == cid
    s.close()
    s = Store.open(db_location)
    assert s.cluster_id() == cid
    s.close()


def test_bump_epoch_persists(db_location: Location) -> None:
    s = Store.open(db_location)
    assert s.epoch() == 0
    assert s.bump_epoch() == 1
    assert s.bump_epoch() == 2
    assert s.epoch() == 2
    s.close()
    s = Store.open(db_location)
    assert s.epoch() == 2
    assert s.bump_epoch() == 3
    s.close()


def test_failed_transaction_rolls_back(store: Store, make_node: Callable[..., Node]) -> None:
    make_node()
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


def test_transaction_commits(store: Store, db_location: Location) -> None:
    with store.transaction() as tx:
        tx.put_model("llama", engine="vllm", params={}, replicas=1)
        tx.add_replica("llama")
    other = Store.open(db_location)
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


def test_the_store_offers_every_method_of_its_tables(store: Store) -> None:
    # A method added to a table class and not to Store would be out of callers' reach.
    tables = {
        "_nodes": Nodes,
        "_models": Models,
        "_api_keys": ApiKeys,
        "_join_tokens": JoinTokens,
        "_certificates": Certificates,
        "_updates": NodeUpdates,
        "_events": Events,
    }
    for attr, table in tables.items():
        assert isinstance(getattr(store, attr), table)
        for name, method in vars(table).items():
            if name.startswith("_") or not callable(method):
                continue
            offered = getattr(store, name)
            assert offered.__func__ is method, f"Store.{name} is not {table.__name__}.{name}"
            assert getattr(Store, name).__doc__ == method.__doc__
