"""Who is signed in to the console: the session cookie resolved on every request, the
guards of pages (no session: to the login page) and of actions (a POST: this site's Origin,
the session's CSRF token, an admin), and the login and logout handlers.

The login form has no session yet, so its CSRF token is a pre-session cookie's value
(``llmgw_login``, SameSite=Strict, ten minutes) that the form carries back: a page on another
site can neither read it nor have the browser send it; and a POST whose Origin is another
site is refused first. Both, so that a browser that sends no Origin is still covered."""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import parse_qsl, quote

from aiohttp import web

from llmgw.bodies import read_body
from llmgw.errors import LlmgwError
from llmgw.log import kv
from llmgw.server.accounts.logins import LoginRefused, LoginSession, LoginThrottled
from llmgw.server.accounts.principals import PRINCIPAL
from llmgw.server.console.security import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    clear_cookie,
    csrf_matches,
    foreign_origin,
    local_next,
    set_cookie,
)
from llmgw.server.console.site import SESSION, Site, html_response
from llmgw.server.ha.proxies import login_source

__all__ = ["FORM", "ConsoleAuth", "form_of"]

log = logging.getLogger("llmgw.server.console")

KIND: Final = "console"
FORM: Final = web.RequestKey("llmgw.console.form", dict[str, str])
"""The request key of a POST's form fields, read once by the action guard."""
MAX_FORM = 64 * 1024
MAX_FIELDS = 64
LOGIN_FORM_TTL = 600
MAX_NAME = 128
MAX_PASSWORD = 1024

SessionHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def form_of(request: web.Request) -> dict[str, str]:
    """The form fields the action guard read (the first value of each name)."""
    found = request.get(FORM)
    if found is None:
        raise RuntimeError(f"{request.path}: no form on the request; route it through a guard")
    return found


async def read_form(site: Site, request: web.Request) -> dict[str, str]:
    """A POST's ``application/x-www-form-urlencoded`` body, under the console's limit and
    the process's body budget."""
    raw = await read_body(request, MAX_FORM, site.ctx.bodies)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    finally:
        site.ctx.bodies.give(len(raw))
    fields: dict[str, str] = {}
    try:
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=MAX_FIELDS)
    except ValueError:
        pairs = []
    for name, value in pairs:
        fields.setdefault(name, value)
    return fields


def _malformed(request: web.Request) -> bool:
    """Whether the session cookie is there but not even ASCII (no token ever is)."""
    token = request.cookies.get(SESSION_COOKIE)
    return token is not None and not token.isascii()


def _wait_text(seconds: int) -> str:
    """A lock's remaining time as a person reads it: ``45 s``, ``15 min``."""
    return f"{seconds} s" if seconds < 120 else f"{math.ceil(seconds / 60)} min"


