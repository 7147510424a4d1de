"""Tests for the rows the store hands out and the checks on the values it writes."""

from __future__ import annotations

import pytest

from llmgw.server.states import NodeState, ReplicaState, ShardState, TokenKind
from llmgw.server.store import Store
from llmgw.server.store.rows import check_state, dump_json


def test_state_columns_come_back_as_the_enums_and_equal_their_names(store: Store) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
    )
    store.put_model("m", engine="sim", params={}, replicas=1)
    replica = store.add_replica("m")
    shard = store.add_shard(replica.id, "gpu-1")
    token, _ = store.create_join_token("gpu-2", ttl=60)
    assert node.state is NodeState.PENDING and node.state == "pending"
    assert replica.state is ReplicaState.PENDING
    assert shard.state is ShardState.PENDING and f"{shard.state}" == "pending"
    assert token.kind is TokenKind.JOIN
    store.update_shard(shard.id, state="ready")
    assert store.get_shard(shard.id).state is ShardState.READY


def test_check_state() -> None:
    assert check_state("ready", ShardState, "shard") is ShardState.READY
    with pytest.raises(ValueError) as info:
        check_state("banned", NodeState, "node")
    assert str(info.value) == "'banned' is not a node state; use one of approved, pending, revoked"


def test_dump_json() -> None:
    assert dump_json({"b": 1, "a": [1, 2]}, "params") == '{"a":[1,2],"b":1}'
    with pytest.raises(ValueError, match="params must be a mapping, not list"):
        dump_json([1], "params")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="params must be JSON-serialisable"):
        dump_json({"x": object()}, "params")
