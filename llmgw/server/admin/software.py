"""Admin routes that change what runs on the nodes: engine installs, signed agent updates,
and the admin password that signing them takes."""

from __future__ import annotations

import re

from aiohttp import web

from llmgw.engines.registry import installable_engines
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.states import NodeState
from llmgw.server.updates import DEFAULT_ORDER_TTL

__all__ = ["SoftwareRoutes"]


_INSTALLABLE = installable_engines()


class SoftwareRoutes:
    """Engine installs, agent updates and the admin password."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    # -- engine installs ----------------------------------------------------------------------------

    async def install_engine(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        engine = body.get("engine")
        if engine not in _INSTALLABLE:
            raise BadRequest(f"engine must be one of {', '.join(_INSTALLABLE)}")
        fields: dict[str, str] = {}
        for key in ("version", "url", "sha256"):
            value = body.get(key)
            if not isinstance(value, str) or not value:
                raise BadRequest(f"'{key}' is required")
            fields[key] = value
        if not re.fullmatch(r"[0-9a-fA-F]{64}", fields["sha256"]):
            raise BadRequest("sha256 must be the 64 hex characters the publisher lists")
        if not fields["url"].startswith(("http://", "https://", "file://")):
            raise BadRequest(
                "url must be https:// (or http:// or file:// from a place the node lists in "
                "install_sources in its agent.yaml)"
            )
        arch = body.get("arch") or ""
        if not isinstance(arch, str):
            raise BadRequest("arch must be a string such as x86_64 or aarch64")
        nodes = body.get("nodes")
        if body.get("all"):
            nodes = [n.id for n in self.ctx.store.list_nodes() if n.state == NodeState.APPROVED]
        if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise BadRequest("give 'nodes' (a list of node ids) or 'all': true")
        for node in nodes:
            self.ctx.store.get_node(node)
        out = self.ctx.installs.order(
            nodes,
            engine=engine,
            version=fields["version"],
            url=fields["url"],
            sha256=fields["sha256"].lower(),
            arch=arch,
        )
        return web.json_response(out, status=202)

    async def engine_installs(self, request: web.Request) -> web.Response:
        wanted = set(request.query.getall("op", []))
        rows = [r for op, r in self.ctx.installs.records.items() if not wanted or op in wanted]
        return web.json_response(rows)

    # -- signed self-updates -----------------------------------------------------------------------

    async def order_update(self, request: web.Request) -> web.Response:
        """``{"nodes": [...] | "all": true, "version", "password", "ttl"?}``: sign an update
        order for each node; the admin password is asked again, and a wrong one signs
        nothing (403)."""
        body = await read_json(self.ctx, request)
        version = body.get("version")
        if not isinstance(version, str) or not version:
            raise BadRequest("'version' (the agent version to install) is required")
        nodes = body.get("nodes")
        if body.get("all"):
            if nodes:
                raise BadRequest("give 'nodes' or 'all': true, not both")
            nodes = None
        elif not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise BadRequest("give 'nodes' (a list of node ids) or 'all': true")
        ttl = body.get("ttl", DEFAULT_ORDER_TTL)
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not 60 <= ttl <= 7 * 86400:
            raise BadRequest("ttl must be a whole number of seconds from 60 to 7 days")
        out = await self.ctx.updates.order(
            nodes, version=version, password=body.get("password"), ttl=ttl
        )
        return web.json_response(out, status=202)

    async def updates(self, request: web.Request) -> web.Response:
        wanted = set(request.query.getall("node", []))
        rows = self.ctx.updates.all_status()
        return web.json_response([r for n, r in rows.items() if not wanted or n in wanted])

    async def change_password(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        await self.ctx.password.change(body.get("old"), body.get("new"))
        return web.json_response({"changed": True, "removed": str(self.ctx.password.password_file)})
