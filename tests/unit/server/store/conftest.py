"""Fixtures of the state store's tests: a store on a file in tmp_path, on a clock the test
moves, and the rows most tests start from."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llmgw.server.store import Node, Replica, Shard, Store


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float = 1.0) -> None:
        self.t += dt


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(db_path: Path, clock: Clock) -> Iterator[Store]:
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
