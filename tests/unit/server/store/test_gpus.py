"""Tests for the gpu_cordons table: cordons kept with who, when and why, lifted, and gone
with their node."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.server.store import GpuCordon, Node, Store
from tests.unit.clock import Clock


def test_cordons_round_trip(store: Store, make_node: Callable[..., Node], clock: Clock) -> None:
    make_node("gpu1")
    make_node("gpu2")
    added = store.cordon_gpus("gpu1", ["GPU-b", "GPU-a"], reason="fan noise", actor="alice")
    assert [c.gpu_uuid for c in added] == ["GPU-b", "GPU-a"]
    store.cordon_gpus("gpu2", ["GPU-c"], reason="", actor="token")
    assert store.list_gpu_cordons("gpu1") == [
        GpuCordon("gpu1", "GPU-a", "fan noise", "alice", clock()),
        GpuCordon("gpu1", "GPU-b", "fan noise", "alice", clock()),
    ]
    assert [(c.node_id, c.gpu_uuid) for c in store.list_gpu_cordons()] == [
        ("gpu1", "GPU-a"),
        ("gpu1", "GPU-b"),
        ("gpu2", "GPU-c"),
    ]


def test_a_second_cordon_keeps_the_first(store: Store, make_node: Callable[..., Node]) -> None:
    make_node("gpu1")
    store.cordon_gpus("gpu1", ["GPU-a"], reason="first", actor="alice")
    assert store.cordon_gpus("gpu1", ["GPU-a"], reason="second", actor="bob") == []
    assert [(c.reason, c.actor) for c in store.list_gpu_cordons()] == [("first", "alice")]


def test_uncordon_lifts_only_those_cordoned(store: Store, make_node: Callable[..., Node]) -> None:
    make_node("gpu1")
    store.cordon_gpus("gpu1", ["GPU-a", "GPU-b"], reason="", actor="alice")
    assert store.uncordon_gpus("gpu1", ["GPU-a", "GPU-z"]) == ["GPU-a"]
    assert [c.gpu_uuid for c in store.list_gpu_cordons()] == ["GPU-b"]


def test_cordons_go_with_their_node(store: Store, make_node: Callable[..., Node]) -> None:
    make_node("gpu1")
    store.cordon_gpus("gpu1", ["GPU-a"], reason="", actor="alice")
    store.delete_node("gpu1")
    assert store.list_gpu_cordons() == []
