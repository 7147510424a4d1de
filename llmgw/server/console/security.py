"""What keeps the console safe to open in a browser: the headers on every /ui/ answer, the
cookies' attributes, the CSRF token's check, the Origin check of a POST, and the one
``next`` a login may go back to.

Pure functions and constants; :mod:`.auth` applies them to requests."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from aiohttp import web

__all__ = [
    "CSP",
    "LOGIN_COOKIE",
    "SECURITY_HEADERS",
    "SESSION_COOKIE",
    "csrf_matches",
    "foreign_origin",
    "local_next",
    "secure_headers",
    "set_cookie",
]

CSP: Final = (
    "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'"
)
"""No inline script or style, nothing from elsewhere, never framed: what a page holding
action buttons must be."""

SECURITY_HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": CSP,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}

SESSION_COOKIE: Final = "llmgw_session"
LOGIN_COOKIE: Final = "llmgw_login"
"""The pre-session cookie of the login form: its value is the form's CSRF token."""
COOKIE_PATH: Final = "/ui/"
MAX_NEXT: Final = 2000


def secure_headers(response: web.StreamResponse, *, cache: str = "no-store") -> None:
    """The security headers, and ``cache`` (pages: ``no-store``; a versioned static file: a
    year)."""
    for name, value in SECURITY_HEADERS.items():
        response.headers[name] = value
    response.headers["Cache-Control"] = cache


def set_cookie(
    response: web.StreamResponse, name: str, value: str, *, max_age: int, secure: bool
) -> None:
    """A console cookie: HttpOnly (no script reads it), SameSite=Strict (no other site's
    page sends it), Path=/ui/ (the gateway and the admin API never see it), Secure over
    HTTPS, living ``max_age`` seconds at most."""
    response.set_cookie(
        name,
        value,
        max_age=max(0, max_age),
        path=COOKIE_PATH,
        httponly=True,
        samesite="Strict",
        secure=secure,
    )


def clear_cookie(response: web.StreamResponse, name: str, *, secure: bool) -> None:
    set_cookie(response, name, "", max_age=0, secure=secure)


def csrf_matches(sent: str | None, expected: str) -> bool:
    """Whether the token a request sent is the session's, in constant time. Either may come
    from a cookie that was not UTF-8 (aiohttp keeps such bytes as surrogates): compared as
    the bytes sent, it can only fail."""
    if not sent or not expected:
        return False
    return hmac.compare_digest(
        sent.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape")
    )


def foreign_origin(origin: str | None, host: str | None, scheme: str) -> bool:
    """Whether a request's ``Origin`` header is present and names another site than this
    host (a browser sends it on every cross-site POST; "null" is an opaque origin: refused)."""
    if origin is None:
        return False
    if not host:
        return True
    parts = urlsplit(origin)
    return (
        parts.scheme != scheme
        or parts.netloc.lower() != host.lower()
        or origin != (f"{parts.scheme}://{parts.netloc}")
    )


def local_next(value: str | None) -> str:
    """Where a login goes back to: a path of the console (``/ui/...``), else ``/ui/``. A
    scheme, a host, ``//``, a backslash or a control character make it someone else's."""
    default = "/ui/"
    if not value or len(value) > MAX_NEXT:
        return default
    if not value.startswith("/ui/") and value != "/ui":
        return default
    if "\\" in value or any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        return default
    parts = urlsplit(value)
    if parts.scheme or parts.netloc or value.startswith("//"):
        return default
    if "/../" in parts.path or parts.path.endswith("/.."):
        return default
    return value
