"""The admin API's sign-in for ``llmgw ctl login``: ``POST /api/login`` trades an account's
name and password for a token of the account's own (a login session of kind ``cli``, with
the idle and absolute expiry of server.yaml's ``console:`` section), rate-limited per source
address and per account like the console's sign-in (:mod:`llmgw.server.accounts.lockout`);
``POST /api/logout`` ends the token it is sent with (a viewer's too).

A login sent with a valid ctl credential of the account it signs in to (``llmgw ctl login``
sends the token it holds: the account's own login, or the admin token for ``admin``) is
*vouched*: from an address that has not failed, it is checked although the account is
locked, so that a guesser who keeps an account locked does not lock its owner out."""

from __future__ import annotations

from aiohttp import web

from llmgw.server.accounts.logins import LoginRefused, LoginThrottled
from llmgw.server.accounts.principals import VIA_CLI
from llmgw.server.admin.context import (
    AdminContext,
    BadRequest,
    authenticate,
    error_response,
    login_token,
    read_json,
)
from llmgw.server.common.httpapi import bearer_token
from llmgw.server.ha.proxies import login_source

__all__ = ["LoginRoutes"]

MAX_AGENT = 200


class LoginRoutes:
    """POST /api/login, POST /api/logout."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    async def login(self, request: web.Request) -> web.Response:
        body = await read_json(self.ctx, request)
        unknown = sorted(set(body) - {"name", "password"})
        if unknown:
            raise BadRequest(f"unknown field {unknown[0]!r}; a login takes name and password")
        name, password = body.get("name"), body.get("password")
        if not isinstance(name, str) or not name or not isinstance(password, str):
            raise BadRequest("a login takes 'name' (the account) and 'password', both strings")
        holder = authenticate(self.ctx, request)  # the credential ctl already holds
        try:
            token, session = await self.ctx.logins.login(
                name,
                password,
                # Through a standby, the client's (LeaderProxy signs it), not the standby's.
                addr=login_source(request, self.ctx.admin_token),
                kind=VIA_CLI,
                agent=request.headers.get("User-Agent", "")[:MAX_AGENT],
                vouched=holder is not None and holder.password_account == name,
            )
        except LoginThrottled as exc:
            answer = error_response(429, str(exc), "too_many_logins")
            answer.headers["Retry-After"] = str(exc.retry_after)
            return answer
        except LoginRefused as exc:
            return error_response(401, str(exc), "wrong_login")
        return web.json_response(
            {
                "token": token,
                "account": session.operator,
                "role": session.role,
                "expires_at": session.expires_at,
            },
            status=201,
        )

    async def logout(self, request: web.Request) -> web.Response:
        raw = bearer_token(request)
        token = "" if raw is None else login_token(raw)
        if self.ctx.logins.resolve(token, VIA_CLI) is None:
            return error_response(
                401,
                "no login to end: send the token 'llmgw ctl login' gave (it may have lapsed "
                "or been ended already)",
                "unauthorized",
            )
        self.ctx.logins.logout(token)
        return web.json_response({"logged_out": True})
