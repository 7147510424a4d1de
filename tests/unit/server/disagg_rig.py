"""A disaggregated model on the scheduler rig: nodes joined with their GPUs, fabric and
port range, model ``m`` deployed with its two pools, and where each pool's replicas run."""

from __future__ import annotations

from typing import Any

from llmgw.server.admin.pools import sync_pools
from tests.unit.server.scheduler_rig import SchedulerRig

GIB = 1 << 30


def join(
    cp: SchedulerRig,
    node_id: str,
    gpus: int,
    fabric: str | None,
    ports: str | None = None,
    **more: Any,
) -> None:
    """``node_id`` (``nN``, its address 10.0.0.N) with ``gpus`` GPUs of 80 GiB, on
    ``fabric`` (None: none), with ``ports`` as its multinode_ports and ``more`` inventory."""
    number = int(node_id.lstrip("n"))
    inventory: dict[str, Any] = {
        "gpus": [
            {"uuid": f"GPU-{node_id}-{i}", "index": i, "memory_total_mib": 81920}
            for i in range(gpus)
        ],
        "fabrics": [{"name": fabric, "hcas": ["mlx5_0"], "healthy": True}] if fabric else [],
        **more,
    }
    if ports is not None:
        inventory["multinode_ports"] = ports
    cp.join(node_id, inventory, dataplane_addr=f"10.0.0.{number}:9443", engines=frozenset({"sim"}))


def deploy(
    cp: SchedulerRig, prefill: tuple[int, Any], decode: tuple[int, Any], **more: Any
) -> None:
    """Model m deployed disaggregated: each pool's (GPUs, replicas); ``more`` in the
    profile."""
    profile = {
        "engine": "sim",
        "gpus": 1,
        "disaggregated": {
            "prefill": {"gpus": prefill[0], "replicas": prefill[1]},
            "decode": {"gpus": decode[0], "replicas": decode[1]},
        },
        **more,
    }
    cp.store.put_catalog_model("m", {"pd": profile})
    model = cp.store.deploy_model("m", profile="pd", replicas=0)
    with cp.store.transaction():
        sync_pools(cp.store, model, lambda replica_id, why: None)


def nodes_of(cp: SchedulerRig, pool: str) -> list[str]:
    """The nodes ``pool``'s replicas run on (one per shard), sorted."""
    return sorted(
        shard.node_id
        for replica in cp.store.list_replicas(pool)
        for shard in cp.store.list_shards(replica_id=replica.id)
    )
