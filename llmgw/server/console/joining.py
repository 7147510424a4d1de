"""The console's Add node page: a form that mints a join token (the admin API's own
:func:`llmgw.server.admin.jointokens.create_join_token`), the command to paste on the node shown
once, and the node's enrolment followed live.

The secret is in one answer only: the POST's own page (``Cache-Control: no-store``), never a
redirect to a GET that would show it again; the store keeps its hash. ``GET
/ui/add-node?node=ID`` follows a node's enrolment without it (bookmarkable, reloadable)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

from llmgw.durations import parse_duration
from llmgw.errors import ConfigError, LlmgwError, NotFound
from llmgw.log import kv
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import BadRequest
from llmgw.server.admin.jointokens import create_join_token
from llmgw.server.console.actions import node_path, unconfirmed
from llmgw.server.console.auth import form_of
from llmgw.server.console.pages import Pages
from llmgw.server.console.site import SESSION, Handler, Site

__all__ = ["FACT_FIELDS", "REKEYS", "AddNode", "JoinForm", "RekeyNode"]

log = logging.getLogger("llmgw.server.console")

DEFAULT_TTL: Final = "1h"
MAX_FIELD: Final = 4096
FACT_FIELDS: Final = (
    "fabrics",
    "engines",
    "nvidia_smi",
    "ib_root",
    "models_root",
    "cache_root",
    "firewall_from",
    "fabric_peers",
)
"""The form's fields of node facts, named as the admin API's ``facts`` keys."""
REKEYS: Final = {"rekey": "rekey", "repair": "re-pair"}
"""A node page's ways to replace its key (the POST's last segment: what the page calls it):
a rekey (``llmgw ctl join-command --rekey NODE``) and a re-pair, for a node whose state
directory is lost (``--re-pair``)."""
LIST_FACTS: Final = ("fabrics", "engines", "firewall_from", "fabric_peers")
# A fabric's adapters are comma-separated (ib-a:mlx5_0,mlx5_1): fabrics and engines are one
# per line or space; addresses may be separated by commas too.
_WORDS = re.compile(r"\s+")
_ADDRESSES = re.compile(r"[\s,]+")


@dataclass(frozen=True)
class JoinForm:
    """What the operator typed into the Add node form, kept to fill it in again after a
    refusal."""

    node: str = ""
    ttl: str = DEFAULT_TTL
    address: str = ""
    facts: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_form(cls, form: dict[str, str]) -> JoinForm:
        return cls(
            node=form.get("node", "").strip()[:MAX_FIELD],
            ttl=form.get("ttl", "").strip()[:MAX_FIELD] or DEFAULT_TTL,
            address=form.get("address", "").strip()[:MAX_FIELD],
            facts=tuple((k, form.get(k, "").strip()[:MAX_FIELD]) for k in FACT_FIELDS),
        )

    @property
    def has_facts(self) -> bool:
        return any(value for _, value in self.facts)

    def fact(self, name: str) -> str:
        return dict(self.facts).get(name, "")

    def body(self) -> dict[str, Any]:
        """The admin API's JSON body for this form (BadRequest: a TTL that is no duration)."""
        if not self.node:
            raise BadRequest("give the node's id (the name it joins as, e.g. gpu-07)")
        try:
            ttl = parse_duration(self.ttl)
        except ConfigError as exc:
            raise BadRequest(f"TTL {exc.message}") from None
        facts: dict[str, Any] = {}
        for name, value in self.facts:
            if not value:
                continue
            if name in LIST_FACTS:
                splitter = _ADDRESSES if name in ("firewall_from", "fabric_peers") else _WORDS
                facts[name] = [v for v in splitter.split(value) if v]
            else:
                facts[name] = value
        body: dict[str, Any] = {"node": self.node, "ttl": ttl, "facts": facts}
        if self.address:
            body["address"] = self.address
        return body


def enrolment(site: Site, node_id: str) -> dict[str, Any]:
    """Where ``node_id``'s enrolment stands, for the live part of the page: ``stage`` is
    ``waiting`` (not seen yet; ``token_until``: when its active join token expires, None
    when it has none), ``pending``, ``approved`` or ``revoked``, with the node's fingerprint,
    connection and GPU count."""
    ctx = site.ctx
    try:
        node = ctx.store.get_node(node_id)
    except NotFound:
        active = [t for t in ctx.store.list_join_tokens() if t.node_id == node_id]
        return {
            "node_id": node_id,
            "stage": "waiting",
            "token_until": max((t.expires_at for t in active), default=None),
        }
    session = ctx.sessions.get(node_id)
    gpus = node.inventory.get("gpus", [])
    return {
        "node_id": node_id,
        "stage": str(node.state),
        "fingerprint": node.fingerprint or "",
        "connected": session is not None,
        "gpus": len(gpus) if isinstance(gpus, list) else 0,
    }


