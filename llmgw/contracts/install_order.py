"""What an engine install order (``InstallEngine``) may carry, one rule read by both sides:
the control plane refuses a desired build that no node would install, and the agent checks
each order it is sent against the same rule.

The fields: a version (1-64 letters, digits, ``.``, ``_``, ``+``, ``-``), a SHA-256 (64 hex
digits, kept lowercase), a URL the nodes may fetch (https://, or http:// and file:// from
the places a node lists in ``install_sources``; :func:`url_problem`), and an architecture in
``uname -m`` spelling (:func:`canonical_arch`, from the one table of architectures,
:data:`llmgw.contracts.update_order.ARCHES`). What a refusal says is each side's own: the
control plane tells an operator what to type, the agent what the order got wrong.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from llmgw.contracts.sources import SOURCE_SCHEMES, split_url
from llmgw.contracts.update_order import ARCHES

__all__ = [
    "ARCH",
    "ARCH_ALIASES",
    "MAX_URL",
    "SHA256",
    "URL_SCHEMES",
    "VERSION",
    "canonical_arch",
    "display_url",
    "url_problem",
    "url_shape_ok",
]

VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
"""An engine version: what names the install's folder, ``engines/<engine>/<version>/``."""
SHA256 = re.compile(r"[0-9a-fA-F]{64}")
ARCH = re.compile(r"[a-z0-9_]{1,32}")
"""An architecture as ``uname -m`` prints it, once :func:`canonical_arch` has spelt it."""
URL_SCHEMES = SOURCE_SCHEMES
"""What the agent fetches: https:// always, http:// and file:// from its install_sources."""
MAX_URL = 4096

ARCH_ALIASES: dict[str, str] = {
    alias: machines[0] for bundle, machines in ARCHES.items() for alias in (bundle, *machines)
}
"""Every spelling of an architecture llmgw knows (a release bundle's ``x64``, Debian's
``amd64``, ...) -> its ``uname -m`` spelling, the one stored and compared."""


def canonical_arch(name: str) -> str:
    """``uname -m`` spelling of an architecture: amd64 and x64 are x86_64, arm64 aarch64;
    one llmgw does not know is kept as given (lower case)."""
    name = name.strip().lower()
    return ARCH_ALIASES.get(name, name)


def display_url(url: str) -> str:
    """``url`` without user info or query (a signed URL's credentials), for showing."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return url.split("?", 1)[0]
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "…" if parts.query else "", ""))


def url_shape_ok(url: str) -> bool:
    """Whether ``url`` has a scheme the nodes fetch, at most :data:`MAX_URL` characters and
    no space or control character (the first thing an operator gets wrong)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    return scheme in URL_SCHEMES and len(url) <= MAX_URL and url.isprintable() and " " not in url


def url_problem(url: str) -> str | None:
    """Why no node fetches ``url`` for an install order, whatever its ``install_sources``
    (the prefixes a node lists decide the rest); None when some node may."""
    try:
        split_url(url)
    except ValueError as exc:  # urlsplit's own, for a malformed [IPv6] host, too
        return str(exc)
    if not url_shape_ok(url):
        return f"a URL is at most {MAX_URL} characters, without spaces or control characters"
    return None
