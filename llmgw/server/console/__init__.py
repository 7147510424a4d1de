"""The web console at /ui/ on :8080: server-rendered pages (Jinja2) for operators signed in
with their accounts, a little JavaScript of our own, no third-party code.

Modules: :mod:`.render` (templates, static files under hashed URLs), :mod:`.security` (the
headers, cookies, CSRF and Origin checks), :mod:`.site` (what the handlers share, the HTML
answers and error pages), :mod:`.auth` (sessions, the guards, login and logout),
:mod:`.pages` (Overview, Nodes, a node, Events, and their live fragments), :mod:`.stream`
(the events as server-sent events), :mod:`.actions` (drain, uncordon, revoke a node), :mod:`.gpus` (cordon, uncordon a GPU),
:mod:`.joining` (Add node: a join token, its command shown once; a node's rekey and
re-pair the same way), :mod:`.approval` (Approve: pending nodes by fingerprint, reject),
:mod:`.updating` (Update now: a signed agent update behind the account's password),
:mod:`.models` (the catalog, the deployed models, a model's replicas; deploy, scale, switch
profile, undeploy), :mod:`.keys` (API keys with their usage; create, shown once, and
revoke). A new page is a handler and a row in the table below.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from llmgw.server.admin.context import AdminContext
from llmgw.server.console.actions import ACTIONS, NodeActions
from llmgw.server.console.approval import Approval
from llmgw.server.console.auth import ConsoleAuth
from llmgw.server.console.gpus import GPU_ACTIONS, GpuActions
from llmgw.server.console.joining import REKEYS, AddNode, RekeyNode
from llmgw.server.console.keys import KeyPages
from llmgw.server.console.models import ModelPages
from llmgw.server.console.pages import Pages
from llmgw.server.console.render import Assets, Renderer
from llmgw.server.console.security import secure_headers
from llmgw.server.console.site import Flash, Site, handled
from llmgw.server.console.stream import EventStream
from llmgw.server.console.updating import UpdateNow

__all__ = ["Console", "add_console_routes"]

STATIC_CACHE = "public, max-age=31536000, immutable"


class Console:
    """The console's parts, built once per application."""

    def __init__(
        self,
        ctx: AdminContext,
        *,
        clock: Callable[[], float] = time.time,
        cleartext: bool = False,
    ) -> None:
        assets = Assets()
        self.site = Site(
            ctx=ctx,
            logins=ctx.logins,
            renderer=Renderer(assets),
            flash=Flash(),
            cleartext=cleartext,
        )
        self.assets = assets
        self.auth = ConsoleAuth(self.site)
        self.pages = Pages(self.site, clock=clock)
        self.stream = EventStream(self.site)
        self.actions = NodeActions(self.site)
        self.gpu_actions = GpuActions(self.site)
        self.add_node = AddNode(self.site)
        self.approval = Approval(self.site)
        self.update_now = UpdateNow(self.site)
        self.models = ModelPages(self.site, self.pages)
        self.rekey = RekeyNode(self.site, self.pages)
        self.keys = KeyPages(self.site, self.pages)

    async def static(self, request: web.Request) -> web.StreamResponse:
        """A static file; a year's cache under its own hash, revalidated under another (a
        page from before an upgrade asking for the old one gets today's)."""
        asset = self.assets.files.get(request.match_info["name"])
        if asset is None:
            return self.site.error_page(
                request, 404, "Not found", "no such file of the console; reload the page"
            )
        response = web.Response(body=asset.body, headers={"Content-Type": asset.content_type})
        fresh = request.match_info["digest"] == asset.digest
        secure_headers(response, cache=STATIC_CACHE if fresh else "no-cache")
        return response

    async def root(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=308, headers={"Location": "/ui/"})

    async def missing(self, request: web.Request) -> web.StreamResponse:
        """Any other /ui/ address: a page that says so, never the gateway's JSON."""
        if request.method not in ("GET", "HEAD"):
            return self.site.error_page(
                request,
                405,
                "Method not allowed",
                f"{request.method[:16]} is not taken here; use the page's own buttons",
            )
        return self.site.error_page(
            request,
            404,
            "Not found",
            f"no console page at {request.path[:100]}; the nav above lists every page",
        )


def add_console_routes(
    app: web.Application,
    ctx: AdminContext,
    *,
    clock: Callable[[], float] = time.time,
    cleartext: bool = False,
) -> Console:
    """The console's routes on ``app``, every one answering HTML with the security headers
    (``clock``: the charts' "now", a test's; ``cleartext``: the listener serves plain HTTP
    beyond loopback, which the login page says)."""
    console = Console(ctx, clock=clock, cleartext=cleartext)
    auth, pages, site = console.auth, console.pages, console.site
    models, keys = console.models, console.keys
    r = app.router
    for method, path, handler in (
        ("GET", "/ui", console.root),
        ("GET", "/ui/static/{digest}/{name}", console.static),
        ("GET", "/ui/login", auth.login_form),
        ("POST", "/ui/login", auth.login),
        ("POST", "/ui/logout", auth.action(auth.logout, admin=False)),
        ("GET", "/ui/", auth.page(pages.overview)),
        ("GET", "/ui/nodes", auth.page(pages.nodes)),
        ("GET", "/ui/nodes/{node}", auth.page(pages.node)),
        ("GET", "/ui/events", auth.page(pages.events)),
        ("GET", "/ui/events/stream", auth.page(console.stream.stream)),
        *(
            ("POST", f"/ui/nodes/{{node}}/{action}", auth.action(console.actions.handler(action)))
            for action in ACTIONS
        ),
        *(
            (
                "POST",
                f"/ui/nodes/{{node}}/gpus/{action}",
                auth.action(console.gpu_actions.handler(action)),
            )
            for action in GPU_ACTIONS
        ),
        *(
            ("POST", f"/ui/nodes/{{node}}/{action}", auth.action(console.rekey.handler(action)))
            for action in REKEYS
        ),
        ("GET", "/ui/add-node", auth.page(console.add_node.show)),
        ("POST", "/ui/add-node", auth.action(console.add_node.create)),
        ("GET", "/ui/approve", auth.page(console.approval.show)),
        ("POST", "/ui/nodes/{node}/approve", auth.action(console.approval.approve)),
        ("POST", "/ui/nodes/{node}/reject", auth.action(console.approval.reject)),
        ("GET", "/ui/update", auth.page(console.update_now.show)),
        ("POST", "/ui/update", auth.action(console.update_now.order)),
        ("GET", "/ui/models", auth.page(models.models)),
        ("POST", "/ui/models", auth.action(models.deploy)),
        # A model's name may hold "/": its actions are the last segment.
        ("POST", "/ui/models/{name:.+}/{action:[a-z]+}", auth.action(models.act)),
        ("GET", "/ui/models/{name:.+}", auth.page(models.model)),
        ("GET", "/ui/keys", auth.page(keys.keys)),
        ("POST", "/ui/keys", auth.action(keys.create)),
        ("GET", "/ui/keys/{key}", auth.page(keys.key)),
        ("POST", "/ui/keys/{key}/revoke", auth.action(keys.revoke)),
    ):
        if method == "GET":
            r.add_get(path, handled(site, handler))
        else:
            r.add_route(method, path, handled(site, handler))
    # Last: what no route above takes (aiohttp tries the longest prefix first).
    r.add_route("*", "/ui/{tail:.*}", handled(site, console.missing))
    return console