class AddNode:
    """``GET /ui/add-node`` (the form; ``?node=ID``: that node's enrolment followed) and
    ``POST /ui/add-node`` (the token minted, its command shown once)."""

    def __init__(self, site: Site) -> None:
        self.site = site

    def _page(
        self,
        request: web.Request,
        *,
        status: int = 200,
        form: JoinForm | None = None,
        problem: str = "",
        made: Any = None,
        watch: str = "",
    ) -> web.Response:
        return self.site.page(
            request,
            "add_node.html",
            status=status,
            page="add-node",
            is_admin=principal_of(request).is_admin,
            form=form or JoinForm(),
            problem=problem,
            made=made,
            watch=enrolment(self.site, watch) if watch else None,
        )

    async def show(self, request: web.Request) -> web.Response:
        watch = request.query.get("node", "").strip()[:MAX_FIELD]
        if request.query.get("fragment") is not None:
            if request.query["fragment"] != "enrol" or not watch:
                raise NotFound("this page's live part is ?node=ID&fragment=enrol; reload the page")
            return self.site.fragment("_enrolment.html", watch=enrolment(self.site, watch))
        return self._page(request, watch=watch)

    async def create(self, request: web.Request) -> web.Response:
        form = JoinForm.from_form(form_of(request))
        principal = principal_of(request)
        try:
            made = await create_join_token(
                self.site.ctx,
                form.body(),
                host_header=request.headers.get("Host", ""),
                actor=principal.actor,
            )
        except BadRequest as exc:
            return self._page(request, status=400, form=form, problem=str(exc))
        except NotFound as exc:
            return self._page(request, status=404, form=form, problem=str(exc))
        except LlmgwError as exc:
            return self._page(request, status=409, form=form, problem=str(exc))
        log.info(
            "a join token made in the console",
            extra=kv(node=made.node, token=made.id, actor=principal.actor),
        )
        # This answer is the only one that carries the secret: never cached, never
        # redirected to a page that could show it again.
        response = self._page(
            request,
            status=201,
            form=JoinForm(node=made.node),
            made=made,
            watch=made.node,
        )
        response.headers["Cache-Control"] = "no-store"
        return response


class RekeyNode:
    """``POST /ui/nodes/{node}/rekey`` and ``.../repair`` (:data:`REKEYS`): a rekey token
    for a joined node, minted by the admin API's own function as ``llmgw ctl join-command
    --rekey NODE [--re-pair]`` mints it. Confirmed with the node's id as revoke is; the
    command is shown once, on the node's page that answers the POST (never cached, never
    redirected to)."""

    def __init__(self, site: Site, pages: Pages) -> None:
        self.site = site
        self.pages = pages

    def handler(self, action: str) -> Handler:
        async def rekey(request: web.Request) -> web.StreamResponse:
            return await self.rekey(request, action)

        return rekey

    async def rekey(self, request: web.Request, action: str) -> web.StreamResponse:
        node_id = request.match_info["node"]
        refused = unconfirmed(self.site, request, node_id, REKEYS[action])
        if refused is not None:
            return refused
        principal = principal_of(request)
        body = {
            "node": node_id,
            "rekey": True,
            "re_pair": action == "repair",
            "ttl": parse_duration(DEFAULT_TTL),
        }
        try:
            made = await create_join_token(
                self.site.ctx,
                body,
                host_header=request.headers.get("Host", ""),
                actor=principal.actor,
            )
        except NotFound as exc:
            return self.site.error_page(request, 404, "Not found", str(exc))
        except (BadRequest, LlmgwError) as exc:  # revoked: it comes back only by a fresh join
            token, _session = request[SESSION]
            self.site.flash.put(token, f"nothing made: {exc}", level="error")
            return web.Response(status=303, headers={"Location": node_path(node_id)})
        log.info(
            "a rekey token made in the console",
            extra=kv(node=node_id, token=made.id, re_pair=made.re_pair, actor=principal.actor),
        )
        response = self.pages.node_page(request, node_id, status=201, made=made)
        response.headers["Cache-Control"] = "no-store"
        return response
