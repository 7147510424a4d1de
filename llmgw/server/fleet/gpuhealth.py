"""Each GPU's state as placement and operators see it: healthy, unhealthy (its agent found an
XID error, or NVML stopped listing it) or cordoned (an operator took it out of placement).

A GPU that was in a node's stored inventory and is missing from the next one stays in the
stored inventory, marked :data:`VANISHED`: it is unhealthy until its agent lists it again
(after a reset or a reboot), or until an operator forgets it (``llmgw ctl gpus uncordon``:
a GPU taken out of the machine). A GPU its agent reports with a ``health`` (an XID) is
unhealthy while its agent says so. Either way an event says it (``gpu_unhealthy``,
``gpu_healthy``). Placement skips unhealthy and cordoned GPUs, never their node's others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from llmgw.errors import NotFound
from llmgw.server.store import GpuCordon, Store

__all__ = [
    "GPU_STATES",
    "VANISHED",
    "GpuStates",
    "blocked_gpus",
    "carry_vanished",
    "forget_vanished",
    "gpu_key",
    "gpu_name",
    "gpu_rows",
    "gpu_state_counts",
    "note_gpu_health",
    "resolve_gpus",
]

VANISHED = "vanished: NVML no longer lists it (lost after an XID error, or off the bus)"
GPU_STATES = ("healthy", "unhealthy", "cordoned")


def gpu_key(gpu: Mapping[str, Any]) -> str:
    """How a stored GPU is known: its uuid, else its index (nvidia-smi may not tell one)."""
    return str(gpu.get("uuid") or gpu.get("index"))


def gpu_name(gpu: Mapping[str, Any]) -> str:
    return f"GPU {gpu.get('index')} ({gpu_key(gpu)})"


def carry_vanished(before: Mapping[str, Any], after: dict[str, Any]) -> None:
    """Keep in ``after`` (a new stored inventory) the GPUs of ``before`` it no longer lists,
    marked :data:`VANISHED`: a GPU NVML lost is not a GPU the node never had."""
    listed = {gpu_key(g) for g in after.get("gpus") or []}
    gone = [
        {**g, "health": g.get("health") if g.get("health") == VANISHED else VANISHED}
        for g in before.get("gpus") or []
        if gpu_key(g) not in listed
    ]
    if gone:
        after["gpus"] = sorted(
            [*after.get("gpus", []), *gone], key=lambda g: int(g.get("index") or 0)
        )


def forget_vanished(inventory: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any] | None:
    """``inventory`` without its vanished GPUs among ``keys``; None when it has none of them."""
    drop = {k for k in keys}
    gpus = inventory.get("gpus") or []
    kept = [g for g in gpus if not (g.get("health") == VANISHED and gpu_key(g) in drop)]
    if len(kept) == len(gpus):
        return None
    return {**inventory, "gpus": kept}


def note_gpu_health(
    store: Store, node_id: str, before: Mapping[str, Any], after: dict[str, Any]
) -> None:
    """Before ``after`` replaces ``before`` as the node's stored inventory: carry the GPUs
    that vanished, and record an event for each GPU that turned unhealthy or healthy."""
    if before:
        carry_vanished(before, after)
    old = {gpu_key(g): str(g.get("health") or "") for g in before.get("gpus") or []}
    for gpu in after.get("gpus") or []:
        key, health = gpu_key(gpu), str(gpu.get("health") or "")
        was = old.get(key, "")
        if health and health != was:
            store.add_event("gpu_unhealthy", node_id, f"{gpu_name(gpu)} unhealthy: {health}")
        elif was and not health:
            store.add_event("gpu_healthy", node_id, f"{gpu_name(gpu)} healthy again (was: {was})")


def blocked_gpus(
    inventory: Mapping[str, Any], cordoned: Mapping[str, GpuCordon] | frozenset[str]
) -> dict[str, str]:
    """Why placement may not use each of the node's GPUs that it may not, by key:
    ``unhealthy: <why>`` (first: what runs there is rebuilt, not moved) or ``cordoned``."""
    out = {}
    for gpu in inventory.get("gpus") or []:
        key = gpu_key(gpu)
        if gpu.get("health"):
            out[key] = f"unhealthy: {gpu['health']}"
        elif key in cordoned:
            out[key] = "cordoned"
    return out


def _state(gpu: Mapping[str, Any], cordoned: bool) -> str:
    if gpu.get("health"):
        return "unhealthy"
    return "cordoned" if cordoned else "healthy"


def gpu_rows(inventory: Mapping[str, Any], cordons: Sequence[GpuCordon]) -> list[dict[str, Any]]:
    """The node's GPUs as the admin API shows them: index, uuid, name, memory, state,
    health (why unhealthy) and the cordon (who, why, when) if any."""
    by_key = {c.gpu_uuid: c for c in cordons}
    rows = []
    for gpu in inventory.get("gpus") or []:
        cordon = by_key.get(gpu_key(gpu))
        rows.append(
            {
                "index": gpu.get("index"),
                "uuid": gpu.get("uuid") or "",
                "name": gpu.get("name") or "",
                "memory_total_mib": gpu.get("memory_total_mib") or 0,
                "memory_used_mib": gpu.get("memory_used_mib") or 0,
                "state": _state(gpu, cordon is not None),
                "health": gpu.get("health") or "",
                "cordon": None
                if cordon is None
                else {"actor": cordon.actor, "reason": cordon.reason, "at": cordon.at},
            }
        )
    return rows


def gpu_state_counts(
    inventories: Iterable[Mapping[str, Any]], cordons: Iterable[GpuCordon], node_ids: Sequence[str]
) -> Counter[str]:
    """GPUs of these nodes (``inventories`` in the order of ``node_ids``) by state."""
    cordoned = {(c.node_id, c.gpu_uuid) for c in cordons}
    counts: Counter[str] = Counter({state: 0 for state in GPU_STATES})
    for node_id, inventory in zip(node_ids, inventories, strict=True):
        for gpu in inventory.get("gpus") or []:
            counts[_state(gpu, (node_id, gpu_key(gpu)) in cordoned)] += 1
    return counts


def resolve_gpus(node_id: str, inventory: Mapping[str, Any], names: Sequence[str]) -> list[str]:
    """The keys of the node's GPUs named by index or uuid, in the order named, each once;
    NotFound naming the GPUs it has when one is not among them."""
    gpus = list(inventory.get("gpus") or [])
    keys: list[str] = []
    for name in names:
        found = next(
            (
                g
                for g in gpus
                if name == gpu_key(g) or (name.isdigit() and int(name) == g.get("index"))
            ),
            None,
        )
        if found is None:
            have = ", ".join(f"{g.get('index')} ({gpu_key(g)})" for g in gpus)
            raise NotFound(
                f"node {node_id} has no GPU {name!r}; "
                + (f"its GPUs: {have}" if gpus else "it reports no GPUs")
                + f" ('llmgw ctl gpus {node_id}' lists them)"
            )
        if gpu_key(found) not in keys:
            keys.append(gpu_key(found))
    return keys


class GpuStates:
    """The unhealthy GPUs of each node, as its stored inventory says, kept by the leader's
    scheduler between passes (read from the store once, then told of each inventory)."""

    def __init__(self) -> None:
        self.loaded = False
        # node id -> GPU key -> (its name, why it is unhealthy)
        self.unhealthy: dict[str, dict[str, tuple[str, str]]] = {}
        # node id -> how many GPUs its inventory lists, and their sum (kept as they change:
        # the gauge is set each pass).
        self.totals: dict[str, int] = {}
        self.total = 0

    def load(self, nodes: Iterable[tuple[str, Mapping[str, Any]]]) -> None:
        for node_id, inventory in nodes:
            self.note(node_id, inventory)
        self.loaded = True

    def keep(self, node_ids: Iterable[str]) -> None:
        """Forget the nodes not among ``node_ids`` (deleted)."""
        keep = set(node_ids)
        for node_id in [n for n in self.totals if n not in keep]:
            self.total -= self.totals.pop(node_id)
            self.unhealthy.pop(node_id, None)

    def counts(self, cordons: Iterable[GpuCordon]) -> dict[str, int]:
        """GPUs by state over every node (:data:`GPU_STATES`), with these cordons."""
        unhealthy = sum(len(bad) for bad in self.unhealthy.values())
        cordoned = sum(
            1
            for c in cordons
            if c.node_id in self.totals and c.gpu_uuid not in self.unhealthy.get(c.node_id, {})
        )
        return {
            "healthy": max(self.total - unhealthy - cordoned, 0),
            "unhealthy": unhealthy,
            "cordoned": cordoned,
        }

    def note(self, node_id: str, inventory: Mapping[str, Any]) -> None:
        """The node's stored inventory is now ``inventory``."""
        count = len(inventory.get("gpus") or [])
        self.total += count - self.totals.get(node_id, 0)
        self.totals[node_id] = count
        bad = {
            gpu_key(g): (gpu_name(g), str(g["health"]))
            for g in inventory.get("gpus") or []
            if g.get("health")
        }
        if bad:
            self.unhealthy[node_id] = bad
        else:
            self.unhealthy.pop(node_id, None)
