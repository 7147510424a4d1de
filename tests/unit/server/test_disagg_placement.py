"""Placing a disaggregated model's pools: both on one fabric (the first replica of the pair
where its sibling fits too), on one node without a fabric, the reason when no fabric has room
for both; each pool replica's KV transfer port inside its node's multinode_ports and distinct
there; StartShard with the role and the transfer address."""

from __future__ import annotations

from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.scheduler import Scheduler
from tests.unit.server.disagg_rig import deploy as _deploy
from tests.unit.server.disagg_rig import join as _join
from tests.unit.server.disagg_rig import nodes_of as _nodes
from tests.unit.server.scheduler_rig import SchedulerRig


def _starts(cp: SchedulerRig) -> list[pb.StartShard]:
    out = []
    for session in cp.sessions.values():
        while not session.queue.empty():
            msg = session.queue.get_nowait()
            if msg is not None and msg.WhichOneof("msg") == "start_shard":
                out.append(msg.start_shard)
    return sorted(out, key=lambda o: o.model)


def _reconcile(cp: SchedulerRig) -> Scheduler:
    scheduler = cp.scheduler()
    scheduler.reconcile()
    return scheduler


def test_both_pools_go_to_the_fabric_with_room_for_both(cp: SchedulerRig) -> None:
    # Bin-packing alone would put the prefill on n1, whose fabric has no room for a decode.
    _join(cp, "n1", 1, "ib-a")
    _join(cp, "n2", 1, "ib-b")
    _join(cp, "n3", 1, "ib-b")
    _deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = _reconcile(cp)
    assert sorted(_nodes(cp, "m#prefill") + _nodes(cp, "m#decode")) == ["n2", "n3"]
    assert scheduler.unplaceable == {}


def test_a_pool_replica_goes_where_it_shares_a_fabric_with_its_sibling(cp: SchedulerRig) -> None:
    # n2 (fewest free GPUs) is what bin-packing picks for the decode; it is on another fabric.
    _join(cp, "n1", 1, "ib-a")
    _join(cp, "n2", 1, "ib-b")
    _join(cp, "n3", 4, "ib-a")
    _deploy(cp, prefill=(1, 1), decode=(1, {"min": 2, "max": 4}))
    _reconcile(cp)
    placed = _nodes(cp, "m#prefill") + _nodes(cp, "m#decode")
    assert len(placed) == 3
    assert set(placed) == {"n1", "n3"}


def test_one_node_without_a_fabric_hosts_both_pools(cp: SchedulerRig) -> None:
    _join(cp, "n1", 2, None)
    _deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = _reconcile(cp)
    assert _nodes(cp, "m#prefill") + _nodes(cp, "m#decode") == ["n1", "n1"]
    # A second node without a fabric cannot take more of them: they would not reach n1.
    _join(cp, "n2", 2, None)
    cp.store.set_replicas("m#decode", 2)
    scheduler.reconcile()
    assert _nodes(cp, "m#decode") == ["n1"]
    reason = scheduler.unplaceable["m#decode"].reason
    assert reason.startswith(
        "no node that shares a fabric with the replicas of m's pools (on n1) has room: "
    )
    assert "n1: " in reason


def test_no_fabric_with_room_for_both_says_what_is_short(cp: SchedulerRig) -> None:
    _join(cp, "n1", 1, "ib-a")
    _join(cp, "n2", 1, "ib-b")
    _deploy(cp, prefill=(1, 1), decode=(1, 1))
    scheduler = _reconcile(cp)
    assert cp.store.list_shards() == []
    assert scheduler.unplaceable["m#prefill"].reason == (
        "no fabric with room for both pools of m (1 prefill x 1 GPU, 1 decode x 1 GPU): "
        "fabric ib-a: room for 1 of 1 prefill, 0 of 1 decode; "
        "fabric ib-b: room for 1 of 1 prefill, 0 of 1 decode; "
        "no node alone has room for both (n1: room for 1 of 1 prefill, 0 of 1 decode; "
        "n2: room for 1 of 1 prefill, 0 of 1 decode)"
    )
    assert scheduler.unplaceable["m#decode"].reason.startswith(
        "no fabric with room for both pools of m (1 decode x 1 GPU, 1 prefill x 1 GPU): "
    )


