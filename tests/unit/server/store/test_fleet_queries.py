"""What a fleet's control plane asks the store on its hot paths, answered without reading
every row: counts, the draining nodes, the shards that need work, each node's newest
certificate in one query, and the parsed inventories kept while they are unchanged. On
both engines, against the plain listings they replace."""

from __future__ import annotations

from collections.abc import Callable

from llmgw.server.store import Node, Store
from llmgw.server.store.states import ShardState


def test_counts_and_draining_nodes_match_the_full_listings(
    store: Store, make_node: Callable[..., Node]
) -> None:
    for name in ("c", "a", "d", "b"):
        make_node(name)
    assert store.count_nodes() == 4 == len(store.list_nodes())
    assert store.list_draining_nodes() == []
    store.set_node_draining("d", True)
    store.set_node_draining("b", True)
    draining = store.list_draining_nodes()
    assert [n.id for n in draining] == ["b", "d"]  # by id, as list_nodes is
    assert draining == [n for n in store.list_nodes() if n.draining]
    store.set_node_draining("d", False)
    assert [n.id for n in store.list_draining_nodes()] == ["b"]
    store.delete_node("c")
    assert store.count_nodes() == 3


def test_replica_counts_stale_profiles_and_shards_by_state(
    store: Store, make_node: Callable[..., Node]
) -> None:
    make_node("gpu1")
    assert store.count_replicas() == {}
    store.put_model("a", engine="sim", params={}, replicas=2)
    store.put_model("b", engine="sim", params={}, replicas=1)
    store.put_model("idle", engine="sim", params={}, replicas=0)
    reps = [store.add_replica("a"), store.add_replica("a"), store.add_replica("b")]
    shards = [store.add_shard(r.id, "gpu1") for r in reps]
    assert store.count_replicas() == {"a": 2, "b": 1}
    assert store.models_with_stale_replicas() == set()
    store.deploy_model("a", profile="default", replicas=2)
    assert store.models_with_stale_replicas() == set()
    store.update_shard(shards[0].id, state=ShardState.FAILED)
    store.update_shard(shards[2].id, state=ShardState.READY)
    every = store.list_shards()
    for states in (
        (ShardState.FAILED, ShardState.PENDING),
        (ShardState.READY,),
        (ShardState.FAILED,),
    ):
        assert store.list_shards(states=states) == [s for s in every if s.state in states]
    assert store.list_shards(states=()) == []
    assert [s.id for s in store.list_shards(states=(ShardState.PENDING,))] == [shards[1].id]


def test_a_replica_of_another_profile_is_stale(
    store: Store, make_node: Callable[..., Node]
) -> None:
    make_node("gpu1")
    store.put_model(
        "m",
        engine="sim",
        params={},
        replicas=1,
        profiles={"default": {"engine": "sim"}, "big": {"engine": "sim"}},
    )
    store.deploy_model("m", profile="default", replicas=1)
    rep = store.add_replica("m")
    assert store.models_with_stale_replicas() == set()
    store.deploy_model("m", profile="big", replicas=1)
    assert store.models_with_stale_replicas() == {"m"}
    store.delete_replica(rep.id)
    assert store.models_with_stale_replicas() == set()


def test_the_newest_certificate_of_every_node_in_one_query(
    store: Store, make_node: Callable[..., Node]
) -> None:
    make_node("gpu1")
    make_node("gpu2")
    make_node("gpu3")
    for serial, node in (("0a", "gpu1"), ("0b", "gpu1"), ("0c", "gpu2"), ("0d", "gpu3")):
        store.add_certificate(
            serial, node_id=node, fingerprint=f"sha256:{serial}", not_before=0, not_after=9e9
        )
    store.revoke_certificates("gpu3", reason="test")
    latest = store.latest_certificates()
    assert {node: c.serial for node, c in latest.items()} == {"gpu1": "b", "gpu2": "c"}
    for node in ("gpu1", "gpu2", "gpu3"):
        assert latest.get(node) == store.latest_certificate(node)


def test_an_unchanged_inventory_is_parsed_once_and_a_changed_one_again(
    store: Store, make_node: Callable[..., Node]
) -> None:
    make_node("gpu1", inventory={"gpus": [{"uuid": "GPU-1"}]})
    first = store.list_nodes()[0].inventory
    assert store.list_nodes()[0].inventory is first  # shared while the text is the same
    assert store.get_node("gpu1").inventory is first
    store.set_node_draining("gpu1", True)  # another column: the inventory stays parsed
    assert store.list_draining_nodes()[0].inventory is first
    make_node("gpu1", inventory={"gpus": [{"uuid": "GPU-2"}]})
    again = store.list_nodes()[0].inventory
    assert again is not first and again == {"gpus": [{"uuid": "GPU-2"}]}
