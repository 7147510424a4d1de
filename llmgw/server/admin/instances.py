"""Admin routes about the control-plane instances sharing one PostgreSQL database: which
there are (the lease's holder leads), and retiring one for good. A retired instance's id is
refused at start from then on, and the serials of its certificates go to the agents with
the list of instances, so that their data planes refuse them (its machine may be gone, its
files copied: only a refusal by serial shuts them out without touching the others).

On SQLite there is one control plane and no registry: both routes say so (409)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llmgw.errors import Conflict
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext
from llmgw.server.store import Store
from llmgw.server.store.instances import Instance

__all__ = ["InstanceRoutes"]

ALONE = (
    "this control plane runs alone on SQLite, with no instances to list or retire; "
    "instances are for several control planes on one PostgreSQL database (server.yaml "
    "database: postgresql://..., see the README's 'High availability')"
)


class InstanceRoutes:
    """``GET /api/instances``, ``POST /api/instances/{instance}/retire``."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    def _store(self) -> Store:
        store = self.ctx.store
        if store.engine != "postgresql":
            raise Conflict(ALONE)
        return store

    async def instances(self, request: web.Request) -> web.Response:
        """Every instance ever registered, retired ones too, in the order they started."""
        store = self._store()
        leader = store.lease().holder
        now = store.database.server_time()
        return web.json_response(
            [self._instance(i, leader=leader, now=now) for i in store.list_instances(retired=True)]
        )

    async def retire(self, request: web.Request) -> web.Response:
        store = self._store()
        instance_id = request.match_info["instance"]
        with store.transaction():  # retired and its event, or neither
            instance = store.retire_instance(instance_id, silent_for=self.ctx.instance_stale_after)
            serials = instance.serials
            store.add_event(
                "instance_retired",
                instance_id,
                f"instance {instance_id} retired; agents refuse its certificates from now on "
                f"(server serial {instance.server_serial or 'none recorded'}, client serial "
                f"{instance.client_serial or 'none recorded'})",
                principal_of(request).actor,
            )
        now = store.database.server_time()
        return web.json_response(
            {**self._instance(instance, leader="", now=now), "retired_serials": list(serials)}
        )

    def _instance(self, instance: Instance, *, leader: str, now: float) -> dict[str, Any]:
        if instance.retired_at is not None:
            role = "retired"
        elif instance.id == leader:
            role = "leader"
        elif now - instance.seen_at < self.ctx.instance_stale_after:
            role = "standby"
        else:
            role = "silent"  # stopped, or cut off: retire it once its machine is gone
        return {
            "id": instance.id,
            "role": role,
            "stream": instance.stream_addr,
            "http": instance.http_addr,
            "enroll": instance.enroll_addr,
            "version": instance.version,
            "started_at": instance.started_at,
            "seen_at": instance.seen_at,
            "seen_s_ago": max(0.0, now - instance.seen_at),
            "retired_at": instance.retired_at,
            "server_serial": instance.server_serial,
            "client_serial": instance.client_serial,
        }
