"""A disaggregated pool replica in the router: its Endpoint carries the KV transfer address
its shard row keeps (the gateway sends a decode the prefill's bootstrap host and port), as
the leader learns it from its agent and as a standby reads it from the database; any other
replica's is empty."""

from __future__ import annotations

import asyncio

from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.installs import EngineInstalls
from llmgw.server.fleet.reports import AgentReports
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.gateway.serving import ServingCache
from llmgw.server.ha.follower import RouteFollower
from llmgw.server.store import Store

POOL = {"engine": "sim", "gpus": 0, "role": "prefill"}


def _shards(store: Store) -> dict[str, str]:
    """A prefill pool's replica and an ordinary one on n1, their shards placed: model -> shard."""
    store.upsert_node(
        "n1", dataplane_addr="10.0.0.1:9443", agent_version="0.1.0", inventory={}, connected=True
    )
    store.set_node_state("n1", "approved")
    out = {}
    for model, profile in (("m#prefill", POOL), ("plain", {"engine": "sim", "gpus": 0})):
        store.put_catalog_model(model, {"default": profile})
        replica = store.add_replica(model)
        shard = store.add_shard(replica.id, "n1")
        if model == "m#prefill":
            store.update_shard(shard.id, dist_init_addr="10.0.0.1:29500")
        out[model] = shard.id
    return out


def test_the_leader_routes_a_pool_replica_with_its_transfer_address(store: Store) -> None:
    shards = _shards(store)
    router = Router()
    session = NodeSession(
        node_id="n1", dataplane_addr="10.0.0.1:9443", epoch=1, engines=frozenset({"sim"})
    )
    session.approved = True
    live = {"n1": session}
    reports = AgentReports(
        store,
        router,
        Scheduler(store, router, sessions=live, lost=set()),
        installs=EngineInstalls(store, sessions=live, epoch=1),
        renew=lambda session, csr: None,
        on_routes_changed=lambda: None,
    )
    for shard_id in shards.values():
        shard = store.get_shard(shard_id)
        status = pb.ShardStatus(
            shard_id=shard_id, replica_id=shard.replica_id, state=pb.SHARD_READY, port=9
        )
        reports.apply_status(session, status)
    (prefill,) = router.endpoints("m#prefill")
    assert prefill.transfer_addr == "10.0.0.1:29500"
    (plain,) = router.endpoints("plain")
    assert plain.transfer_addr == ""


def test_a_standby_reads_the_transfer_address_from_the_database(store: Store) -> None:
    shards = _shards(store)
    for shard_id in shards.values():
        store.update_shard(shard_id, state="ready")
        store.set_replica_state(store.get_shard(shard_id).replica_id, "ready")
    router = Router()

    async def sync() -> bool:  # the follower's loop wakes on what changed
        follower = RouteFollower(
            store, router, ServingCache(store, max_request_body=1 << 20), resync_interval=60
        )
        return follower.sync()

    assert asyncio.run(sync())
    assert {ep.model: ep.transfer_addr for ep in router.endpoints()} == {
        "m#prefill": "10.0.0.1:29500",
        "plain": "",
    }
