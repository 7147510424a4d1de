"""What every console handler shares: the collaborators (:class:`Site`), the HTML answer
with its security headers and the page's common parts (the nav, the signed-in account, the
flash message), and the HTML error pages a /ui/ failure is answered with (the JSON error
middleware of :mod:`llmgw.server.common.httpapi` answers everywhere else)."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from aiohttp import web

from llmgw.bodies import BodiesBusy, BodyIncomplete, BodyTimeout, BodyTooLarge
from llmgw.errors import (
    ConfigError,
    Conflict,
    LlmgwError,
    NotFound,
    PasswordError,
    StoreUnavailable,
    WeakPassword,
)
from llmgw.log import kv
from llmgw.server.accounts.logins import Logins, LoginSession, LoginThrottled
from llmgw.server.accounts.principals import PRINCIPAL
from llmgw.server.admin.context import AdminContext, BadRequest
from llmgw.server.console.render import Renderer
from llmgw.server.console.security import secure_headers

__all__ = ["NAV", "SESSION", "Flash", "Handler", "Site", "handled"]

log = logging.getLogger("llmgw.server.console")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SESSION: Final = web.RequestKey("llmgw.console.session", tuple[str, LoginSession])
"""The request key of the console session a guard resolved: (cookie token, LoginSession)."""

NAV: Final = (
    ("overview", "Overview", "/ui/"),
    ("nodes", "Nodes", "/ui/nodes"),
    ("add-node", "Add node", "/ui/add-node"),
    ("approve", "Approve", "/ui/approve"),
    ("models", "Models", "/ui/models"),
    ("keys", "API keys", "/ui/keys"),
    ("events", "Events", "/ui/events"),
    ("update", "Update", "/ui/update"),
)
"""Every page of the console, in the nav's order: (id, label, path)."""

MAX_FLASHES = 4096


class Flash:
    """One-shot messages after a POST (Post/Redirect/Get), kept in memory per session and
    shown by the next page that session loads. In memory, not in a cookie: nothing signed to
    manage, no user text in a header; a message lost to a restart is only a notice. Keyed by
    the session token's hash, bounded (the oldest go)."""

    def __init__(self, limit: int = MAX_FLASHES) -> None:
        self.limit = limit
        self._messages: OrderedDict[str, tuple[str, str]] = OrderedDict()

    @staticmethod
    def _key(token: str) -> str:
        return hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()

    def put(self, token: str, message: str, *, level: str = "info") -> None:
        key = self._key(token)
        self._messages.pop(key, None)
        self._messages[key] = (level, message)
        while len(self._messages) > self.limit:
            self._messages.popitem(last=False)

    def take(self, token: str) -> tuple[str, str] | None:
        return self._messages.pop(self._key(token), None)


@dataclass
class Site:
    """The console's collaborators: the admin API's context (the fleet), the login
    sessions, the templates, the flash messages."""

    ctx: AdminContext
    logins: Logins
    renderer: Renderer
    flash: Flash = field(default_factory=Flash)
    # Seconds between two fragment fetches of a live part of a page (console.js reads it).
    refresh_s: int = 5
    # The listener serves plain HTTP beyond loopback: the login page says the password
    # travels in clear.
    cleartext: bool = False

    @property
    def secure(self) -> bool:
        return self.ctx.http_scheme == "https"

    def page(
        self, request: web.Request, template: str, *, status: int = 200, **values: Any
    ) -> web.Response:
        """A whole page: ``template`` with the common parts filled in."""
        principal = request.get(PRINCIPAL)  # None on the login and error pages before it
        session = request.get(SESSION)
        flash = self.flash.take(session[0]) if session is not None else None
        body = self.renderer.render(
            template,
            nav=NAV,
            principal=principal,
            csrf=session[1].csrf if session is not None else "",
            flash=flash,
            refresh_s=self.refresh_s,
            **values,
        )
        return html_response(body, status=status)

    def fragment(self, template: str, **values: Any) -> web.Response:
        """A live part of a page, re-fetched by console.js (no layout around it)."""
        return html_response(self.renderer.render(template, **values))

    def error_page(
        self, request: web.Request, status: int, title: str, message: str
    ) -> web.Response:
        return self.page(request, "error.html", status=status, title=title, message=message)


def html_response(body: str, *, status: int = 200) -> web.Response:
    response = web.Response(text=body, status=status, content_type="text/html", charset="utf-8")
    secure_headers(response)
    return response


def handled(site: Site, handler: Handler) -> Handler:
    """``handler`` with its failures answered as HTML pages (never the gateway's JSON): a
    missing thing 404, a conflict 409, the database away 503, a bug 500 with its traceback
    in the log only. Every answer carries the security headers."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        path = request.path[:100]
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            # aiohttp's own (a body over client_max_size): its reason, as a page.
            response = site.error_page(request, exc.status, exc.reason, _http_hint(exc))
        except BodyTooLarge:
            response = site.error_page(
                request, 413, "Too large", "the form is larger than the console takes; send less"
            )
        except (BodiesBusy, BodyTimeout, BodyIncomplete) as exc:
            status = (
                408 if isinstance(exc, BodyTimeout) else 503 if isinstance(exc, BodiesBusy) else 400
            )
            response = site.error_page(request, status, "Not received", f"{exc}; try again")
        except (BadRequest, ConfigError, WeakPassword) as exc:  # what was sent cannot be used
            response = site.error_page(request, 400, "Not accepted", str(exc))
        except PasswordError as exc:
            response = site.error_page(request, 403, "Wrong password", str(exc))
        except LoginThrottled as exc:
            response = site.error_page(request, 429, "Locked", str(exc))
            response.headers["Retry-After"] = str(exc.retry_after)
        except NotFound as exc:
            response = site.error_page(request, 404, "Not found", str(exc))
        except Conflict as exc:
            response = site.error_page(request, 409, "Conflict", str(exc))
        except StoreUnavailable as exc:
            response = site.error_page(request, 503, "Database unreachable", str(exc))
        except LlmgwError as exc:
            log.warning("a console page failed", extra=kv(path=path, error=str(exc)[:200]))
            response = site.error_page(request, 500, "Error", str(exc))
        except Exception:
            log.exception(
                "a console handler failed",
                extra=kv(method=request.method[:16], path=path, peer=request.remote or ""),
            )
            response = site.error_page(
                request,
                500,
                "Server error",
                "the control plane failed on this page; its operator finds why in its log. "
                "Reload to try again.",
            )
        if "Content-Security-Policy" not in response.headers and not response.prepared:
            secure_headers(response, cache=response.headers.get("Cache-Control", "no-store"))
        return response

    return wrapped


def _http_hint(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return "the request is too large for the console; send less"
    if exc.status == 405:
        return "this address does not take that method; use the page's own links and buttons"
    return f"{exc.reason}; go back to the overview and try again"
