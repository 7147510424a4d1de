"""Tests for models, their catalog profiles, replicas and shards."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmgw.errors import Conflict, NotFound
from llmgw.server.store import (
    Model,
    Replica,
    Shard,
    Store,
)
from tests.unit.clock import Clock


def test_put_get_list_model(store: Store, clock: Clock) -> None:
    m = store.put_model("llama", engine="vllm", params={"max_len": 4096}, replicas=2)
    assert m == Model("llama", "vllm", {"max_len": 4096}, 2, 1000.0, 1000.0)
    clock.advance(3)
    m2 = store.put_model("llama", engine="sglang", params={}, replicas=0)
    assert m2 == Model("llama", "sglang", {}, 0, 1000.0, 1003.0)
    store.put_model("alpha", engine="vllm", params={}, replicas=1)
    assert [m.name for m in store.list_models()] == ["alpha", "llama"]
    assert store.get_model("llama") == m2


def test_put_model_negative_replicas(store: Store) -> None:
    with pytest.raises(Conflict, match="replicas must be a whole number of 0 or more"):
        store.put_model("m", engine="vllm", params={}, replicas=-1)
    assert store.list_models() == []


def test_put_model_params_must_be_json(store: Store) -> None:
    with pytest.raises(ValueError, match="JSON"):
        store.put_model("m", engine="vllm", params={"x": object()}, replicas=1)


def test_model_not_found(store: Store) -> None:
    with pytest.raises(NotFound) as info:
        store.get_model("ghost")
    assert str(info.value) == "no model named ghost; 'llmgw ctl models' lists them"
    with pytest.raises(NotFound, match="no model named ghost"):
        store.delete_model("ghost")
    with pytest.raises(NotFound, match="no model named ghost"):
        store.add_replica("ghost")


def test_delete_model_cascades(
    store: Store, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    rep, shards = replica_with_shards()
    store.put_model("other", engine="vllm", params={}, replicas=1)
    other = store.add_replica("other")
    store.add_shard(other.id, "gpu1")
    store.delete_model("llama")
    assert [r.id for r in store.list_replicas()] == [other.id]
    assert [s.replica_id for s in store.list_shards()] == [other.id]
    with pytest.raises(NotFound):
        store.get_replica(rep.id)
    for s in shards:
        with pytest.raises(NotFound):
            store.get_shard(s.id)
    # Nodes are not touched by the cascade.
    assert {n.id for n in store.list_nodes()} == {"gpu1", "gpu2"}


def test_replicas(store: Store, clock: Clock) -> None:
    store.put_model("llama", engine="vllm", params={}, replicas=2)
    store.put_model("qwen", engine="vllm", params={}, replicas=1)
    r1 = store.add_replica("llama")
    clock.advance(1)
    r2 = store.add_replica("llama")
    r3 = store.add_replica("qwen")
    assert isinstance(r1, Replica)
    assert r1.id.startswith("llama-") and len(r1.id) == len("llama-") + 6
    int(r1.id.removeprefix("llama-"), 16)
    assert r1.state == "pending" and r1.model == "llama"
    assert r1.id != r2.id
    assert [r.id for r in store.list_replicas("llama")] == [r1.id, r2.id]
    assert [r.id for r in store.list_replicas("qwen")] == [r3.id]
    assert len(store.list_replicas()) == 3
    assert store.list_replicas("ghost") == []

    clock.advance(1)
    store.set_replica_state(r1.id, "ready")
    got = store.get_replica(r1.id)
    assert got.state == "ready" and got.updated_at == 1002.0 and got.created_at == 1000.0
    with pytest.raises(ValueError, match="not a replica state"):
        store.set_replica_state(r1.id, "exited")

    store.delete_replica(r2.id)
    assert [r.id for r in store.list_replicas("llama")] == [r1.id]


def test_replica_not_found(store: Store) -> None:
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.get_replica("ghost")
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.set_replica_state("ghost", "ready")
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.delete_replica("ghost")


def test_delete_replica_cascades_to_shards(
    store: Store, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    rep, _ = replica_with_shards()
    store.delete_replica(rep.id)
    assert store.list_shards() == []


def test_shards(
    store: Store, clock: Clock, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    rep, (s0, s1) = replica_with_shards()
    assert s0 == Shard(
        id=f"{rep.id}-s0",
        replica_id=rep.id,
        node_id="gpu1",
        rank=0,
        state="pending",
        port=None,
        pid=None,
        exit_code=None,
        reason="",
        restarts=0,
        op_id=None,
        updated_at=1000.0,
    )
    assert s1.id == f"{rep.id}-s1" and s1.node_id == "gpu2" and s1.rank == 1
    assert store.get_shard(s0.id) == s0
    assert store.list_shards(replica_id=rep.id) == [s0, s1]
    assert store.list_shards(node_id="gpu2") == [s1]
    assert store.list_shards(node_id="gpu2", replica_id=rep.id) == [s1]
    assert store.list_shards(node_id="nobody") == []

    clock.advance(7)
    updated = store.update_shard(
        s0.id, state="ready", port=8001, pid=4242, op_id="op-1", restarts=1
    )
    assert (updated.state, updated.port, updated.pid, updated.op_id, updated.restarts) == (
        "ready",
        8001,
        4242,
        "op-1",
        1,
    )
    assert updated.updated_at == 1007.0
    store.update_shard(s0.id, state="exited", exit_code=137, reason="killed (OOM)")
    got = store.get_shard(s0.id)
    assert (got.state, got.exit_code, got.reason, got.port) == ("exited", 137, "killed (OOM)", 8001)

    store.delete_shard(s1.id)
    assert store.list_shards() == [got]


def test_update_shard_rejects_unknown_fields(
    store: Store, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    _, (s0, _) = replica_with_shards()
    with pytest.raises(ValueError, match="node_id"):
        store.update_shard(s0.id, node_id="gpu2")
    with pytest.raises(ValueError, match="not a shard state"):
        store.update_shard(s0.id, state="bogus")
    assert store.get_shard(s0.id) == s0


def test_shard_errors(
    store: Store, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    rep, _ = replica_with_shards()
    with pytest.raises(Conflict, match=f"replica {rep.id} already has a shard of rank 0"):
        store.add_shard(rep.id, "gpu2", rank=0)
    with pytest.raises(NotFound, match="no node named ghost"):
        store.add_shard(rep.id, "ghost", rank=5)
    with pytest.raises(NotFound, match="no replica named ghost"):
        store.add_shard("ghost", "gpu1")
    with pytest.raises(ValueError, match="rank"):
        store.add_shard(rep.id, "gpu1", rank=-1)
    with pytest.raises(NotFound, match="no shard named ghost"):
        store.get_shard("ghost")
    with pytest.raises(NotFound, match="no shard named ghost"):
        store.update_shard("ghost", state="ready")
    with pytest.raises(NotFound, match="no shard named ghost"):
        store.delete_shard("ghost")
    assert len(store.list_shards()) == 2


SIM_A = {"engine": "sim", "gpus": 0, "nodes": 1, "params": {"ttft_ms": "5"}, "args": []}


SIM_B = {"engine": "sim", "gpus": 0, "nodes": 1, "params": {"tps": "10"}, "args": ["--x"]}


VLLM = {"engine": "vllm", "source": "/srv/m", "gpus": 2, "nodes": 1, "args": [], "params": {}}


def test_put_catalog_model_creates_with_no_replicas(store: Store, clock: Clock) -> None:
    m = store.put_catalog_model("m", {"fast": SIM_B, "default": SIM_A})
    assert m == Model(
        "m",
        "sim",
        {"ttft_ms": "5"},
        0,
        1000.0,
        1000.0,
        {"fast": SIM_B, "default": SIM_A},
        "default",
    )
    # Without a default profile, the first one is deployed.
    other = store.put_catalog_model("o", {"big": VLLM, "small": SIM_A})
    assert (other.profile, other.engine, other.params) == ("big", "vllm", {})


def test_put_catalog_model_keeps_replicas_and_profile(store: Store, clock: Clock) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    store.deploy_model("m", profile="fast", replicas=2)
    clock.advance(5)
    changed = {**SIM_B, "params": {"tps": "20"}}
    m = store.put_catalog_model("m", {"default": SIM_A, "fast": changed, "big": VLLM})
    assert (m.replicas, m.profile, m.engine) == (2, "fast", "sim")
    assert m.params == {"tps": "20", "extra_args": ["--x"]}
    assert (m.created_at, m.updated_at) == (1000.0, 1005.0)
    assert set(m.profiles) == {"default", "fast", "big"}


def test_put_catalog_model_refuses_an_engine_change_under_running_replicas(store: Store) -> None:
    store.put_catalog_model("m", {"default": SIM_A})
    store.deploy_model("m", profile="default", replicas=1)
    # Desired but not yet placed: the engine may change.
    assert store.put_catalog_model("m", {"default": VLLM}).engine == "vllm"
    store.put_catalog_model("m", {"default": SIM_A})
    store.add_replica("m")
    with pytest.raises(Conflict) as info:
        store.put_catalog_model("m", {"default": VLLM})
    assert str(info.value) == (
        "model m runs 1 replica(s) of profile default with engine sim, and the new profile "
        "default has engine vllm; 'llmgw ctl undeploy m' (or scale it to 0) first, or give "
        "engine vllm another profile"
    )
    assert store.get_model("m").profiles == {"default": SIM_A}
    # Another profile may use another engine.
    assert store.put_catalog_model("m", {"default": SIM_A, "big": VLLM}).engine == "sim"


def test_put_catalog_model_refuses_dropping_the_deployed_profile(store: Store) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    store.deploy_model("m", profile="fast", replicas=1)
    with pytest.raises(Conflict, match="drop it; keep profile fast, or scale m to 0 first"):
        store.put_catalog_model("m", {"default": SIM_A})
    store.deploy_model("m", profile="fast", replicas=0)
    m = store.put_catalog_model("m", {"big": VLLM, "default": SIM_A})
    assert (m.profile, m.engine) == ("default", "sim")


def test_put_catalog_model_checks_its_arguments(store: Store) -> None:
    with pytest.raises(ValueError, match="non-empty mapping"):
        store.put_catalog_model("m", {})
    with pytest.raises(ValueError, match="with an engine"):
        store.put_catalog_model("m", {"default": {"gpus": 1}})
    assert store.list_models() == []


def test_deploy_model(store: Store, clock: Clock) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    clock.advance(1)
    m = store.deploy_model("m", profile="fast", replicas=3)
    assert (m.profile, m.engine, m.replicas, m.updated_at) == ("fast", "sim", 3, 1001.0)
    assert m.params == {"tps": "10", "extra_args": ["--x"]}
    with pytest.raises(NotFound) as info:
        store.deploy_model("m", profile="huge", replicas=1)
    assert str(info.value) == "model m has no profile huge; its profiles: default, fast"
    with pytest.raises(NotFound, match="no model named ghost"):
        store.deploy_model("ghost", profile="default", replicas=1)
    with pytest.raises(Conflict, match="replicas must be a whole number"):
        store.deploy_model("m", profile="fast", replicas=-1)
    assert store.get_model("m") == m


def test_a_profile_switch_keeps_the_running_replicas_and_records_each_ones_profile(
    store: Store,
) -> None:
    store.put_catalog_model("m", {"default": SIM_A, "fast": SIM_B})
    store.deploy_model("m", profile="default", replicas=1)
    old = store.add_replica("m")
    assert old.profile == "default"
    switched = store.deploy_model("m", profile="fast", replicas=1)
    assert switched.profile == "fast"
    # The running replica is not touched by the store: the scheduler replaces it.
    assert [r.profile for r in store.list_replicas("m")] == ["default"]
    assert store.add_replica("m").profile == "fast"
    # Scaling the deployed profile is fine.
    assert store.deploy_model("m", profile="fast", replicas=4).replicas == 4


def test_put_model_with_and_without_profiles(store: Store) -> None:
    m = store.put_model(
        "m", engine="sim", params={"ttft_ms": 5}, replicas=1, profiles={"default": SIM_A}
    )
    assert (m.profiles, m.profile) == ({"default": SIM_A}, "default")
    # Replaced without profiles, it is a model outside the catalog again.
    assert store.put_model("m", engine="sim", params={}, replicas=1).profiles == {}
    with pytest.raises(ValueError, match="must include 'default'"):
        store.put_model("m", engine="sim", params={}, replicas=1, profiles={"fast": SIM_B})


def test_update_shard_gpus_and_dist_init_addr(
    store: Store, replica_with_shards: Callable[[], tuple[Replica, list[Shard]]]
) -> None:
    _, (s0, _) = replica_with_shards()
    got = store.update_shard(s0.id, gpus=["GPU-a", "GPU-b"], dist_init_addr="10.0.0.1:29500")
    assert (got.gpus, got.dist_init_addr) == (("GPU-a", "GPU-b"), "10.0.0.1:29500")
    assert store.update_shard(s0.id, gpus=()).gpus == ()
    with pytest.raises(ValueError, match="list of GPU uuids"):
        store.update_shard(s0.id, gpus="GPU-a")
    with pytest.raises(ValueError, match="list of GPU uuids"):
        store.update_shard(s0.id, gpus=[0, 1])
    with pytest.raises(ValueError, match="host:port string"):
        store.update_shard(s0.id, dist_init_addr=None)
    assert store.get_shard(s0.id).dist_init_addr == "10.0.0.1:29500"


def test_catalog_changes_roll_back_together(store: Store) -> None:
    store.put_catalog_model("a", {"default": SIM_A})
    store.deploy_model("a", profile="default", replicas=1)
    store.add_replica("a")
    with pytest.raises(Conflict), store.transaction():
        store.put_catalog_model("b", {"default": SIM_B})
        store.put_catalog_model("a", {"default": VLLM})
    assert [m.name for m in store.list_models()] == ["a"]
