"""The scheduler's orders for multi-node replicas: the rendezvous address and, for engines
whose rank 0 dials its workers (llama.cpp), every worker's endpoint, as StartShard carries
them to the agents; and a desired engine that placement waits for until it is installed."""

from __future__ import annotations

from typing import cast

import pytest

from llmgw.engines.launch import build_command
from llmgw.engines.spec import EngineSpec
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet import scheduler as scheduler_module
from llmgw.server.fleet.installs import Build, EngineInstalls
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.gateway.routing import Router
from tests.unit.server.scheduler_rig import SchedulerRig


def _join(
    cp: SchedulerRig, node_id: str, host: str, fabric: str = "ib-a", ports: str | None = None
) -> None:
    """``node_id`` with one GPU on ``fabric``; ``ports``: the multinode_ports its agent
    reports (None: an agent that reports none, which counts as the default range)."""
    inventory: dict[str, object] = {
        "gpus": [{"uuid": f"GPU-{node_id}", "memory_total_mib": 81920}],
        "fabrics": [{"name": fabric, "hcas": ["mlx5_0"], "healthy": True}],
    }
    if ports is not None:
        inventory["multinode_ports"] = ports
    cp.join(
        node_id, inventory, dataplane_addr=f"{host}:9443", engines=frozenset({"sim", "llamacpp"})
    )


def _deploy(cp: SchedulerRig, name: str, engine: str, nodes: int, replicas: int = 1) -> None:
    profile = {"engine": engine, "gpus": 1, "nodes": nodes, "source": "/models/m.gguf"}
    cp.store.put_catalog_model(name, {"default": profile})
    cp.store.deploy_model(name, profile="default", replicas=replicas)


def _orders(cp: SchedulerRig) -> dict[str, pb.StartShard]:
    """The StartShard orders queued so far, by shard id (the latest of each)."""
    orders: dict[str, pb.StartShard] = {}
    for session in cp.sessions.values():
        while not session.queue.empty():
            msg = session.queue.get_nowait()
            assert msg is not None
            if msg.WhichOneof("msg") == "start_shard":
                orders[msg.start_shard.shard_id] = msg.start_shard
    return orders


def _reconcile_until_rank0(cp: SchedulerRig) -> None:
    """Place, let every worker report ready, and place again: rank 0's order goes out."""
    scheduler = cp.scheduler()
    scheduler.reconcile()
    for shard in cp.store.list_shards():
        if shard.rank > 0:
            cp.store.update_shard(shard.id, state="ready")
    scheduler.reconcile()


def _by_rank(orders: dict[str, pb.StartShard], model: str) -> list[pb.StartShard]:
    return sorted((o for o in orders.values() if o.model == model), key=lambda o: o.rank)


