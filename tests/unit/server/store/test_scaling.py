"""Tests for the scaling_state table: a model's scale-down window and its sleepers' learnt
host memory kept apart, cleared, and gone with their model (both engines)."""

from __future__ import annotations

from llmgw.server.store import Store


def _model(store: Store, name: str) -> None:
    store.put_model(name, engine="sim", params={}, replicas=1)


def test_a_window_round_trips_and_clears_without_the_learnt_memory(store: Store) -> None:
    _model(store, "llama")
    _model(store, "qwen")
    store.set_scale_down_window("llama", 1700000000.5)
    store.set_learnt_host_memory("llama", 4096)
    store.set_learnt_host_memory("qwen", 512)
    assert store.scale_down_windows() == {"llama": 1700000000.5}
    assert store.learnt_host_memory() == {"llama": 4096, "qwen": 512}
    store.set_scale_down_window("llama", 1700000060.0)  # stepped: the window again
    assert store.scale_down_windows() == {"llama": 1700000060.0}
    store.set_scale_down_window("llama", None)
    assert store.scale_down_windows() == {}
    assert store.learnt_host_memory() == {"llama": 4096, "qwen": 512}  # untouched
    store.set_learnt_host_memory("qwen", 1024)
    assert store.learnt_host_memory()["qwen"] == 1024


def test_nothing_is_kept_for_a_model_that_is_gone(store: Store) -> None:
    _model(store, "llama")
    store.set_scale_down_window("llama", 5.0)
    store.set_learnt_host_memory("llama", 64)
    store.delete_model("llama")
    assert store.scale_down_windows() == {} and store.learnt_host_memory() == {}
    # A write racing its deletion writes nothing (no row without its model, no error).
    store.set_scale_down_window("llama", 6.0)
    store.set_learnt_host_memory("llama", 64)
    store.set_scale_down_window("never", None)
    assert store.scale_down_windows() == {} and store.learnt_host_memory() == {}
