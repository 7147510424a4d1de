"""The node page's actions: drain, uncordon, revoke, each a POST behind the action guard
(Origin, CSRF, admin), answered Post/Redirect/Get with a flash message.

Each form carries ``confirm``, which must equal the node's id: console.js fills it in once the
operator has confirmed a dialog naming the node; without script the operator types it. A
stray click (or a replayed form for another node) changes nothing. The work is the admin
API's own (:mod:`llmgw.server.admin.nodes`, :class:`llmgw.server.fleet.nodes.Membership`)."""

from __future__ import annotations

import logging
from typing import Final
from urllib.parse import quote

from aiohttp import web

from llmgw.errors import Conflict, LlmgwError, NotFound
from llmgw.log import kv
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin import nodes as node_actions
from llmgw.server.console.auth import form_of
from llmgw.server.console.site import SESSION, Handler, Site

__all__ = ["ACTIONS", "NodeActions", "node_path", "unconfirmed"]

log = logging.getLogger("llmgw.server.console")

ACTIONS: Final = ("drain", "uncordon", "revoke")


class NodeActions:
    """``POST /ui/nodes/{node}/{action}`` for each of :data:`ACTIONS`."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def _done(self, node_id: str, action: str, actor: str) -> str:
        ctx = self.site.ctx
        if action == "drain":
            progress = node_actions.drain(ctx, node_id, actor=actor)
            return f"node {node_id} is draining: {_progress(progress)}"
        if action == "uncordon":
            node_actions.uncordon(ctx, node_id, actor=actor)
            return f"node {node_id} takes new replicas again"
        serials = ctx.membership.revoke(node_id, actor=actor)
        return (
            f"node {node_id} is revoked: its certificates ({len(serials)}) are refused from now "
            "on; it must join again to come back"
        )

    def handler(self, action: str) -> Handler:
        async def act(request: web.Request) -> web.StreamResponse:
            return await self.act(request, action)

        return act

    async def act(self, request: web.Request, action: str) -> web.StreamResponse:
        node_id = request.match_info["node"]
        refused = unconfirmed(self.site, request, node_id, action)
        if refused is not None:
            return refused
        token, _session = request[SESSION]
        back = node_path(node_id)
        principal = principal_of(request)
        try:
            message = self._done(node_id, action, principal.actor)
            level = "info"
        except NotFound as exc:
            return self.site.error_page(request, 404, "Not found", str(exc))
        except Conflict as exc:
            message, level = str(exc), "error"
        except LlmgwError as exc:
            message, level = f"{action} failed: {exc}", "error"
        log.info(
            "a console action",
            extra=kv(action=action, node=node_id, actor=principal.actor, ok=level == "info"),
        )
        self.site.flash.put(token, message, level=level)
        return web.Response(status=303, headers={"Location": back})


def node_path(node_id: str) -> str:
    return f"/ui/nodes/{quote(node_id, safe='')}"


def unconfirmed(site: Site, request: web.Request, node_id: str, action: str) -> web.Response | None:
    """None when the form's ``confirm`` is the node's id; else the answer that does
    nothing: back to the node's page, whose flash says how to confirm."""
    if form_of(request).get("confirm", "").strip() == node_id:
        return None
    token, _session = request[SESSION]
    site.flash.put(
        token,
        f"nothing done: to {action} node {node_id}, confirm with its id "
        f"({node_id!r}) in the form's confirmation field",
        level="error",
    )
    return web.Response(status=303, headers={"Location": node_path(node_id)})


def _progress(progress: dict[str, object]) -> str:
    left = progress.get("replicas_left")
    count = len(left) if isinstance(left, list) else 0
    blocked = progress.get("blocked")
    text = "no replica left on it" if not count else f"{count} replica(s) to move off"
    return f"{text} ({blocked})" if blocked else text
