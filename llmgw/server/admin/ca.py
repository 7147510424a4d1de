"""Admin routes about the cluster CA: what it is, its rotation, dropping the old CA
(:mod:`llmgw.server.fleet.authority` does the work), and its encrypted export for another
control-plane instance (:mod:`llmgw.caexport`)."""

from __future__ import annotations

import asyncio

from aiohttp import web

from llmgw import caexport
from llmgw.durations import format_duration, parse_duration
from llmgw.errors import ConfigError
from llmgw.pki import DEFAULT_OVERLAP
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.fleet.authority import ClusterAuthority
from llmgw.server.ha.proxies import login_source

__all__ = ["CARoutes"]

MIN_OVERLAP = 60.0
"""A shorter overlap leaves agents no time to renew before the old CA is dropped."""
MAX_OVERLAP = 365 * 86400.0


class CARoutes:
    """``GET /api/ca``, ``POST /api/ca/rotate``, ``POST /api/ca/finish``,
    ``POST /api/ca/export``."""

    def __init__(self, ctx: AdminContext, authority: ClusterAuthority) -> None:
        self.ctx = ctx
        self.authority = authority

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.authority.status())

    async def rotate(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        unknown = sorted(set(body) - {"overlap"})
        if unknown:
            raise BadRequest(f"unknown field(s) {', '.join(unknown)}; send only 'overlap'")
        raw = body.get("overlap", DEFAULT_OVERLAP)
        try:
            overlap = parse_duration(raw)
        except ConfigError as exc:
            raise BadRequest(f"overlap {exc.message}") from None
        if not MIN_OVERLAP <= overlap <= MAX_OVERLAP:
            raise BadRequest(
                f"overlap must be from {format_duration(MIN_OVERLAP)} to "
                f"{format_duration(MAX_OVERLAP)} (agents renew under the new CA within it), "
                f"not {raw!r}"
            )
        return web.json_response(self.authority.rotate(overlap, actor=principal_of(request).actor))

    async def finish(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        unknown = sorted(set(body) - {"force"})
        if unknown:
            raise BadRequest(f"unknown field(s) {', '.join(unknown)}; send only 'force'")
        force = body.get("force", False)
        if not isinstance(force, bool):
            raise BadRequest("force must be true or false")
        return web.json_response(
            self.authority.finish(force=force, actor=principal_of(request).actor)
        )

    async def export(self, request: web.Request) -> web.Response:
        """``{"password", "passphrase"}``: the CA, its rotation's files, the cluster id and
        the admin token, sealed under the passphrase (``file``: the export file's text). The
        admin password is asked as for a signed update: the CA key signs those orders."""
        body = await read_json(self.ctx, request)
        unknown = sorted(set(body) - {"password", "passphrase"})
        if unknown:
            raise BadRequest(
                f"unknown field(s) {', '.join(unknown)}; send only 'password' and 'passphrase'"
            )
        await self.ctx.password.check(
            body.get("password"),
            refused="nothing was exported",
            source=login_source(request, self.ctx.admin_token),
        )
        passphrase = caexport.check_passphrase(body.get("passphrase"))
        export = self.authority.export(
            cluster_id=self.ctx.cluster_id, admin_token=self.ctx.admin_token
        )
        # scrypt takes its memory and half a second: off the event loop.
        sealed = await asyncio.to_thread(caexport.seal, export, passphrase)
        self.authority.exported(export, by=request.remote or "", actor=principal_of(request).actor)
        return web.json_response(
            {
                "ca_hash": export.ca_hash,
                "cluster_id": export.cluster_id,
                "rotation": None if export.rotation is None else export.rotation.to_json(),
                "file": sealed.decode("ascii"),
            }
        )
