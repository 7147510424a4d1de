"""Admin routes of each node's GPUs: their states (healthy, unhealthy and why, cordoned by
whom and why), and cordoning or uncordoning GPUs named by index or uuid. A cordoned GPU
takes no new replica and what runs on it moves elsewhere, make-before-break; its node keeps
its other GPUs (:mod:`llmgw.server.fleet.gpuhealth`, the scheduler's ``_gpu_step``).

The console's node page calls :func:`node_gpus`, :func:`cordon` and :func:`uncordon`."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llmgw.errors import Conflict
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.fleet.gpuhealth import (
    VANISHED,
    forget_vanished,
    gpu_key,
    gpu_name,
    gpu_rows,
    resolve_gpus,
)
from llmgw.server.store import GpuCordon

__all__ = ["GpuRoutes", "cordon", "node_gpus", "uncordon"]

MAX_REASON = 200


def node_gpus(ctx: AdminContext, node_id: str) -> dict[str, Any]:
    """The node's GPUs with their states (NotFound when there is no such node), and why a
    replica on a cordoned one cannot move yet, if it cannot."""
    node = ctx.store.get_node(node_id)
    return {
        "node": node_id,
        "gpus": gpu_rows(node.inventory, ctx.store.list_gpu_cordons(node_id)),
        "blocked": ctx.scheduler.gpu_blocked.get(node_id),
    }


def _names(gpus: list[str]) -> str:
    return ", ".join(gpus)


def _named(inventory: dict[str, Any], keys: list[str]) -> str:
    """``GPU 3 (GPU-...)``, for each of ``keys``, as events name them."""
    names = {gpu_key(g): gpu_name(g) for g in inventory.get("gpus") or []}
    return ", ".join(names.get(k, k) for k in keys)


def cordon(
    ctx: AdminContext, node_id: str, gpus: list[str], *, reason: str, actor: str
) -> dict[str, Any]:
    """Cordon the node's GPUs named (NotFound naming those it has for one it has not;
    Conflict when every one is cordoned already); the node's GPUs after."""
    node = ctx.store.get_node(node_id)
    keys = resolve_gpus(node_id, node.inventory, gpus)
    added = ctx.store.cordon_gpus(node_id, keys, reason=reason, actor=actor)
    if not added:
        raise Conflict(
            f"GPU {_names(gpus)} of {node_id} already cordoned; "
            f"'llmgw ctl gpus uncordon {node_id} {','.join(gpus)}' lifts it"
        )
    why = f": {reason}" if reason else ""
    ctx.store.add_event(
        "gpu_cordon",
        node_id,
        f"{_named(node.inventory, [c.gpu_uuid for c in added])} cordoned{why}",
        actor,
    )
    ctx.scheduler.kick()
    return node_gpus(ctx, node_id)


def uncordon(ctx: AdminContext, node_id: str, gpus: list[str], *, actor: str) -> dict[str, Any]:
    """Lift the cordons of the node's GPUs named, and forget those among them that vanished
    from NVML (taken out of the machine: they stay unhealthy until forgotten or back);
    Conflict when none was cordoned or vanished."""
    node = ctx.store.get_node(node_id)
    keys = resolve_gpus(node_id, node.inventory, gpus)
    lifted = ctx.store.uncordon_gpus(node_id, keys)
    vanished = [
        gpu_key(g)
        for g in node.inventory.get("gpus") or []
        if g.get("health") == VANISHED and gpu_key(g) in keys
    ]
    forgotten = forget_vanished(node.inventory, vanished)
    if forgotten is not None:
        ctx.store.upsert_node(
            node_id,
            dataplane_addr=node.dataplane_addr,
            agent_version=node.agent_version,
            inventory=forgotten,
            connected=node.connected,
        )
        ctx.scheduler.gpus.note(node_id, forgotten)
        ctx.store.add_event(
            "gpu_forgotten",
            node_id,
            f"{_named(node.inventory, vanished)} (vanished) forgotten",
            actor,
        )
    if not lifted and forgotten is None:
        raise Conflict(f"GPU {_names(gpus)} of {node_id} not cordoned; nothing to undo")
    if lifted:
        ctx.store.add_event(
            "gpu_uncordon", node_id, f"{_named(node.inventory, lifted)} uncordoned", actor
        )
    ctx.scheduler.kick()
    return node_gpus(ctx, node_id)


def _gpus_of(body: dict[str, Any]) -> list[str]:
    gpus = body.get("gpus")
    if (
        not isinstance(gpus, list)
        or not gpus
        or not all(isinstance(g, str | int) and not isinstance(g, bool) for g in gpus)
    ):
        raise BadRequest("'gpus' is required: a list of GPU indexes or uuids, e.g. [\"3\"]")
    return [str(g) for g in gpus]


class GpuRoutes:
    """``GET /api/gpus``, ``GET /api/nodes/{node}/gpus``, ``POST .../gpus/cordon`` and
    ``.../gpus/uncordon``."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    async def all_gpus(self, request: web.Request) -> web.Response:
        cordons: dict[str, list[GpuCordon]] = {}
        for c in self.ctx.store.list_gpu_cordons():
            cordons.setdefault(c.node_id, []).append(c)
        return web.json_response(
            [
                {
                    "node": node.id,
                    "gpus": gpu_rows(node.inventory, cordons.get(node.id, [])),
                    "blocked": self.ctx.scheduler.gpu_blocked.get(node.id),
                }
                for node in self.ctx.store.list_nodes()
            ]
        )

    async def gpus(self, request: web.Request) -> web.Response:
        return web.json_response(node_gpus(self.ctx, request.match_info["node"]))

    async def cordon(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        reason = body.get("reason", "")
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise BadRequest(f"'reason' must be text of at most {MAX_REASON} characters")
        return web.json_response(
            cordon(
                self.ctx,
                request.match_info["node"],
                _gpus_of(body),
                reason=reason,
                actor=principal_of(request).actor,
            )
        )

    async def uncordon(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        return web.json_response(
            uncordon(
                self.ctx,
                request.match_info["node"],
                _gpus_of(body),
                actor=principal_of(request).actor,
            )
        )