def test_llamacpp_rank0_dials_each_worker_on_its_node(cp: SchedulerRig) -> None:
    for i, node in enumerate(("n1", "n2", "n3")):
        _join(cp, node, f"10.0.0.{i + 1}")
    _deploy(cp, "big", "llamacpp", nodes=3)
    scheduler = cp.scheduler()
    scheduler.reconcile()

    # The workers are ordered first; rank 0 waits until both are ready (llama-server
    # gives up on an rpc-server that does not answer yet).
    first = _orders(cp)
    assert sorted(o.rank for o in first.values()) == [1, 2]
    w1, w2 = _by_rank(first, "big")
    cp.store.update_shard(w1.shard_id, state="ready")
    scheduler.reconcile()
    assert _orders(cp) == {}
    assert cp.store.get_shard(w1.shard_id.replace("-s1", "-s0")).state == "pending"
    cp.store.update_shard(w2.shard_id, state="ready")
    scheduler.reconcile()
    (rank0,) = _orders(cp).values()
    assert rank0.rank == 0
    assert [o.shard_id.rsplit("-", 1)[1] for o in (rank0, w1, w2)] == ["s0", "s1", "s2"]
    nodes = {s.id: s.node_id for s in cp.store.list_shards()}
    host = {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}
    # The lowest port of the nodes' multinode_ports (the default 29500-29999; not rpc-server's
    # own 50052, which no firewall opens), on every worker's own address, in rank order.
    assert list(rank0.worker_addrs) == [
        f"{host[nodes[w1.shard_id]]}:29500",
        f"{host[nodes[w2.shard_id]]}:29500",
    ]
    assert rank0.listen_addr == ""
    assert rank0.dist_init_addr == f"{host[nodes[rank0.shard_id]]}:29500"
    for worker, addr in zip((w1, w2), rank0.worker_addrs, strict=True):
        assert worker.listen_addr == addr
        assert list(worker.worker_addrs) == []
        assert (worker.nodes, worker.dist_init_addr) == (3, rank0.dist_init_addr)

    # What the agents build from these orders: llama-server --rpc and one rpc-server each.
    def built(order: pb.StartShard) -> list[str]:
        spec = EngineSpec(
            engine=order.engine,
            model=order.model,
            port=40000,
            source=order.source,
            nodes=order.nodes,
            rank=order.rank,
            dist_init_addr=order.dist_init_addr,
            peers=tuple(order.worker_addrs),
            listen_addr=order.listen_addr,
        )
        return build_command(spec).argv

    argv = built(rank0)
    assert argv[argv.index("--rpc") + 1] == ",".join(rank0.worker_addrs)
    for worker in (w1, w2):
        h, p = worker.listen_addr.rsplit(":", 1)
        assert built(worker) == ["rpc-server", "--host", h, "--port", p]


