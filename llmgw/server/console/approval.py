"""The console's Approve page: the pending nodes with their key fingerprints and degraded
reasons (as ``GET /api/nodes`` shows them), live; approving one needs the fingerprint the
node printed, pasted or typed, which :meth:`llmgw.server.fleet.nodes.Membership.approve` compares
(a mismatch approves nothing, as ``llmgw ctl approve``); rejecting needs a confirmation that
names the node (console.js's dialog, or its id typed)."""

from __future__ import annotations

import logging
from typing import Any, Final
from urllib.parse import quote

from aiohttp import web

from llmgw.errors import Conflict, LlmgwError, NotFound
from llmgw.log import kv
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.nodes import list_nodes
from llmgw.server.console.auth import form_of
from llmgw.server.console.site import SESSION, Site
from llmgw.server.store.states import NodeState

__all__ = ["Approval"]

log = logging.getLogger("llmgw.server.console")

PAGE: Final = "/ui/approve"
MAX_FINGERPRINT: Final = 200


class Approval:
    """``GET /ui/approve`` (with its live part ``?fragment=pending``), ``POST
    /ui/nodes/{node}/approve`` and ``POST /ui/nodes/{node}/reject``."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def _values(self, request: web.Request) -> dict[str, Any]:
        pending = [n for n in list_nodes(self.site.ctx) if n["state"] == NodeState.PENDING]
        return {
            "pending": pending,
            "is_admin": principal_of(request).is_admin,
            "chosen": request.query.get("node", "")[:253],
        }

    def _page(
        self,
        request: web.Request,
        *,
        status: int = 200,
        problem: str = "",
        problem_node: str = "",
        typed: str = "",
    ) -> web.Response:
        return self.site.page(
            request,
            "approve.html",
            status=status,
            page="approve",
            problem=problem,
            problem_node=problem_node,
            typed=typed,
            **self._values(request),
        )

    async def show(self, request: web.Request) -> web.Response:
        wanted = request.query.get("fragment")
        if wanted is not None:
            if wanted != "pending":
                raise NotFound(f"this page has no live part {wanted[:40]!r}; it has pending")
            return self.site.fragment(
                "_approve_list.html",
                problem_node="",
                typed="",
                csrf=self._csrf(request),
                **self._values(request),
            )
        return self._page(request)

    def _csrf(self, request: web.Request) -> str:
        return request[SESSION][1].csrf

    async def approve(self, request: web.Request) -> web.StreamResponse:
        node_id = request.match_info["node"]
        fingerprint = form_of(request).get("fingerprint", "").strip()[:MAX_FINGERPRINT]
        principal = principal_of(request)
        if not fingerprint:
            return self._page(
                request,
                status=400,
                problem=f"nothing approved: paste the fingerprint node {node_id} printed "
                "when it joined (sha256:...) into its field, then approve",
                problem_node=node_id,
            )
        try:
            self.site.ctx.membership.approve(node_id, fingerprint, actor=principal.actor)
        except NotFound as exc:
            return self._page(request, status=404, problem=f"nothing approved: {exc}")
        except Conflict as exc:
            log.info(
                "a console approval refused",
                extra=kv(node=node_id, actor=principal.actor, error=str(exc)[:200]),
            )
            return self._page(
                request, status=409, problem=str(exc), problem_node=node_id, typed=fingerprint
            )
        except LlmgwError as exc:
            return self._page(
                request,
                status=503,
                problem=f"approving {node_id} failed: {exc}",
                problem_node=node_id,
                typed=fingerprint,
            )
        log.info("a node approved in the console", extra=kv(node=node_id, actor=principal.actor))
        token, _session = request[SESSION]
        key = self.site.ctx.store.get_node(node_id).fingerprint
        self.site.flash.put(token, f"node {node_id} is approved (key {key}): it takes work now")
        return web.Response(
            status=303, headers={"Location": f"/ui/nodes/{quote(node_id, safe='')}"}
        )

    async def reject(self, request: web.Request) -> web.StreamResponse:
        node_id = request.match_info["node"]
        principal = principal_of(request)
        token, _session = request[SESSION]
        if form_of(request).get("confirm", "").strip() != node_id:
            self.site.flash.put(
                token,
                f"nothing done: to reject node {node_id}, confirm with its id ({node_id!r}) "
                "in the form's confirmation field",
                level="error",
            )
            return web.Response(status=303, headers={"Location": PAGE})
        try:
            self.site.ctx.membership.reject(node_id, actor=principal.actor)
        except (NotFound, Conflict) as exc:
            return self._page(
                request,
                status=409 if isinstance(exc, Conflict) else 404,
                problem=f"nothing rejected: {exc}",
            )
        log.info("a node rejected in the console", extra=kv(node=node_id, actor=principal.actor))
        self.site.flash.put(
            token,
            f"node {node_id} is rejected: its certificate is denied and its record removed; "
            "it can join again only with a new token",
        )
        return web.Response(status=303, headers={"Location": PAGE})
