"""Admin routes about the fleet: the control plane's status, the nodes (each with its health:
healthy, degraded with its reasons, or offline), operator decisions on them (approve, reject,
revoke), draining and the event log. Each GPU carries its utilisation, live from the node's
session.

What the console shows and does to nodes is the same code: the module's functions
(:func:`list_nodes`, :func:`node_detail`, :func:`drain`, :func:`uncordon`) are called by
these handlers and by :mod:`llmgw.server.console`."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from llmgw import __version__
from llmgw.contracts.inventory import DegradedReason, degraded_reasons
from llmgw.errors import Conflict, StoreUnavailable
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.fleet.hostmem import sleepers
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.store import Certificate, Node
from llmgw.server.store.states import NodeState, node_health

__all__ = ["NodeRoutes", "drain", "list_nodes", "node_detail", "node_summary", "uncordon"]

# How much of a pending node's reasons is shown (the rest of its inventory is a stored
# summary, llmgw.server.fleet.intake.pending_inventory).
PENDING_REASONS = 8
PENDING_REASON_CHARS = 1000


def _gpus(stored: Any, session: NodeSession | None) -> list[dict[str, Any]]:
    """The node's GPUs as its stored inventory has them, each with ``utilization_percent``
    from its session's latest heartbeat (the store never has it: it changes every second);
    null when the node is not connected, has not said yet, or the GPU cannot tell."""
    live = session.gpu_utilization if session is not None else {}
    if not isinstance(stored, list):
        return []
    return [
        {**gpu, "utilization_percent": live.get(str(gpu.get("uuid") or ""))}
        for gpu in stored
        if isinstance(gpu, Mapping)
    ]


def degraded_of(ctx: AdminContext, node: Node) -> tuple[DegradedReason, ...]:
    """Why the node is degraded, as it last reported: from its stored inventory once
    approved; while pending (only a summary is stored), from what its session holds,
    bounded, so that an operator sees a degraded node before approving it."""
    session = ctx.sessions.get(node.id)
    if node.state == NodeState.PENDING and session is not None:
        held = session.held_inventory
        if held is not None:
            return tuple(
                DegradedReason(
                    code=d.code[:32],
                    message=d.message[:PENDING_REASON_CHARS],
                    engine=d.engine[:32],
                    fabric=d.fabric[:64],
                )
                for d in held.degraded[:PENDING_REASONS]
            )
    return degraded_reasons(node.inventory)


def node_summary(
    ctx: AdminContext,
    node: Node,
    shard_count: int,
    cert: Certificate | None,
    update: dict[str, Any] | None,
) -> dict[str, Any]:
    """One node as the list shows it (``GET /api/nodes``, the console's Nodes page)."""
    inv = node.inventory
    session = ctx.sessions.get(node.id)
    connected = session is not None
    degraded = degraded_of(ctx, node)
    return {
        "id": node.id,
        "uid": node.uid,
        "state": node.state,
        # Beside the state, not one of them: what the node's own reports say it can do.
        "health": node_health(connected and node.id not in ctx.lost, bool(degraded)),
        "degraded": [r.as_dict() for r in degraded],
        "connected": connected,
        "draining": node.draining,
        "lost": node.id in ctx.lost,
        "dataplane_addr": node.dataplane_addr,
        "agent_version": node.agent_version,
        # A live node's, from its session: the store's copy is flushed in batches.
        "last_seen": session.seen_at if session is not None else node.last_seen,
        "shards": shard_count,
        "cpus": inv.get("cpus"),
        "memory_total_bytes": inv.get("memory_total_bytes"),
        "gpus": _gpus(inv.get("gpus", []), session),
        "gpu_status": inv.get("gpu_status", ""),
        "engines": inv.get("engines", []),
        "fabrics": inv.get("fabrics", []),
        "fingerprint": node.fingerprint,
        "cert_expires_at": cert.not_after if cert else None,
        "cert_serial": cert.serial if cert else None,
        "update": update,
    }


def list_nodes(ctx: AdminContext) -> list[dict[str, Any]]:
    """Every node's summary, in id order."""
    counts: dict[str, int] = {}
    for shard in ctx.store.list_shards():
        counts[shard.node_id] = counts.get(shard.node_id, 0) + 1
    # Each table read once for the whole list, not once per node: a fleet's list is
    # thousands of rows, read by every console that polls it.
    certs = ctx.store.latest_certificates()
    updates = ctx.updates.all_status()
    return [
        node_summary(ctx, n, counts.get(n.id, 0), certs.get(n.id), updates.get(n.id))
        for n in ctx.store.list_nodes()
    ]


def remembered_nodes(ctx: AdminContext, listed: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The list while the database is away: the last one read, each node's connection,
    health and last word from the live sessions, and a node connected since with what its
    session knows (no shards, certificate or inventory)."""
    rows: dict[str, dict[str, Any]] = {}
    for old in listed:
        rows[old["id"]] = dict(old)
    for node_id, live in ctx.sessions.items():
        rows.setdefault(node_id, _session_row(live))
    for node_id, row in rows.items():
        session = ctx.sessions.get(node_id)
        row["connected"] = session is not None
        row["lost"] = node_id in ctx.lost
        row["health"] = node_health(session is not None and not row["lost"], bool(row["degraded"]))
        if session is not None:
            row["last_seen"] = session.seen_at
    return [rows[k] for k in sorted(rows)]


def _session_row(session: NodeSession) -> dict[str, Any]:
    return {
        "id": session.node_id,
        "uid": "",
        "state": NodeState.APPROVED if session.approved else NodeState.PENDING,
        "degraded": [],
        "draining": session.draining,
        "dataplane_addr": session.dataplane_addr,
        "agent_version": "",
        "shards": 0,
        "cpus": None,
        "memory_total_bytes": None,
        "gpus": [],
        "gpu_status": "",
        "engines": sorted(session.engines),
        "fabrics": [],
        "fingerprint": "",
        "cert_expires_at": None,
        "cert_serial": None,
        "update": None,
    }


def database_note(ctx: AdminContext) -> str | None:
    """ "unreachable since ..." while the database is away, else None."""
    since = getattr(ctx.store.database, "unreachable_since", None)
    if since is None:
        return None
    return (
        f"unreachable since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}; "
        "scheduling and admin writes pause, lists are the leader's memory"
    )


def node_detail(ctx: AdminContext, node_id: str) -> dict[str, Any]:
    """One node, with what its inventory says beyond the list's columns: its warnings, its
    engines as checked, its fabrics, the sources it keeps warm (NotFound when there is no
    such node)."""
    node = ctx.store.get_node(node_id)
    inv = node.inventory
    data = node_summary(
        ctx,
        node,
        len(ctx.store.list_shards(node_id=node.id)),
        ctx.store.latest_certificate(node.id),
        ctx.updates.status_of(node.id),
    )
    data.update(
        driver_version=inv.get("driver_version", ""),
        engine_details=inv.get("engine_details", []),
        warnings=inv.get("warnings", []),
        # What its sleeping replicas hold of its memory (llmgw.server.fleet.hostmem).
        sleepers_host_memory_bytes=sum(s.mib for s in sleepers(ctx.store, node.id)) << 20,
        # The sources it keeps in its page cache for models with prefetch (as it reported).
        warm=inv.get("warm", []),
    )
    return data


def drain(ctx: AdminContext, node_id: str, *, actor: str) -> dict[str, object]:
    """Start draining ``node_id`` (a no-op when it drains already); its progress."""
    node = ctx.store.get_node(node_id)
    if not node.draining:
        ctx.store.set_node_draining(node_id, True)
        ctx.store.add_event("node_drain", node_id, "drain started", actor)
        ctx.scheduler.kick()
    return ctx.scheduler.drain_progress(node_id)


def uncordon(ctx: AdminContext, node_id: str, *, actor: str) -> dict[str, object]:
    """Let a draining node take new replicas again (Conflict when it is not draining)."""
    node = ctx.store.get_node(node_id)
    if not node.draining:
        raise Conflict(f"node {node_id} is not draining; nothing to undo")
    ctx.store.set_node_draining(node_id, False)
    ctx.store.add_event("node_uncordon", node_id, "takes new replicas again", actor)
    ctx.scheduler.kick()
    return ctx.scheduler.drain_progress(node_id)


class NodeRoutes:
    """The fleet, its nodes and the events."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx
        # The list as last read (the console polls it), shown with the live sessions while
        # the database is away; before any read, the sessions alone.
        self._listed: list[dict[str, Any]] = []

    # -- status ---------------------------------------------------------------------------------

    async def status(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = {
            "version": __version__,
            "cluster_id": self.ctx.cluster_id,
            "epoch": self.ctx.epoch,
            "nodes_connected": len(self.ctx.sessions),
            "http": self.ctx.listening.http_addr,
            "grpc_port": self.ctx.listening.grpc_port,
        }
        note = database_note(self.ctx)
        if note is not None:
            body["database"] = note
        return web.json_response(body)

    # -- nodes ----------------------------------------------------------------------------------

    async def nodes(self, request: web.Request) -> web.Response:
        try:
            self._listed = list_nodes(self.ctx)
        except StoreUnavailable:
            # The leader leads on without its database: the table it last read, with the
            # connections it holds now (/api/status says the database is away).
            return web.json_response(remembered_nodes(self.ctx, self._listed))
        return web.json_response(self._listed)

    async def node(self, request: web.Request) -> web.Response:
        return web.json_response(node_detail(self.ctx, request.match_info["node"]))

    async def approve(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        fp = body.get("fingerprint")
        if not isinstance(fp, str):
            raise BadRequest(
                "'fingerprint' is required: the sha256:... the node printed when it joined"
            )
        node_id = request.match_info["node"]
        self.ctx.membership.approve(node_id, fp, actor=principal_of(request).actor)
        return web.json_response({"node": node_id, "state": NodeState.APPROVED})

    async def reject(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        self.ctx.membership.reject(node_id, actor=principal_of(request).actor)
        return web.json_response({"node": node_id, "state": "rejected"})

    async def revoke(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        serials = self.ctx.membership.revoke(node_id, actor=principal_of(request).actor)
        return web.json_response({"node": node_id, "state": NodeState.REVOKED, "serials": serials})

    # -- drain ----------------------------------------------------------------------------------------

    async def drain(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        return web.json_response(drain(self.ctx, node_id, actor=principal_of(request).actor))

    async def drain_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.ctx.scheduler.drain_progress(request.match_info["node"]))

    async def uncordon(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node"]
        return web.json_response(uncordon(self.ctx, node_id, actor=principal_of(request).actor))

    # -- events ---------------------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.Response:
        try:
            limit = max(1, min(1000, int(request.query.get("limit", "100"))))
        except ValueError:
            raise BadRequest("limit must be a number") from None
        subject = request.query.get("subject") or None
        return web.json_response(
            [
                {
                    "id": e.id,
                    "ts": e.ts,
                    "kind": e.kind,
                    "subject": e.subject,
                    "message": e.message,
                    "actor": e.actor,
                }
                for e in self.ctx.store.list_events(limit=limit, subject=subject)
            ]
        )
