"""The console's Update now page: a signed agent update ordered on one node or on every
approved node, to a version of the bundles this control plane serves, behind the signed-in
account's own password asked again (:meth:`llmgw.server.fleet.updates.Updates.order`, as ``POST
/api/updates``: a wrong one signs nothing); then each node's update state, live (queued,
sent, spooled, done, rolled-back, refused with the node's reason)."""

from __future__ import annotations

import logging
from typing import Any, Final
from urllib.parse import quote

from aiohttp import web

from llmgw.errors import Conflict, LlmgwError, NotFound, PasswordError
from llmgw.log import kv
from llmgw.server.accounts.logins import LoginThrottled
from llmgw.server.accounts.principals import principal_of
from llmgw.server.console.auth import MAX_PASSWORD, form_of
from llmgw.server.console.site import SESSION, Site
from llmgw.server.ha.proxies import login_source
from llmgw.server.joining.bundles import Bundle
from llmgw.server.store.states import NodeState
from llmgw.versions import version_key

__all__ = ["UpdateNow", "served_versions"]

log = logging.getLogger("llmgw.server.console")

PAGE: Final = "/ui/update"
MAX_FIELD: Final = 253
ALL: Final = "all"
ONE: Final = "node"


def served_versions(bundles: list[Bundle]) -> list[dict[str, Any]]:
    """The versions the served bundles are of, newest first, each with its architectures."""
    rids: dict[str, list[str]] = {}
    for bundle in bundles:
        rids.setdefault(bundle.version, []).append(bundle.rid)
    return [
        {"version": v, "rids": sorted(rids[v])} for v in sorted(rids, key=version_key, reverse=True)
    ]


class UpdateNow:
    """``GET /ui/update`` (``?node=ID`` chooses that node; live part ``?fragment=status``)
    and ``POST /ui/update`` (the order, Post/Redirect/Get)."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def _status(self) -> dict[str, Any]:
        rows = self.site.ctx.updates.all_status()
        return {"updates": [rows[n] for n in sorted(rows)]}

    async def _page(
        self,
        request: web.Request,
        *,
        status: int = 200,
        problem: str = "",
        target: str = ONE,
        node: str = "",
        version: str = "",
    ) -> web.Response:
        ctx = self.site.ctx
        versions = served_versions(await ctx.updates.served())
        nodes = [n.id for n in ctx.store.list_nodes() if n.state == NodeState.APPROVED]
        return self.site.page(
            request,
            "update.html",
            status=status,
            page="update",
            is_admin=principal_of(request).is_admin,
            problem=problem,
            versions=versions,
            nodes=nodes,
            target=target,
            chosen_node=node,
            chosen_version=version or (versions[0]["version"] if versions else ""),
            bundle_dir=str(ctx.updates.bundle_dir),
            **self._status(),
        )

    async def show(self, request: web.Request) -> web.Response:
        wanted = request.query.get("fragment")
        if wanted is not None:
            if wanted != "status":
                raise NotFound(f"this page has no live part {wanted[:40]!r}; it has status")
            return self.site.fragment("_update_status.html", **self._status())
        node = request.query.get("node", "").strip()[:MAX_FIELD]
        target = ALL if request.query.get("all") == "1" else ONE
        return await self._page(request, node=node, target=target)

    async def order(self, request: web.Request) -> web.StreamResponse:
        form = form_of(request)
        target = ALL if form.get("target") == ALL else ONE
        node = form.get("node", "").strip()[:MAX_FIELD]
        version = form.get("version", "").strip()[:MAX_FIELD]
        password = form.get("password", "")[:MAX_PASSWORD]
        principal = principal_of(request)

        async def refused(status: int, problem: str) -> web.Response:
            # What was chosen is kept; the password never comes back in a page.
            return await self._page(
                request, status=status, problem=problem, target=target, node=node, version=version
            )

        if target == ONE and not node:
            return await refused(400, "nothing ordered: choose a node, or all approved nodes")
        served = await self.site.ctx.updates.served()
        versions = [v["version"] for v in served_versions(served)]
        if version not in versions:
            have = ", ".join(versions) or "none: its bundle directory holds no agent bundle"
            return await refused(
                400,
                f"nothing ordered: this control plane serves no bundle of version "
                f"{version or '(none chosen)'}; it serves {have}. Choose one of those, or copy "
                f"llmgw-agent-VERSION-linux-ARCH.tar.gz into "
                f"{self.site.ctx.updates.bundle_dir}, or install that version's "
                "llmgw-agent-bundles package",
            )
        if not password:
            return await refused(
                400, "nothing signed: give your own account's password to sign the order"
            )
        try:
            out = await self.site.ctx.updates.order(
                None if target == ALL else [node],
                version=version,
                password=password,
                account=principal.password_account,
                actor=principal.actor,
                source=login_source(request, self.site.ctx.admin_token),
            )
        except LoginThrottled as exc:
            log.info("a console update refused: locked", extra=kv(actor=principal.actor))
            return await refused(429, f"nothing signed: {exc}")
        except PasswordError as exc:
            log.info("a console update refused: wrong password", extra=kv(actor=principal.actor))
            return await refused(403, str(exc))
        except NotFound as exc:
            return await refused(404, f"nothing ordered: {exc}")
        except Conflict as exc:
            return await refused(409, f"nothing ordered: {exc}")
        except LlmgwError as exc:
            return await refused(503, f"nothing ordered: {exc}")
        names = ", ".join(u["node"] for u in out)
        log.info(
            "an update ordered in the console",
            extra=kv(version=version, nodes=len(out), actor=principal.actor),
        )
        token, _session = request[SESSION]
        self.site.flash.put(
            token,
            f"update to {version} signed and ordered for {len(out)} node"
            f"{'' if len(out) == 1 else 's'} ({names}); follow its state below",
        )
        back = PAGE if target == ALL else f"{PAGE}?node={quote(node, safe='')}"
        return web.Response(status=303, headers={"Location": back})
