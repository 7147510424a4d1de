"""The admin API's operator accounts: list, add, change (role, password), remove. The
admin token is the actor these routes record (the console's sessions will name their
account instead)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from llmgw.errors import PasswordError
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.operators import TOKEN_ACTOR
from llmgw.server.store import Operator

__all__ = ["UserRoutes", "operator_json"]

_FIELDS = {"name", "role", "password"}


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

    async def users(self, request: web.Request) -> web.Response:
        return web.json_response([operator_json(o) for o in self.ctx.store.list_operators()])

    async def add_user(self, request: web.Request) -> web.Response:
        body = _fields(await read_json(self.ctx, request), _FIELDS)
        name, role = _text(body, "name"), _text(body, "role")
        with _refusals():
            made = await self.ctx.operators.add(name, role, body.get("password"), actor=TOKEN_ACTOR)
        return web.json_response(operator_json(made), status=201)

    async def update_user(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        body = _fields(await read_json(self.ctx, request), {"role", "password"})
        if not body:
            raise BadRequest("nothing to change: give role, password or both")
        role = _text(body, "role") if "role" in body else None
        if "password" in body and body["password"] is None:
            raise BadRequest("password must be a string")
        with _refusals():
            operator = await self.ctx.operators.update(
                name, role=role, password=body.get("password"), actor=TOKEN_ACTOR
            )
        return web.json_response(operator_json(operator))

    async def remove_user(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        removed = self.ctx.operators.remove(name, actor=TOKEN_ACTOR)
        return web.json_response({"removed": removed.name})


class _refusals:
    """A value the accounts refuse (a bad name or role, a short password) is the request's
    fault: 400, not the wrong-password 403."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, ValueError | PasswordError):
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
