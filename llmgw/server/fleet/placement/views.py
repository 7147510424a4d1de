"""What placement is given and what it answers: the nodes and allocations as it sees them, the
profile of a replica, a placement, and the two rules a node's own report sets (the engines it
offers, what its degraded reasons keep it from)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from llmgw.contracts.inventory import DegradedCode, DegradedReason
from llmgw.contracts.model_sources import NodeSources, SourceSpec

__all__ = [
    "STRATEGIES",
    "Allocation",
    "GpuView",
    "NodeView",
    "Placement",
    "Profile",
    "ShardPlacement",
    "degraded_refusal",
    "offered_engines",
]

STRATEGIES = ("binpack", "spread")


@dataclass(frozen=True)
class GpuView:
    uuid: str
    memory_total_mib: int
    index: int = -1
    # Why placement may not use it ("cordoned", "unhealthy: XID 79"); "" when it may. Its
    # node keeps its other GPUs (llmgw.server.fleet.gpuhealth).
    blocked: str = ""

    def blocked_text(self) -> str:
        """``GPU 3 cordoned``: the blocked GPU as a refusal names it."""
        name = f"GPU {self.index}" if self.index >= 0 else f"GPU {self.uuid}"
        return f"{name} {self.blocked}"


@dataclass(frozen=True)
class NodeView:
    """One node as placement sees it; built from the store's row and its inventory."""

    id: str
    approved: bool
    connected: bool
    draining: bool
    lost: bool
    engines: frozenset[str]
    gpus: tuple[GpuView, ...]
    fabrics: tuple[str, ...]  # healthy fabrics only; () when the node is on none
    mgmt_addr: str = ""
    # The node's approval state as operators see it (pending, revoked), for reasons.
    state: str = ""
    # Engines held back from this node, each with why: a desired build not yet installed
    # and checked there (llmgw.server.fleet.installs).
    held_engines: tuple[tuple[str, str], ...] = ()
    # The model sources it reported; None when its agent reports none (not filtered).
    sources: NodeSources | None = None
    # Why the node is degraded, as its agent reported (llmgw.contracts.inventory).
    degraded: tuple[DegradedReason, ...] = ()
    # Its memory (MiB), as its agent reported; 0: unknown (a profile's host_memory is then
    # not checked on it).
    host_total_mib: int = 0


def offered_engines(view: NodeView) -> frozenset[str]:
    """The engines a node may be given replicas of: those it offers, less those held back."""
    if not view.held_engines:
        return view.engines
    return view.engines - {engine for engine, _why in view.held_engines}


@dataclass(frozen=True)
class Profile:
    """What one replica needs: ``nodes`` shards of ``gpus`` GPUs each running ``engine``;
    ``gpu_memory_mib`` > 0 admits only GPUs at least that large (ignored when ``gpus == 0``);
    ``host_memory_mib`` > 0 admits only nodes with that much memory that neither their
    sleepers nor their replicas' own ``host_memory`` hold (0: not checked)."""

    engine: str
    gpus: int
    nodes: int = 1
    gpu_memory_mib: int = 0
    # The weights every shard's node must have under its models_root, or may fetch.
    source: SourceSpec | None = None
    host_memory_mib: int = 0

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise ValueError(f"a profile needs 0 or more GPUs per shard, not {self.gpus}")
        if self.nodes < 1:
            raise ValueError(f"a profile needs 1 or more nodes per replica, not {self.nodes}")
        if self.gpu_memory_mib < 0:
            raise ValueError(f"gpu_memory_mib must be 0 or more, not {self.gpu_memory_mib}")
        if self.host_memory_mib < 0:
            raise ValueError(f"host_memory_mib must be 0 or more, not {self.host_memory_mib}")


@dataclass(frozen=True)
class Allocation:
    """One shard already placed: the GPUs it holds on its node."""

    replica_id: str
    shard_id: str
    node_id: str
    gpus: tuple[str, ...]
    gpu_memory_mib: int = 0
    # The host memory its profile declares (``host_memory``): taken from its node's.
    host_memory_mib: int = 0


@dataclass(frozen=True)
class ShardPlacement:
    node_id: str
    rank: int
    gpus: tuple[str, ...]
    fabric: str | None  # the replica's fabric; None for a single-node replica


@dataclass(frozen=True)
class Placement:
    """Where a replica's shards go, rank 0 first. ``replica_id`` is the id it is recorded
    under in the cluster (the one given to :meth:`Cluster.place`, or a provisional one)."""

    shards: tuple[ShardPlacement, ...]
    replica_id: str = ""


def degraded_refusal(
    degraded: Iterable[DegradedReason], fabrics: Sequence[str], profile: Profile
) -> str:
    """Why a node degraded for these reasons, on these healthy ``fabrics``, cannot take a
    shard of ``profile``; '' when none of its reasons touches it: it keeps the work it can
    do. dockerd unreachable stops everything (every shard is a container); an engine that
    will not run stops that engine; GPUs without a usable driver stop profiles that need
    GPUs; a fabric down stops multi-node replicas when the node has no healthy fabric left
    (the others are placed over a healthy one). A code this control plane does not know
    blocks nothing."""
    for reason in degraded:
        code = reason.code
        if (
            code == DegradedCode.DOCKER
            or (code == DegradedCode.ENGINE and reason.engine == profile.engine)
            or (code == DegradedCode.GPUS and profile.gpus > 0)
            or (code == DegradedCode.FABRIC and profile.nodes > 1 and not fabrics)
        ):
            return f"degraded: {reason.message}"
    return ""