class ConsoleAuth:
    """The console's guards and its login, logout handlers."""

    def __init__(self, site: Site) -> None:
        self.site = site

    # -- sessions --------------------------------------------------------------------------------

    def session_of(self, request: web.Request) -> tuple[str, LoginSession] | None:
        token = request.cookies.get(SESSION_COOKIE)
        if not token:
            return None
        session = self.site.logins.resolve(token, KIND)
        return None if session is None else (token, session)

    def bad_cookie(self, request: web.Request) -> web.Response | None:
        """400 for a session cookie that is no text at all (bytes that are not UTF-8): no
        session was ever given one, so it is a broken or forged cookie, cleared here."""
        if not _malformed(request):
            return None
        log.info(
            "refused a console request with a malformed session cookie",
            extra=kv(path=request.path[:100], peer=request.remote or ""),
        )
        out = self.site.error_page(
            request,
            400,
            "Bad cookie",
            "this browser sent a session cookie that is not valid text; it has been cleared: "
            "sign in again at /ui/login",
        )
        clear_cookie(out, SESSION_COOKIE, secure=self.site.secure)
        return out

    def _sign_in(self, request: web.Request, token: str, session: LoginSession) -> None:
        request[SESSION] = (token, session)
        request[PRINCIPAL] = session.principal  # via console: the session's kind

    def to_login(self, request: web.Request) -> web.Response:
        """303 to the login page, coming back here afterwards; a cookie that no longer
        names a session (expired, signed out elsewhere, its account removed) is cleared and
        the login page says the session expired."""
        target = f"/ui/login?next={quote(local_next(request.path_qs), safe='')}"
        expired = bool(request.cookies.get(SESSION_COOKIE))
        if expired:
            target += "&expired=1"
        out = web.Response(status=303, headers={"Location": target})
        if expired:
            clear_cookie(out, SESSION_COOKIE, secure=self.site.secure)
        return out

    def page(self, handler: SessionHandler) -> SessionHandler:
        """A page (GET): signed in, or to the login page."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            found = self.session_of(request)
            if found is None:
                return self.bad_cookie(request) or self.to_login(request)
            self._sign_in(request, *found)
            return await handler(request)

        return guarded

    def action(self, handler: SessionHandler, *, admin: bool = True) -> SessionHandler:
        """A state-changing POST: from this site (Origin), signed in, with the session's
        CSRF token (form field ``csrf`` or header ``X-CSRF-Token``), by an admin (a viewer
        reads only; checked here, not only by hiding buttons). Its form is read here."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            site = self.site
            if foreign_origin(request.headers.get("Origin"), request.host, site.ctx.http_scheme):
                log.info(
                    "refused a console POST from another origin",
                    extra=kv(path=request.path[:100], peer=request.remote or ""),
                )
                return site.error_page(
                    request,
                    403,
                    "Refused",
                    "this request came from another site's page; use the console's own "
                    "pages (reload it and try again)",
                )
            found = self.session_of(request)
            if found is None:
                return self.bad_cookie(request) or self.to_login(request)
            self._sign_in(request, *found)
            form = await read_form(site, request)
            request[FORM] = form
            sent = form.get("csrf") or request.headers.get("X-CSRF-Token")
            if not csrf_matches(sent, found[1].csrf):
                log.info(
                    "refused a console POST without its CSRF token",
                    extra=kv(path=request.path[:100], operator=found[1].operator),
                )
                return site.error_page(
                    request,
                    403,
                    "Form expired",
                    "this form's security token is missing or out of date; reload the page "
                    "and submit it again",
                )
            if admin and found[1].role != "admin":
                log.info(
                    "refused a viewer's console action",
                    extra=kv(path=request.path[:100], operator=found[1].operator),
                )
                return site.error_page(
                    request,
                    403,
                    "Not allowed",
                    f"the account {found[1].operator} is a viewer and may only read; ask an "
                    "admin to act, or to give it the admin role (llmgw ctl users role)",
                )
            return await handler(request)

        return guarded

    # -- login and logout -----------------------------------------------------------------------

    def _login_page(
        self,
        request: web.Request,
        *,
        next_path: str,
        status: int = 200,
        problem: str = "",
        notice: str = "",
        name: str = "",
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        token = secrets.token_urlsafe(32)
        body = self.site.renderer.render(
            "login.html",
            nav=(),
            principal=None,
            flash=None,
            csrf=token,
            next_path=next_path,
            problem=problem,
            notice=notice,
            name=name,
            refresh_s=self.site.refresh_s,
            cleartext=self.site.cleartext,
        )
        response = html_response(body, status=status)
        for key, value in (headers or {}).items():
            response.headers[key] = value
        set_cookie(response, LOGIN_COOKIE, token, max_age=LOGIN_FORM_TTL, secure=self.site.secure)
        return response

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        next_path = local_next(request.query.get("next"))
        if self.session_of(request) is not None:
            return web.Response(status=303, headers={"Location": next_path})
        notice = (
            "your session expired, sign in again" if request.query.get("expired") == "1" else ""
        )
        if request.query.get("signed_out") == "1":
            notice = "signed out"
        page = self._login_page(request, next_path=next_path, notice=notice)
        if _malformed(request):  # the form still shows; the broken cookie goes
            clear_cookie(page, SESSION_COOKIE, secure=self.site.secure)
        return page

    async def login(self, request: web.Request) -> web.StreamResponse:
        site = self.site
        if foreign_origin(request.headers.get("Origin"), request.host, site.ctx.http_scheme):
            return self._login_page(
                request,
                next_path="/ui/",
                status=403,
                problem="this sign-in came from another site's page; sign in here",
            )
        form = await read_form(site, request)
        next_path = local_next(form.get("next"))
        if not csrf_matches(form.get("csrf"), request.cookies.get(LOGIN_COOKIE, "")):
            return self._login_page(
                request,
                next_path=next_path,
                status=403,
                problem="the sign-in form expired; sign in again",
            )
        name = form.get("name", "")[:MAX_NAME]
        password = form.get("password", "")
        if not name or not password:
            return self._login_page(
                request,
                next_path=next_path,
                status=400,
                problem="give the account's name and its password",
                name=name,
            )
        try:
            token, session = await site.logins.login(
                name,
                password[:MAX_PASSWORD],
                # Through a standby, the browser's (LeaderProxy signs it), not the standby's.
                addr=login_source(request, site.ctx.admin_token),
                kind=KIND,
                agent=request.headers.get("User-Agent", "")[:200],
            )
        except LoginThrottled as exc:
            wait = max(1, math.ceil(exc.retry_after))
            return self._login_page(
                request,
                next_path=next_path,
                status=429,
                problem=f"too many failed sign-ins; try again in {_wait_text(wait)}",
                name=name,
                headers={"Retry-After": str(wait)},
            )
        except LoginRefused:
            return self._login_page(
                request,
                next_path=next_path,
                status=401,
                problem="wrong name or password",
                name=name,
            )
        except LlmgwError as exc:
            return self._login_page(
                request, next_path=next_path, status=503, problem=str(exc), name=name
            )
        log.info(
            "signed in to the console",
            extra=kv(operator=session.operator, peer=request.remote or ""),
        )
        response = web.Response(status=303, headers={"Location": next_path})
        set_cookie(
            response,
            SESSION_COOKIE,
            token,
            # Never beyond the session's absolute expiry (both times the logins' clock's).
            max_age=int(session.expires_at - session.created_at),
            secure=site.secure,
        )
        clear_cookie(response, LOGIN_COOKIE, secure=site.secure)
        return response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        """POST /ui/logout (a viewer may sign out too: the action guard without the role)."""
        token, session = request[SESSION]
        self.site.logins.logout(token)
        log.info("signed out of the console", extra=kv(operator=session.operator))
        response = web.Response(status=303, headers={"Location": "/ui/login?signed_out=1"})
        clear_cookie(response, SESSION_COOKIE, secure=self.site.secure)
        return response
