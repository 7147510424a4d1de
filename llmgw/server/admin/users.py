"""The admin API's operator accounts: list, add, change (role, password), remove. The
caller (an account, or the admin token) is the actor these routes record. Making an admin
(adding one, promoting one, setting an admin's password) also takes ``confirm_password``:
the caller's own password (the admin password with the admin token), since an admin
account's password signs updates (llmgw.server.accounts.operators)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llmgw.errors import WeakPassword
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.ha.proxies import login_source
from llmgw.server.store import Operator

__all__ = ["UserRoutes", "operator_json"]

_FIELDS = {"name", "role", "password", "confirm_password"}


def operator_json(operator: Operator) -> dict[str, Any]:
    """An account as the API shows it: never its hash."""
    return {
        "name": operator.name,
        "role": operator.role,
        "created_at": operator.created_at,
        "created_by": operator.created_by,
        "password_changed_at": operator.password_changed_at,
    }


class UserRoutes:
    """GET/POST /api/users, PATCH/DELETE /api/users/{name}."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    async def whoami(self, request: web.Request) -> web.Response:
        """Who the credential acts as: ``{"name", "role", "via"}``."""
        by = principal_of(request)
        return web.json_response({"name": by.name, "role": by.role, "via": by.via})

    async def users(self, request: web.Request) -> web.Response:
        return web.json_response([operator_json(o) for o in self.ctx.store.list_operators()])

    async def add_user(self, request: web.Request) -> web.Response:
        body = _fields(await read_json(self.ctx, request), _FIELDS)
        name, role = _text(body, "name"), _text(body, "role")
        by = principal_of(request)
        with _refusals():
            made = await self.ctx.operators.add(
                name,
                role,
                body.get("password"),
                actor=by.actor,
                confirm_as=by.password_account,
                confirm_password=body.get("confirm_password"),
                source=login_source(request, self.ctx.admin_token),
            )
        return web.json_response(operator_json(made), status=201)

    async def update_user(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = _fields(await read_json(self.ctx, request), {"role", "password", "confirm_password"})
        if not set(body) - {"confirm_password"}:
            raise BadRequest("nothing to change: give role, password or both")
        role = _text(body, "role") if "role" in body else None
        if "password" in body and body["password"] is None:
            raise BadRequest("password must be a string")
        by = principal_of(request)
        with _refusals():
            operator = await self.ctx.operators.update(
                name,
                role=role,
                password=body.get("password"),
                actor=by.actor,
                confirm_as=by.password_account,
                confirm_password=body.get("confirm_password"),
                source=login_source(request, self.ctx.admin_token),
            )
        return web.json_response(operator_json(operator))

    async def remove_user(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        removed = self.ctx.operators.remove(name, actor=principal_of(request).actor)
        return web.json_response({"removed": removed.name})


class _refusals:
    """A value the accounts refuse (a bad name or role, a short password) is the request's
    fault: 400, not the wrong-password 403 (a wrong confirm_password)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, ValueError | WeakPassword):
            raise BadRequest(str(exc)) from exc


def _fields(body: dict[str, Any], allowed: set[str]) -> dict[str, Any]:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(
            f"unknown field {unknown[0]!r}; an account takes {', '.join(sorted(allowed))}"
        )
    return body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{key} must be a string")
    return value
