"""The admin API under /api on :8080, for ``llmgw ctl`` and the web console; a bearer admin
token or an account's token from ``llmgw ctl login`` (a viewer's only reads).

Every answer is JSON; errors are ``{"error": {"message", "code"}}`` with a message that
says what to do. One module per route group: :mod:`.nodes` (the fleet), :mod:`.models`
(models, catalog, replicas), :mod:`.access` (API keys with their policies and usage, join
tokens), :mod:`.software` (desired engines, agent updates, the admin password), :mod:`.ca`
(the cluster CA, its rotation and its export), :mod:`.instances` (the control-plane
instances on PostgreSQL, and retiring one), :mod:`.metrics` (each model's last hour of
requests and TTFT), :mod:`.users` (operator accounts, whoami), :mod:`.logins` (``ctl
login``'s sign-in and sign-out); :mod:`.context` holds what they share. A new route goes in its
group's module and in the table below.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

from llmgw.server.admin.access import AccessRoutes
from llmgw.server.admin.ca import CARoutes
from llmgw.server.admin.context import (
    ADMIN_MAX_BODY,
    AdminContext,
    Handler,
    Listening,
    answered,
    guarded,
)
from llmgw.server.admin.gpus import GpuRoutes
from llmgw.server.admin.instances import InstanceRoutes
from llmgw.server.admin.logins import LoginRoutes
from llmgw.server.admin.metrics import MetricsRoutes
from llmgw.server.admin.models import ModelRoutes
from llmgw.server.admin.nodes import NodeRoutes
from llmgw.server.admin.software import SoftwareRoutes
from llmgw.server.admin.users import UserRoutes
from llmgw.server.fleet.authority import ClusterAuthority

__all__ = ["ADMIN_MAX_BODY", "AdminContext", "Listening", "add_admin_routes"]


def add_admin_routes(
    app: web.Application, ctx: AdminContext, authority: ClusterAuthority | None = None
) -> None:
    """The admin routes; those of the cluster CA only when ``authority`` is given (the
    leader's, which owns the CA)."""
    logins = LoginRoutes(ctx)
    r = app.router
    # Signing in needs no credential; signing out only the login's own (a viewer's too).
    r.add_route("POST", "/api/login", answered(logins.login))
    r.add_route("POST", "/api/logout", answered(logins.logout))
    _add_guarded(app, ctx, _routes(ctx))
    if authority is None:
        return
    ca = CARoutes(ctx, authority)
    _add_guarded(
        app,
        ctx,
        (
            ("GET", "/api/ca", ca.status),
            ("POST", "/api/ca/rotate", ca.rotate),
            ("POST", "/api/ca/finish", ca.finish),
            ("POST", "/api/ca/export", ca.export),
        ),
    )


def _add_guarded(
    app: web.Application, ctx: AdminContext, routes: Iterable[tuple[str, str, Handler]]
) -> None:
    """``routes`` behind the admin guard (llmgw.server.admin.context.guarded)."""
    r = app.router
    for method, path, handler in routes:
        if method == "GET":
            r.add_get(path, guarded(ctx, handler))  # HEAD too, as aiohttp's add_get does
        else:
            r.add_route(method, path, guarded(ctx, handler))


def _routes(ctx: AdminContext) -> tuple[tuple[str, str, Handler], ...]:
    """Every guarded admin route but the CA's: (method, path, handler)."""
    nodes = NodeRoutes(ctx)
    gpus = GpuRoutes(ctx)
    models = ModelRoutes(ctx)
    access = AccessRoutes(ctx)
    software = SoftwareRoutes(ctx)
    instances = InstanceRoutes(ctx)
    metrics = MetricsRoutes(ctx)
    users = UserRoutes(ctx)
    return (
        ("GET", "/api/status", nodes.status),
        ("GET", "/api/nodes", nodes.nodes),
        ("GET", "/api/nodes/{node}", nodes.node),
        ("GET", "/api/models", models.models),
        ("POST", "/api/models", models.deploy),
        ("DELETE", "/api/models/{name:.+}", models.undeploy),
        ("GET", "/api/catalog", models.catalog),
        ("PUT", "/api/catalog", models.apply_catalog),
        ("GET", "/api/replicas", models.replicas),
        ("POST", "/api/replicas/{replica}/sleep", models.sleep),
        ("POST", "/api/replicas/{replica}/wake", models.wake),
        ("GET", "/api/keys", access.keys),
        ("POST", "/api/keys", access.create_key),
        ("GET", "/api/keys/{key}", access.key),
        ("PATCH", "/api/keys/{key}", access.update_key),
        ("DELETE", "/api/keys/{key}", access.revoke_key),
        ("GET", "/api/usage", access.usage),
        ("GET", "/api/events", nodes.events),
        ("POST", "/api/join-tokens", access.create_join_token),
        ("GET", "/api/join-tokens", access.join_tokens),
        ("DELETE", "/api/join-tokens/{token}", access.revoke_join_token),
        ("POST", "/api/nodes/{node}/approve", nodes.approve),
        ("POST", "/api/nodes/{node}/reject", nodes.reject),
        ("POST", "/api/nodes/{node}/revoke", nodes.revoke),
        ("POST", "/api/nodes/{node}/drain", nodes.drain),
        ("GET", "/api/nodes/{node}/drain", nodes.drain_status),
        ("POST", "/api/nodes/{node}/uncordon", nodes.uncordon),
        ("GET", "/api/gpus", gpus.all_gpus),
        ("GET", "/api/nodes/{node}/gpus", gpus.gpus),
        ("POST", "/api/nodes/{node}/gpus/cordon", gpus.cordon),
        ("POST", "/api/nodes/{node}/gpus/uncordon", gpus.uncordon),
        ("GET", "/api/engines", software.engines),
        ("POST", "/api/engines/install", software.install_engine),
        ("POST", "/api/engines/forget", software.forget_engine),
        ("GET", "/api/engines/installs", software.engine_installs),
        ("POST", "/api/updates", software.order_update),
        ("GET", "/api/updates", software.updates),
        ("PUT", "/api/admin/password", software.change_password),
        ("GET", "/api/instances", instances.instances),
        ("GET", "/api/whoami", users.whoami),
        ("GET", "/api/users", users.users),
        ("POST", "/api/users", users.add_user),
        ("PATCH", "/api/users/{name}", users.update_user),
        ("DELETE", "/api/users/{name}", users.remove_user),
        ("POST", "/api/instances/{instance}/retire", instances.retire),
        ("GET", "/api/metrics/history", metrics.history),
    )
