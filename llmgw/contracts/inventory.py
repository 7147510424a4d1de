"""A node's inventory (``pb.Inventory``, which the agent collects and sends) as the control
plane stores and shows it: JSON-ready data, every field by its proto name; the reasons a
node is degraded (:class:`DegradedCode`), which the agent gives and placement reads; and the
bounds of the GPUs' utilisation a heartbeat carries, which the agent keeps to and the control
plane enforces.

The agent's collection of it stays in ``llmgw.agent.inventory``; the control plane stores
this form in its ``nodes`` table and placement and ``llmgw ctl`` read it back.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.contracts.model_sources import sources_dict
from llmgw.contracts.ports import DEFAULT_MULTINODE_PORTS, PortRange
from llmgw.proto import control_pb2 as pb

__all__ = [
    "MAX_GPU_UUID",
    "MAX_HEARTBEAT_GPUS",
    "NOT_STORED",
    "DegradedCode",
    "DegradedReason",
    "degraded_reasons",
    "inventory_dict",
    "multinode_ports",
]


MAX_HEARTBEAT_GPUS = 64
"""GPUs whose utilisation one heartbeat carries (and the control plane keeps): more than any
board has (8 or 16); the agent sends no more, so that its heartbeat stays under the
control plane's size limit for it (llmgw.server.fleet.intake.KIND_LIMITS)."""
MAX_GPU_UUID = 64
"""Characters of a GPU uuid in a heartbeat (NVIDIA's are 40: GPU-8-4-4-4-12); a longer one is
no uuid of NVIDIA's, left out by both ends."""

NOT_STORED = frozenset({"Gpu.utilization_percent"})
"""Fields (``Message.field``) the stored form leaves out: a GPU's utilisation changes every
second, so what an inventory carried of it is old by the time it is read; the heartbeat
carries it to the node's session, and the admin API shows it from there."""


class DegradedCode(enum.StrEnum):
    """What a degraded node cannot do (a ``pb.DegradedReason``'s ``code``), and so what
    placement keeps off it."""

    GPUS = "gpus"
    """It declares GPUs (agent.yaml names nvidia-smi, or NVIDIA GPUs are on its PCI bus) but
    none is usable (no driver, driver/library mismatch, none visible): no GPU work."""
    ENGINE = "engine"
    """An engine it has (configured, on PATH or installed) will not run: not that engine."""
    FABRIC = "fabric"
    """A fabric it is stated to be on is down: no multi-node replica over that fabric."""
    DOCKER = "docker"
    """Its runtime is docker and the daemon cannot be reached: nothing at all (every shard
    is a container)."""


@dataclass(frozen=True)
class DegradedReason:
    """One reason a node is degraded: ``engine`` or ``fabric`` names what it is about for
    those codes; ``message`` says what is wrong and what to install or fix. An unknown
    ``code`` (from a newer agent) is kept as it came: shown, but blocking nothing."""

    code: str
    message: str
    engine: str = ""
    fabric: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DegradedReason:
        return cls(
            code=str(data.get("code") or ""),
            message=str(data.get("message") or ""),
            engine=str(data.get("engine") or ""),
            fabric=str(data.get("fabric") or ""),
        )

    def as_dict(self) -> dict[str, str]:
        return {
            "code": self.code,
            "message": self.message,
            "engine": self.engine,
            "fabric": self.fabric,
        }


def degraded_reasons(inventory: Mapping[str, Any]) -> tuple[DegradedReason, ...]:
    """The reasons in a stored inventory (:func:`inventory_dict`'s form); () for a healthy
    node, and for one whose agent predates them."""
    raw = inventory.get("degraded")
    if not isinstance(raw, Iterable) or isinstance(raw, str | bytes | Mapping):
        return ()
    return tuple(DegradedReason.from_dict(r) for r in raw if isinstance(r, Mapping))


def multinode_ports(inventory: Mapping[str, Any]) -> PortRange:
    """The node's multi-node port range from a stored inventory: the default
    (:data:`~llmgw.contracts.ports.DEFAULT_MULTINODE_PORTS`) for an agent that reports none
    (it predates the field, and so uses the ports of the default); ConfigError when what it
    reports is no range (no agent of ours sends that: its agent.yaml is checked)."""
    raw = inventory.get("multinode_ports")
    if not raw:
        return DEFAULT_MULTINODE_PORTS
    return PortRange.parse(str(raw))


def inventory_dict(inv: pb.Inventory) -> dict[str, Any]:
    """The inventory as JSON-ready data, every field by its proto name but those of
    :data:`NOT_STORED` (what the control plane stores and shows)."""
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
                # Only when unhealthy: a healthy GPU's stored form is as it always was.
                **({"health": g.health} if g.health else {}),
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
        "degraded": [
            DegradedReason(d.code, d.message, d.engine, d.fabric).as_dict() for d in inv.degraded
        ],
        # "": an agent that predates it (multinode_ports() reads that as the default).
        "multinode_ports": inv.multinode_ports,
        # The sources kept in the node's page cache (llmgw.agent.warming); [] when none.
        "warm": [
            {
                "source": w.source,
                "state": w.state,
                "reason": w.reason,
                "bytes": w.bytes,
                "pass_seconds": round(w.pass_seconds, 3),
                "last_pass_at": w.last_pass_at,
            }
            for w in inv.warm
        ],
    }
