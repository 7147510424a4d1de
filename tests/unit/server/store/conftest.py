"""Fixtures of the state store's tests: the rows most tests start from (the store itself, on a
file in tmp_path and the clock the test moves, is tests/unit/server/conftest.py's)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.server.store import Node, Replica, Shard, Store


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
