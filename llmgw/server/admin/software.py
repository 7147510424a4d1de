"""Admin routes that change what runs on the nodes: the desired engines (recorded, ordered
on every node that connects, shown per node), signed agent updates, and the admin password
that signing them takes."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest, read_flag, read_json
from llmgw.server.fleet.installs import INSTALLABLE, Build
from llmgw.server.fleet.updates import DEFAULT_ORDER_TTL
from llmgw.server.ha.proxies import login_source

__all__ = ["SoftwareRoutes"]

MAX_BUILDS = 16


def _target(body: dict[str, Any]) -> str | None:
    """The node named by ``node``, or None for ``"all": true``."""
    node, every = body.get("node"), body.get("all")
    if every is True and node is None:
        return None
    if every in (None, False) and isinstance(node, str) and node:
        return node
    raise BadRequest("give either 'node' (one node id) or 'all': true")


def _builds(body: dict[str, Any]) -> list[Build]:
    """The builds of a request: ``builds``, or one from ``url``, ``sha256`` and ``arch``."""
    raw = body.get("builds")
    if raw is None:
        raw = [{k: body[k] for k in ("arch", "url", "sha256") if k in body}]
    elif any(k in body for k in ("url", "sha256", "arch")):
        raise BadRequest("give 'builds' or 'url' and 'sha256' (with 'arch'), not both")
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_BUILDS:
        raise BadRequest(f"'builds' must be a list of 1 to {MAX_BUILDS} builds")
    builds = []
    for item in raw:
        if not isinstance(item, dict):
            raise BadRequest('each build is an object: {"arch", "url", "sha256"}')
        arch, url, sha256 = item.get("arch", ""), item.get("url"), item.get("sha256")
        if not isinstance(arch, str):
            raise BadRequest("arch must be a string such as x86_64 or aarch64")
        for key, value in (("url", url), ("sha256", sha256)):
            if not isinstance(value, str) or not value:
                raise BadRequest(f"'{key}' is required for each build")
        assert isinstance(url, str) and isinstance(sha256, str)
        builds.append(Build.checked(arch, url, sha256))
    return builds


class SoftwareRoutes:
    """Desired engines, agent updates and the admin password."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    # -- desired engines ----------------------------------------------------------------------

    async def install_engine(self, request: web.Request) -> web.Response:
        """``{"engine", "version", "builds": [{"arch"?, "url", "sha256"}] | "url", "sha256",
        "arch"?, "node": ID | "all": true}``: record the engine as desired there (every node,
        now and later, with ``all``) and order it on the connected, approved nodes."""
        body = await read_json(self.ctx, request)
        engine, version = body.get("engine"), body.get("version")
        if not isinstance(engine, str) or not engine:
            raise BadRequest(f"'engine' is required: one of {', '.join(INSTALLABLE)}")
        if not isinstance(version, str) or not version:
            raise BadRequest("'version' (the engine build's version) is required")
        node = _target(body)
        out = self.ctx.installs.desire(
            engine=engine,
            version=version,
            builds=_builds(body),
            node=node,
            actor=principal_of(request).actor,
        )
        self.ctx.scheduler.kick()
        return web.json_response(out, status=202)

    async def forget_engine(self, request: web.Request) -> web.Response:
        """``{"engine", "node": ID | "all": true, "arch"?}``: no longer desire the engine
        there (only that architecture's build, with ``arch``)."""
        body = await read_json(self.ctx, request)
        engine = body.get("engine")
        if not isinstance(engine, str) or not engine:
            raise BadRequest("'engine' is required")
        arch = body.get("arch")
        if arch is not None and (not isinstance(arch, str) or not arch):
            raise BadRequest("'arch' must be an architecture such as x86_64, or 'any'")
        removed = self.ctx.installs.forget(
            engine=engine, node=_target(body), arch=arch, actor=principal_of(request).actor
        )
        self.ctx.scheduler.kick()
        return web.json_response({"removed": removed})

    async def engines(self, request: web.Request) -> web.Response:
        """The desired set and, per node and engine, desired vs installed."""
        wanted = set(request.query.getall("node", []))
        rows = self.ctx.installs.node_rows()
        return web.json_response(
            {
                "desired": self.ctx.installs.desired_rows(),
                "nodes": [r for r in rows if not wanted or r["node"] in wanted],
            }
        )

    async def engine_installs(self, request: web.Request) -> web.Response:
        """What became of the install orders named by ``op`` (repeated)."""
        return web.json_response(self.ctx.installs.results(request.query.getall("op", [])))

    # -- signed self-updates -----------------------------------------------------------------------

    async def order_update(self, request: web.Request) -> web.Response:
        """``{"nodes": [...] | "all": true, "version", "password", "ttl"?}``: sign an update
        order for each node; the caller's password is asked again (the admin password with
        the admin token, an account's own with its login), and a wrong one signs nothing
        (403)."""
        body = await read_json(self.ctx, request)
        version = body.get("version")
        if not isinstance(version, str) or not version:
            raise BadRequest("'version' (the agent version to install) is required")
        nodes = body.get("nodes")
        if read_flag(body, "all"):
            if nodes:
                raise BadRequest("give 'nodes' or 'all': true, not both")
            nodes = None
        elif not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
            raise BadRequest("give 'nodes' (a list of node ids) or 'all': true")
        ttl = body.get("ttl", DEFAULT_ORDER_TTL)
        if not isinstance(ttl, int) or isinstance(ttl, bool) or not 60 <= ttl <= 7 * 86400:
            raise BadRequest("ttl must be a whole number of seconds from 60 to 7 days")
        by = principal_of(request)
        out = await self.ctx.updates.order(
            nodes,
            version=version,
            password=body.get("password"),
            account=by.password_account,
            actor=by.actor,
            ttl=ttl,
            source=login_source(request, self.ctx.admin_token),
        )
        return web.json_response(out, status=202)

    async def updates(self, request: web.Request) -> web.Response:
        wanted = set(request.query.getall("node", []))
        rows = self.ctx.updates.all_status()
        return web.json_response([r for n, r in rows.items() if not wanted or n in wanted])

    async def change_password(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        await self.ctx.password.change(
            body.get("old"),
            body.get("new"),
            actor=principal_of(request).actor,
            source=login_source(request, self.ctx.admin_token),
        )
        return web.json_response({"changed": True, "removed": str(self.ctx.password.password_file)})
