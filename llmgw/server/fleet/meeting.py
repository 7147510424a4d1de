"""Where a multi-node replica's shards meet, as the store holds it: the address its shards
rendezvous at (rank 0's management address and a port from
:func:`llmgw.server.fleet.rendezvous.rendezvous_port`, the pure rule), and for an engine
whose rank 0 dials its workers (llama.cpp's RPC) each worker's endpoint and whether rank 0
still waits for them. A disaggregated pool's replica (one node) keeps its KV transfer's
address there instead (:func:`transfer_addr`): its port from the same range by the same rule,
so that no two replicas on a node share one. The scheduler's orders carry what this answers."""

from __future__ import annotations

from llmgw.contracts.disagg import split_pool
from llmgw.engines.launch import dials_workers
from llmgw.errors import ConfigError
from llmgw.netaddr import format_hostport, parse_hostport
from llmgw.server.fleet.rendezvous import NoPort, rendezvous_port
from llmgw.server.store import Shard, Store
from llmgw.server.store.states import ShardState

__all__ = [
    "NoPortError",
    "awaits_workers",
    "dist_init_addr",
    "endpoints",
    "host_of",
    "port_of",
    "transfer_addr",
]


class NoPortError(Exception):
    """The nodes placement chose share no free port in their ``multinode_ports``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def host_of(addr: str) -> str:
    try:
        return parse_hostport(addr, allow_zero=True)[0] if addr else ""
    except ConfigError:
        return ""


def port_of(addr: str) -> int:
    try:
        return parse_hostport(addr, allow_zero=True)[1] if addr else 0
    except ConfigError:
        return 0


def dist_init_addr(store: Store, node_ids: list[str]) -> str:
    """A multi-node replica's rendezvous: rank 0's management address and its port
    (:func:`_port`). Every shard row of a replica keeps it, so the ports taken on a node
    are those of the replicas it has shards of."""
    host = host_of(store.get_node(node_ids[0]).dataplane_addr or "") or "127.0.0.1"
    return format_hostport(host, _port(store, node_ids))


def _port(store: Store, node_ids: list[str]) -> int:
    """The replica's port (:func:`llmgw.server.fleet.rendezvous.rendezvous_port`): inside the
    ``multinode_ports`` of every node, free on all of them; :class:`NoPortError` with the
    reason when there is none."""
    nodes = set(node_ids)
    used = {
        port_of(sh.dist_init_addr)
        for node_id in nodes
        for sh in store.list_shards(node_id=node_id)
        if sh.dist_init_addr
    }
    inventories = {node_id: store.get_node(node_id).inventory for node_id in nodes}
    port = rendezvous_port(node_ids, inventories, used)
    if isinstance(port, NoPort):
        raise NoPortError(port.reason)
    return port


def transfer_addr(model: str, stored: str) -> str:
    """The KV transfer address of a replica of ``model`` whose shard row keeps ``stored``
    as its dist_init_addr: that, for a disaggregated pool's replica (the router's
    Endpoint.transfer_addr, the gateway's bootstrap host and port); '' for any other."""
    return stored if split_pool(model) is not None else ""


def awaits_workers(store: Store, shard: Shard, engine: str) -> bool:
    """Rank 0 of an engine that dials its workers waits for them: llama-server gives up
    on an ``--rpc`` endpoint that does not answer yet, so it starts only once every
    worker's endpoint is up (its shard ready)."""
    if shard.rank != 0 or not shard.dist_init_addr or not dials_workers(engine):
        return False
    return any(
        sh.rank > 0 and sh.state != ShardState.READY
        for sh in store.list_shards(replica_id=shard.replica_id)
    )


def endpoints(store: Store, shard: Shard, engine: str) -> tuple[list[str], str]:
    """``(worker_addrs, listen_addr)`` of a shard's StartShard: for an engine whose
    rank 0 dials its workers, rank 0 gets every worker's endpoint in rank order and a
    worker the one it binds, each its node's management address and the replica's
    port; empty for the others."""
    if not dials_workers(engine) or not shard.dist_init_addr:
        return [], ""
    port = port_of(shard.dist_init_addr)
    if not port:
        return [], ""  # the engine's builder refuses the shard, saying what is missing

    def endpoint(node_id: str) -> str:
        host = host_of(store.get_node(node_id).dataplane_addr or "") or "127.0.0.1"
        return format_hostport(host, port)

    if shard.rank > 0:
        return [], endpoint(shard.node_id)
    workers = sorted(
        (sh for sh in store.list_shards(replica_id=shard.replica_id) if sh.rank > 0),
        key=lambda sh: sh.rank,
    )
    return [endpoint(sh.node_id) for sh in workers], ""
