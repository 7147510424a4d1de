"""The node page's GPU actions: cordon or uncordon one GPU, each a POST behind the action
guard (Origin, CSRF, admin), answered Post/Redirect/Get with a flash message. No typed
confirmation as a drain asks: a cordon moves what runs on the GPU make-before-break and is
undone as easily. The work is the admin API's own (:mod:`llmgw.server.admin.gpus`)."""

from __future__ import annotations

import logging
from typing import Final

from aiohttp import web

from llmgw.errors import Conflict, LlmgwError, NotFound
from llmgw.log import kv
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin import gpus as gpu_actions
from llmgw.server.console.actions import node_path
from llmgw.server.console.auth import form_of
from llmgw.server.console.site import SESSION, Handler, Site

__all__ = ["GPU_ACTIONS", "GpuActions"]

log = logging.getLogger("llmgw.server.console")

GPU_ACTIONS: Final = ("cordon", "uncordon")


class GpuActions:
    """``POST /ui/nodes/{node}/gpus/{action}`` with the form's ``gpu`` (its uuid or index)
    and, to cordon, an optional ``reason``."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def handler(self, action: str) -> Handler:
        async def act(request: web.Request) -> web.StreamResponse:
            return await self.act(request, action)

        return act

    async def act(self, request: web.Request, action: str) -> web.StreamResponse:
        node_id = request.match_info["node"]
        form = form_of(request)
        gpu = form.get("gpu", "").strip()
        reason = form.get("reason", "").strip()[: gpu_actions.MAX_REASON]
        token, _session = request[SESSION]
        actor = principal_of(request).actor
        try:
            if not gpu:
                raise Conflict(f"nothing done: name the GPU to {action}")
            if action == "cordon":
                gpu_actions.cordon(self.site.ctx, node_id, [gpu], reason=reason, actor=actor)
                message = f"GPU {gpu} of {node_id} cordoned: what runs on it moves elsewhere"
            else:
                gpu_actions.uncordon(self.site.ctx, node_id, [gpu], actor=actor)
                message = f"GPU {gpu} of {node_id} takes replicas again"
            level = "info"
        except NotFound as exc:
            if not self._node_exists(node_id):
                return self.site.error_page(request, 404, "Not found", str(exc))
            message, level = str(exc), "error"
        except Conflict as exc:
            message, level = str(exc), "error"
        except LlmgwError as exc:
            message, level = f"{action} failed: {exc}", "error"
        log.info(
            "a console GPU action",
            extra=kv(action=action, node=node_id, gpu=gpu, actor=actor, ok=level == "info"),
        )
        self.site.flash.put(token, message, level=level)
        return web.Response(status=303, headers={"Location": node_path(node_id)})

    def _node_exists(self, node_id: str) -> bool:
        try:
            self.site.ctx.store.get_node(node_id)
        except NotFound:
            return False
        return True