def test_worker_ports_are_free_on_every_node_of_the_replica(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1")
    _join(cp, "n2", "10.0.0.2")
    # Another replica, ranked 0 on n3, already has its worker's endpoint on n2 at 29500.
    cp.store.upsert_node(
        "n3", dataplane_addr="10.0.0.3:9443", agent_version="0.1.0", inventory={}, connected=False
    )
    _deploy(cp, "other", "llamacpp", nodes=2)
    other = cp.store.add_replica("other")
    for rank, node in ((0, "n3"), (1, "n2")):
        shard = cp.store.add_shard(other.id, node, rank=rank)
        cp.store.update_shard(shard.id, dist_init_addr="10.0.0.3:29500", state="ready")

    # A new replica ranked 0 on n1 (where 29500 is free) with its worker on n2: the port
    # must be free on n2 too.
    _deploy(cp, "big", "llamacpp", nodes=2)
    _reconcile_until_rank0(cp)
    rank0, worker = _by_rank(_orders(cp), "big")
    assert rank0.dist_init_addr == "10.0.0.1:29501"
    assert list(rank0.worker_addrs) == ["10.0.0.2:29501"]
    assert worker.listen_addr == "10.0.0.2:29501"


def test_a_port_taken_on_a_worker_node_is_skipped(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1")
    _join(cp, "n2", "10.0.0.2")
    # Give each node a second GPU, so that two two-node replicas fit on the same pair.
    for node in ("n1", "n2"):
        inventory = dict(cp.store.get_node(node).inventory)
        inventory["gpus"] = [
            {"uuid": f"GPU-{node}-{i}", "memory_total_mib": 81920} for i in range(2)
        ]
        cp.store.upsert_node(
            node,
            dataplane_addr=cp.store.get_node(node).dataplane_addr,
            agent_version="0.1.0",
            inventory=inventory,
            connected=True,
        )
    _deploy(cp, "big", "llamacpp", nodes=2, replicas=2)
    _reconcile_until_rank0(cp)
    orders = _orders(cp)
    ports = sorted(o.listen_addr.rsplit(":", 1)[1] for o in orders.values() if o.rank == 1)
    # Both workers bind on the pair's nodes; they never share a port on one node.
    assert ports == ["29500", "29501"]
    for order in orders.values():
        if order.rank == 0:
            assert order.dist_init_addr.rsplit(":", 1)[1] in ports
            assert len(order.worker_addrs) == 1


def test_single_node_and_sim_orders_carry_no_endpoints(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1")
    _deploy(cp, "one", "llamacpp", nodes=1)
    cp.scheduler().reconcile()
    (order,) = _orders(cp).values()
    assert (order.nodes, order.dist_init_addr, list(order.worker_addrs), order.listen_addr) == (
        1,
        "",
        [],
        "",
    )


def test_a_pending_node_gets_no_start_order_until_it_is_approved(cp: SchedulerRig) -> None:
    # A node purged and joined afresh under its old id comes back pending while the store still
    # holds a shard of it: nothing is ordered (its statuses would not be heard) until approval.
    _join(cp, "n1", "10.0.0.1")
    _deploy(cp, "m", "sim", nodes=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert len(_orders(cp)) == 1
    shard = cp.store.list_shards()[0]
    cp.store.update_shard(shard.id, state="pending", reason="not running on the node")
    session = cp.sessions["n1"]
    session.approved = False
    scheduler.reconcile()
    assert _orders(cp) == {}
    session.approved = True
    scheduler.reconcile()
    assert list(_orders(cp)) == [shard.id]


def test_a_desired_engine_is_placed_only_once_installed_and_checked(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1")
    installs = EngineInstalls(cp.store, sessions=cp.sessions, epoch=1)
    build = Build.checked("", "https://pub.example/llama.tgz", "c" * 64)
    installs.desire(engine="llamacpp", version="b7", builds=[build], node=None, actor="operator")
    install = _install_order(cp)
    _deploy(cp, "m", "llamacpp", nodes=1)
    scheduler = Scheduler(
        cp.store,
        cast(Router, cp.router),
        sessions=cp.sessions,
        lost=cp.lost,
        engine_holds=installs.holds,
    )
    scheduler.reconcile()
    assert cp.store.list_shards() == []
    assert scheduler.unplaceable["m"].reason == "n1: llamacpp b7 is being installed"
    result = pb.OperationResult(op_id=install.meta.op_id, ok=True)
    assert installs.on_result(cp.sessions["n1"], result)
    scheduler.reconcile()
    (shard,) = cp.store.list_shards()
    assert shard.node_id == "n1"


def _install_order(cp: SchedulerRig) -> pb.InstallEngine:
    session = cp.sessions["n1"]
    while not session.queue.empty():
        msg = session.queue.get_nowait()
        assert msg is not None
        if msg.WhichOneof("msg") == "install_engine":
            return msg.install_engine
    raise AssertionError("no install order was sent")


def test_the_scheduler_keeps_a_degraded_node_from_what_it_cannot_run(cp: SchedulerRig) -> None:
    # n1's llama.cpp will not run (its agent no longer offers it, and says why); n2's does.
    _join(cp, "n1", "10.0.0.1")
    broken = {
        "code": "engine",
        "engine": "llamacpp",
        "fabric": "",
        "message": "engine llamacpp (/opt/llama-server) will not run: libcudart.so.12",
    }
    inventory = {**cp.store.get_node("n1").inventory, "degraded": [broken]}
    cp.store.upsert_node(
        "n1",
        dataplane_addr="10.0.0.1:9443",
        agent_version="0.1.0",
        inventory=inventory,
        connected=True,
    )
    cp.sessions["n1"].engines = frozenset({"sim"})
    _deploy(cp, "gguf", "llamacpp", nodes=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert cp.store.list_shards() == []
    assert scheduler.unplaceable["gguf"].reason == f"n1: degraded: {broken['message']}"

    # sim still goes there.
    _deploy(cp, "s", "sim", nodes=1)
    scheduler.reconcile()
    assert [
        (s.node_id, cp.store.get_replica(s.replica_id).model) for s in cp.store.list_shards()
    ] == [("n1", "s")]

    # A healthy node with the engine joins: the model goes there, not to n1.
    _join(cp, "n2", "10.0.0.2")
    scheduler.reconcile()
    placed = {cp.store.get_replica(s.replica_id).model: s.node_id for s in cp.store.list_shards()}
    assert placed == {"s": "n1", "gguf": "n2"}
    assert "gguf" not in scheduler.unplaceable


def _degrade(cp: SchedulerRig, node_id: str, *reasons: dict[str, str]) -> None:
    node = cp.store.get_node(node_id)
    cp.store.upsert_node(
        node_id,
        dataplane_addr=node.dataplane_addr,
        agent_version="0.1.0",
        inventory={**node.inventory, "degraded": list(reasons)},
        connected=True,
    )


def test_a_shard_that_fails_where_it_can_no_longer_run_is_rebuilt_elsewhere(
    cp: SchedulerRig,
) -> None:
    _join(cp, "n1", "10.0.0.1")
    _deploy(cp, "m", "llamacpp", nodes=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    (shard,) = cp.store.list_shards()
    assert shard.node_id == "n1"
    # n1's llama.cpp breaks (a library removed under it): the engine dies, and the agent
    # reports the node degraded for llama.cpp.
    broken = {
        "code": "engine",
        "engine": "llamacpp",
        "fabric": "",
        "message": "engine llamacpp will not run: libcudart.so.12",
    }
    _degrade(cp, "n1", broken)
    cp.sessions["n1"].engines = frozenset({"sim"})
    _join(cp, "n2", "10.0.0.2")
    cp.store.update_shard(shard.id, state="failed", reason="exited with 127")
    scheduler.shard_failed(shard.id)
    scheduler.reconcile()
    assert cp.store.list_shards() == []  # removed, and the scheduler kicked
    scheduler.reconcile()
    # Not restarted on n1 (it would fail again): the replica is rebuilt on n2.
    assert [s.node_id for s in cp.store.list_shards()] == ["n2"]
    removed = [e.message for e in cp.store.list_events() if e.kind == "replica_removed"]
    assert removed == [
        f"shard {shard.id} failed on n1, which is degraded: {broken['message']}; "
        "rebuilding it elsewhere"
    ]


def test_a_shard_that_fails_where_it_still_can_run_is_restarted_there(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1")
    _deploy(cp, "m", "llamacpp", nodes=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    (shard,) = cp.store.list_shards()
    # n1 is degraded, but for vLLM only: its llama.cpp shard is restarted in place.
    _degrade(cp, "n1", {"code": "engine", "engine": "vllm", "fabric": "", "message": "vllm"})
    cp.store.update_shard(shard.id, state="failed", reason="exited with 1")
    scheduler.failed_at[shard.id] = 0.0  # its backoff is over
    scheduler.reconcile()
    (again,) = cp.store.list_shards()
    assert (again.id, again.node_id, again.restarts) == (shard.id, "n1", 1)


# -- the port: inside the multinode_ports of every node of the replica ----------------------


def _report_ports(cp: SchedulerRig, node_id: str, ports: str) -> None:
    """``node_id``'s agent reports ``ports`` (it restarted with another agent.yaml)."""
    node = cp.store.get_node(node_id)
    cp.store.upsert_node(
        node_id,
        dataplane_addr=node.dataplane_addr,
        agent_version="0.1.0",
        inventory={**node.inventory, "multinode_ports": ports},
        connected=True,
    )


@pytest.mark.parametrize("engine", ["sim", "llamacpp"])
def test_the_port_is_the_lowest_in_every_nodes_range(cp: SchedulerRig, engine: str) -> None:
    _join(cp, "n1", "10.0.0.1", ports="30000-30100")
    _join(cp, "n2", "10.0.0.2", ports="30050-30200")
    _deploy(cp, "big", engine, nodes=2)
    _reconcile_until_rank0(cp)
    rank0, worker = _by_rank(_orders(cp), "big")
    host = {s.rank: s.node_id for s in cp.store.list_shards()}
    addr = {"n1": "10.0.0.1", "n2": "10.0.0.2"}
    assert rank0.dist_init_addr == worker.dist_init_addr == f"{addr[host[0]]}:30050"
    if engine == "llamacpp":  # the worker binds it on its own node, rank 0 dials it there
        assert worker.listen_addr == f"{addr[host[1]]}:30050"
        assert list(rank0.worker_addrs) == [worker.listen_addr]
    else:  # the worker dials rank 0: no endpoint of its own
        assert (worker.listen_addr, list(rank0.worker_addrs)) == ("", [])


def test_an_agent_that_reports_no_range_counts_as_the_default(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1")  # predates multinode_ports: 29500-29999
    _join(cp, "n2", "10.0.0.2", ports="29990-30010")
    _deploy(cp, "big", "sim", nodes=2)
    cp.scheduler().reconcile()
    (port,) = {s.dist_init_addr.rsplit(":", 1)[1] for s in cp.store.list_shards()}
    assert port == "29990"


def test_ports_used_by_other_replicas_are_skipped_within_the_range(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1", ports="31000-31002")
    _join(cp, "n2", "10.0.0.2", ports="31000-31002")
    cp.store.upsert_node(
        "n3", dataplane_addr="10.0.0.3:9443", agent_version="0.1.0", inventory={}, connected=False
    )
    _deploy(cp, "other", "sim", nodes=2)
    other = cp.store.add_replica("other")
    # 31000 on n1 (another replica's rank 0 there), 31001 on n2 (a worker of one on n3).
    for node, addr in (("n1", "10.0.0.1:31000"), ("n2", "10.0.0.3:31001")):
        shard = cp.store.add_shard(other.id, node, rank=0 if node == "n1" else 1)
        cp.store.update_shard(shard.id, dist_init_addr=addr, state="ready")
    _deploy(cp, "big", "sim", nodes=2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    big = [s for s in cp.store.list_shards() if s.replica_id != other.id]
    assert {s.dist_init_addr.rsplit(":", 1)[1] for s in big} == {"31002"}
    assert "big" not in scheduler.unplaceable


def _unplaced(cp: SchedulerRig, scheduler: Scheduler, model: str) -> str:
    """The unplaceable reason of ``model``, having checked that nothing of the attempt was
    left behind: no replica, no shard, no order."""
    assert cp.store.list_replicas(model) == []
    assert [s for s in cp.store.list_shards() if s.replica_id.startswith(f"{model}-")] == []
    assert all(o.model != model for o in _orders(cp).values())
    (event,) = [e for e in cp.store.list_events(subject=model) if e.kind == "unplaceable"]
    reason = scheduler.unplaceable[model].reason
    assert event.message == f"cannot place a replica: {reason}"
    return reason


def test_nodes_whose_ranges_do_not_overlap_get_no_replica(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1", ports="30000-30099")
    _join(cp, "n2", "10.0.0.2", ports="31000-31099")
    _deploy(cp, "big", "llamacpp", nodes=2)
    # A single-node model after it: the GPUs the failed attempt had chosen are free again.
    _deploy(cp, "small", "sim", nodes=1, replicas=2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert _unplaced(cp, scheduler, "big") in (
        f"its nodes share no multi-node port: their multinode_ports do not overlap ({a} "
        f"{ra}, {b} {rb}); widen multinode_ports in agent.yaml on {a}, {b} so that they "
        "overlap, and re-run install-agent.sh there so that the firewall follows"
        for (a, ra), (b, rb) in [
            (("n1", "30000-30099"), ("n2", "31000-31099")),
            (("n2", "31000-31099"), ("n1", "30000-30099")),
        ]
    )
    assert sorted(s.node_id for s in cp.store.list_shards()) == ["n1", "n2"]
    assert {cp.store.get_replica(s.replica_id).model for s in cp.store.list_shards()} == {"small"}

    # The operator widens n2's range (and re-runs the installer): placed on the next pass.
    cp.store.delete_model("small")
    _report_ports(cp, "n2", "30050-31099")
    scheduler.reconcile()
    assert "big" not in scheduler.unplaceable
    (port,) = {s.dist_init_addr.rsplit(":", 1)[1] for s in cp.store.list_shards()}
    assert port == "30050"


def test_a_full_shared_range_gets_no_replica(cp: SchedulerRig) -> None:
    for node, host in (("n1", "10.0.0.1"), ("n2", "10.0.0.2")):
        _join(cp, node, host, ports="32000-32000")
        inventory = dict(cp.store.get_node(node).inventory)
        inventory["gpus"] = [
            {"uuid": f"GPU-{node}-{i}", "memory_total_mib": 81920} for i in range(2)
        ]
        cp.store.upsert_node(
            node,
            dataplane_addr=f"{host}:9443",
            agent_version="0.1.0",
            inventory=inventory,
            connected=True,
        )
    # Room on the GPUs for two replicas, but a port for one only.
    _deploy(cp, "big", "sim", nodes=2, replicas=2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    (replica,) = cp.store.list_replicas("big")
    shards = cp.store.list_shards()
    assert len(shards) == 2 and {s.replica_id for s in shards} == {replica.id}
    assert {s.dist_init_addr.rsplit(":", 1)[1] for s in shards} == {"32000"}
    reason = scheduler.unplaceable["big"].reason
    nodes = ", ".join(s.node_id for s in sorted(shards, key=lambda s: s.rank))
    named = ", ".join(f"{s.node_id} 32000-32000" for s in sorted(shards, key=lambda s: s.rank))
    assert reason == (
        "every multi-node port its nodes share is taken by other multi-node replicas on them "
        f"(32000-32000: 1 port; {named}); widen multinode_ports in agent.yaml on {nodes}, and "
        "re-run install-agent.sh there so that the firewall follows"
    )
    (event,) = [e for e in cp.store.list_events(subject="big") if e.kind == "unplaceable"]
    assert event.message == f"cannot place a replica: {reason}"
    assert len(_orders(cp)) == 2  # the placed replica's two shards, nothing of the other


def test_a_range_no_agent_would_report_keeps_the_replica_off(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1")
    _join(cp, "n2", "10.0.0.2", ports="30000")
    _deploy(cp, "big", "sim", nodes=2)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    assert _unplaced(cp, scheduler, "big") == (
        "node n2 reports multinode_ports '30000' is not a port range; write two port numbers "
        "joined by '-', e.g. 29500-29999 (one port: 29500-29500); fix multinode_ports in "
        "agent.yaml on n2, restart its agent, and re-run install-agent.sh there so that the "
        "firewall follows"
    )


def test_single_node_replicas_take_no_port_whatever_the_range(cp: SchedulerRig) -> None:
    _join(cp, "n1", "10.0.0.1", ports="30000")  # unreadable: only multi-node replicas care
    _deploy(cp, "one", "sim", nodes=1)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    (shard,) = cp.store.list_shards()
    assert shard.dist_init_addr == "" and "one" not in scheduler.unplaceable


def test_a_pass_places_for_its_time_budget_and_the_next_one_goes_on(
    cp: SchedulerRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(6):
        _join(cp, f"n{i}", f"10.0.0.{i + 1}")
    cp.store.put_model("m", engine="sim", params={}, replicas=5)
    scheduler = cp.scheduler()
    monkeypatch.setattr(scheduler_module, "PASS_BUDGET", 0.0)  # spent by the first placement
    counts = []
    for _ in range(5):
        scheduler.reconcile()
        counts.append((len(cp.store.list_replicas("m")), scheduler.unfinished))
    # One a pass, each pass saying more is left, until the last one placed.
    assert counts == [(1, True), (2, True), (3, True), (4, True), (5, False)]
    assert "m" not in scheduler.unplaceable
    monkeypatch.setattr(scheduler_module, "PASS_BUDGET", 60.0)
    cp.store.put_model("m", engine="sim", params={}, replicas=6)
    scheduler.reconcile()
    assert len(cp.store.list_replicas("m")) == 6 and not scheduler.unfinished


def test_a_steady_pass_reads_no_replica_or_shard_lists(cp: SchedulerRig) -> None:
    for i in range(3):
        _join(cp, f"n{i}", f"10.0.0.{i + 1}")
    cp.store.put_model("m", engine="sim", params={}, replicas=3)
    scheduler = cp.scheduler()
    scheduler.reconcile()
    for shard in cp.store.list_shards():
        cp.store.update_shard(shard.id, state="ready")
    calls: list[str] = []
    for name in ("list_replicas", "list_nodes"):
        real = getattr(cp.store, name)

        def spy(*args: object, _name: str = name, _real: object = real, **kw: object) -> object:
            calls.append(_name)
            return _real(*args, **kw)  # type: ignore[operator]

        setattr(cp.store, name, spy)
    scheduler.reconcile()
    assert calls == []  # counts only: nothing to place, move or restart
    cp.store.put_model("m", engine="sim", params={}, replicas=2)
    scheduler.reconcile()
    assert "list_replicas" in calls  # a count that differs reads the model's replicas


def test_a_pass_that_goes_on_keeps_its_view_until_a_node_comes_or_goes(
    cp: SchedulerRig, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(6):
        _join(cp, f"n{i}", f"10.0.0.{i + 1}")
    cp.store.put_model(
        "m", engine="sim", params={}, replicas=4, profiles={"default": {"engine": "sim", "gpus": 1}}
    )
    scheduler = cp.scheduler()
    monkeypatch.setattr(scheduler_module, "PASS_BUDGET", 0.0)
    built = []
    real = scheduler._cluster

    def counting() -> object:
        built.append(1)
        return real()

    monkeypatch.setattr(scheduler, "_cluster", counting)
    scheduler.reconcile()
    scheduler.reconcile()
    assert len(built) == 1  # the second pass went on with the first one's view
    del cp.sessions["n5"]  # a node went away: the view is built again
    scheduler.reconcile()
    assert len(built) == 2
    scheduler.reconcile()
    assert len(cp.store.list_replicas("m")) == 4 and not scheduler.unfinished
    # The carried view held each placement: no GPU was given twice.
    gpus = [g for s in cp.store.list_shards() for g in s.gpus]
    assert len(gpus) == len(set(gpus)) == 4


def test_refusals_on_a_node_are_placements_own_lines_for_it(cp: SchedulerRig) -> None:
    """What the console's node page shows: per model waiting for room, the node's own line
    of the refusal placement gives now; nothing for a model that has room."""
    _join(cp, "n1", "10.0.0.1")
    _join(cp, "n2", "10.0.0.2")
    scheduler = cp.scheduler()
    assert scheduler.refusals_on("n1") == []  # nothing waits
    cp.store.put_catalog_model("two", {"default": {"engine": "sim", "gpus": 2}})
    cp.store.deploy_model("two", profile="default", replicas=1)
    cp.store.put_catalog_model("one", {"default": {"engine": "sim", "gpus": 1}})
    cp.store.deploy_model("one", profile="default", replicas=1)
    scheduler.reconcile()
    assert set(scheduler.unplaceable) == {"two"}
    # n1 holds "one" on its only GPU; n2's GPU is free.
    assert scheduler.refusals_on("n1") == [("two", "0 of 1 GPUs free, needs 2")]
    assert scheduler.refusals_on("n2") == [("two", "1 of 1 GPUs free, needs 2")]
    assert scheduler.refusals_on("nobody") == []
    # Room appears (a bigger node): the model is no longer said to be refused anywhere.
    cp.store.upsert_node(
        "n1",
        dataplane_addr="10.0.0.1:9443",
        agent_version="0.1.0",
        inventory={"gpus": [{"uuid": f"GPU-n1-{i}", "memory_total_mib": 81920} for i in range(3)]},
        connected=True,
    )
    assert scheduler.refusals_on("n1") == []
    assert scheduler.refusals_on("n2") == []
    assert set(scheduler.unplaceable) == {"two"}  # read only: the next pass places it
    assert cp.store.list_replicas("two") == []


@pytest.mark.parametrize(("routing", "expected"), [("kv-events", True), (None, False)])
def test_a_kv_events_profile_orders_its_shards_to_forward_events(
    cp: SchedulerRig, routing: str | None, expected: bool
) -> None:
    """Only a profile that routes on KV events asks the agent to subscribe to them."""
    _join(cp, "n1", "10.0.0.1")
    profile: dict[str, object] = {"engine": "sim", "gpus": 1, "source": "/models/m.gguf"}
    if routing is not None:
        profile["routing"] = routing
    cp.store.put_catalog_model("kv", {"default": profile})
    cp.store.deploy_model("kv", profile="default", replicas=1)
    cp.scheduler().reconcile()
    (order,) = _orders(cp).values()
    assert order.kv_events is expected
