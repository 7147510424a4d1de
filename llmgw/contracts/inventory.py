"""A node's inventory (``pb.Inventory``, which the agent collects and sends) as the control
plane stores and shows it: JSON-ready data, every field by its proto name.

The agent's collection of it stays in ``llmgw.agent.inventory``; the control plane stores
this form in its ``nodes`` table and placement and ``llmgw ctl`` read it back.
"""

from __future__ import annotations

from typing import Any

from llmgw.contracts.model_sources import sources_dict
from llmgw.proto import control_pb2 as pb

__all__ = ["inventory_dict"]


def inventory_dict(inv: pb.Inventory) -> dict[str, Any]:
    """The inventory as JSON-ready data, every field by its proto name (what the control
    plane stores and shows)."""
    return {
        "hostname": inv.hostname,
        "arch": inv.arch,
        "cpus": inv.cpus,
        "memory_total_bytes": inv.memory_total_bytes,
        "memory_available_bytes": inv.memory_available_bytes,
        "disk_total_bytes": inv.disk_total_bytes,
        "disk_free_bytes": inv.disk_free_bytes,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_total_mib": g.memory_total_mib,
                "memory_used_mib": g.memory_used_mib,
            }
            for g in inv.gpus
        ],
        "gpu_status": inv.gpu_status,
        "driver_version": inv.driver_version,
        "gpu_source": inv.gpu_source,
        "engines": list(inv.engines),
        "engine_details": [
            {"name": e.name, "path": e.path, "version": e.version, "ok": e.ok, "problem": e.problem}
            for e in inv.engine_details
        ],
        "ib_adapters": [
            {
                "name": a.name,
                "ports": [
                    {
                        "port": p.port,
                        "state": p.state,
                        "link_layer": p.link_layer,
                        "rate": p.rate,
                        "gids": list(p.gids),
                    }
                    for p in a.ports
                ],
            }
            for a in inv.ib_adapters
        ],
        "fabrics": [
            {"name": f.name, "hcas": list(f.hcas), "healthy": f.healthy} for f in inv.fabrics
        ],
        "warnings": list(inv.warnings),
        # None: an agent that predates model sources (placement does not filter it).
        "sources": sources_dict(inv.sources) if inv.HasField("sources") else None,
    }