def test_a_pool_too_big_for_any_node_is_named(cp: SchedulerRig) -> None:
    _join(cp, "n1", 1, "ib-a")
    _deploy(cp, prefill=(2, 1), decode=(1, 1))
    scheduler = _reconcile(cp)
    reason = scheduler.unplaceable["m#prefill"].reason
    assert "fabric ib-a: room for 0 of 1 prefill, 1 of 1 decode" in reason
    assert "n1: room for 0 of 1 prefill, 1 of 1 decode" in reason


def test_no_node_for_either_pool_names_the_pools_own_reasons(cp: SchedulerRig) -> None:
    _join(cp, "n1", 0, "ib-a")
    _deploy(cp, prefill=(1, 1), decode=(0, 1))
    scheduler = _reconcile(cp)
    reason = scheduler.unplaceable["m#prefill"].reason
    assert "fabric ib-a: room for 0 of 1 prefill, 1 of 1 decode" in reason
    assert "no node takes both the prefill and the decode pool" in reason
    assert "prefill: n1: " in reason


def test_transfer_ports_are_inside_each_nodes_range_and_distinct(cp: SchedulerRig) -> None:
    _join(cp, "n1", 0, None, ports="31000-31001")
    _deploy(cp, prefill=(0, 1), decode=(0, 1))
    _reconcile(cp)
    addrs = sorted(shard.dist_init_addr for shard in cp.store.list_shards())
    assert addrs == ["10.0.0.1:31000", "10.0.0.1:31001"]
    starts = _starts(cp)
    # Both pools' engines answer to the model's name, which the gateway sends them.
    assert [(o.model, o.disagg_role) for o in starts] == [
        ("m", "decode"),
        ("m", "prefill"),
    ]
    by_shard = {s.id: s.dist_init_addr for s in cp.store.list_shards()}
    for order in starts:
        assert order.transfer_addr == by_shard[order.shard_id]
        assert order.dist_init_addr == ""  # a pool replica is one node: no rendezvous
        assert order.nodes == 1
    # The range spent: one more replica is refused, naming the node, its range and the fix.
    cp.store.set_replicas("m#decode", 2)
    scheduler = _reconcile(cp)
    assert len(cp.store.list_replicas("m#decode")) == 1
    reason = scheduler.unplaceable["m#decode"].reason
    assert reason.startswith("no KV transfer port: ")
    assert "31000-31001" in reason and "n1" in reason and "install-agent.sh" in reason


def test_ports_on_two_nodes_come_from_each_nodes_own_range(cp: SchedulerRig) -> None:
    _join(cp, "n1", 1, "ib-a", ports="32000-32099")
    _join(cp, "n2", 1, "ib-a", ports="33000-33099")
    _deploy(cp, prefill=(1, 1), decode=(1, 1))
    _reconcile(cp)
    addrs = {shard.node_id: shard.dist_init_addr for shard in cp.store.list_shards()}
    assert addrs == {"n1": "10.0.0.1:32000", "n2": "10.0.0.2:33000"}


def test_an_ordinary_replica_gets_no_role_or_transfer_address(cp: SchedulerRig) -> None:
    _join(cp, "n1", 1, None)
    cp.store.put_catalog_model("plain", {"default": {"engine": "sim", "gpus": 1}})
    cp.store.deploy_model("plain", profile="default", replicas=1)
    _reconcile(cp)
    (order,) = _starts(cp)
    assert (order.disagg_role, order.transfer_addr, order.dist_init_addr) == ("", "", "")
    (shard,) = cp.store.list_shards()
    assert shard.dist_init_addr == ""
