"""Where a node may download from: the ``install_sources:`` of agent.yaml, for engine
installs and for model sources fetched into its cache.

An install order (or a profile's ``source: {url, sha256}``) names a URL the control plane
chose; the node decides whether to fetch it, and the control plane, from the prefixes the
node reports, which nodes would (:func:`fetchable`): one rule, read by both sides.
``https://`` URLs are fetched (the server verified against the system trust store and the
cluster CA); plain ``http://`` and ``file://`` URLs only when they start with a prefix the
operator listed in ``install_sources``; redirects are followed only to ``https://`` URLs
that start with a listed prefix. A prefix matches on scheme, host and port exactly and on
whole path segments (``https://h/releases`` covers ``/releases`` and ``/releases/…``,
never ``/releases-old``); a URL with ``.`` or ``..`` segments matches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from llmgw.configfile import Checker, index_key

__all__ = [
    "SOURCE_SCHEMES",
    "SourcePrefix",
    "allowed",
    "fetchable",
    "parse_prefix",
    "parse_prefixes",
    "split_url",
]

SOURCE_SCHEMES = ("https", "http", "file")
_DEFAULT_PORTS = {"https": 443, "http": 80}


@dataclass(frozen=True)
class SourcePrefix:
    """One ``install_sources`` entry: what a URL must start with."""

    scheme: str
    host: str  # lowercase; "" for file://
    port: int | None  # the effective port; None for file://
    path: str  # decoded, absolute
    text: str  # as the operator wrote it

    def covers(self, url: str) -> bool:
        try:
            scheme, host, port, path = split_url(url)
        except ValueError:
            return False
        if (scheme, host, port) != (self.scheme, self.host, self.port):
            return False
        base = self.path.rstrip("/")
        return path == self.path or path == base or path.startswith(base + "/")


def split_url(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, effective port, decoded path) of a URL that can be matched against a
    prefix; a ``ValueError`` says why it cannot."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in SOURCE_SCHEMES:
        raise ValueError("only https://, http:// and file:// URLs are allowed")
    path = unquote(parts.path) or "/"
    if not path.startswith("/"):
        raise ValueError("the path must be absolute")
    if "\\" in path or any(seg in (".", "..") for seg in path.split("/")):
        raise ValueError("the path must not have '.' or '..' segments or backslashes")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"the port is not a number 1-65535 ({exc})") from None
    host = (parts.hostname or "").lower()
    if scheme == "file":
        if host not in ("", "localhost") or port is not None:
            raise ValueError("a file:// URL names a path on this node: file:///DIR/…")
        return scheme, "", None, path
    if not host:
        raise ValueError(f"a {scheme}:// URL needs a host")
    return scheme, host, port or _DEFAULT_PORTS[scheme], path


def parse_prefix(text: str) -> SourcePrefix:
    """An ``install_sources`` entry, checked; a ``ValueError`` says what is wrong with it."""
    parts = urlsplit(text.strip())
    if parts.username is not None or parts.password is not None:
        raise ValueError("a prefix must not carry a user name or password")
    if parts.query or parts.fragment or text.strip().endswith(("?", "#")):
        raise ValueError("a prefix ends at the path: no '?query' or '#fragment'")
    scheme, host, port, path = split_url(text)
    return SourcePrefix(scheme=scheme, host=host, port=port, path=path, text=text.strip())


def parse_prefixes(
    check: Checker, value: object, key: str, *, example: str, schemes: tuple[str, ...] = ()
) -> tuple[SourcePrefix, ...]:
    """A settings file's list of source prefixes at ``key`` (none when absent), each checked,
    and of one of ``schemes`` when given; the refusal names the entry and shows ``example``."""
    if value is None:
        return ()
    prefixes: list[SourcePrefix] = []
    for index, item in enumerate(check.strings(value, key)):
        entry = index_key(key, index)
        try:
            prefix = parse_prefix(item)
        except ValueError as exc:
            check.fail(entry, f"{item!r} is not a URL prefix: {exc}; give one like {example}")
        if schemes and prefix.scheme not in schemes:
            check.fail(
                entry,
                f"{item!r} has scheme {prefix.scheme}; {key} takes "
                f"{' or '.join(s + '://' for s in schemes)} URLs, like {example}",
            )
        prefixes.append(prefix)
    return tuple(prefixes)


def allowed(url: str, prefixes: tuple[SourcePrefix, ...], *, schemes: tuple[str, ...]) -> bool:
    """Whether ``url`` starts with one of ``prefixes`` whose scheme is in ``schemes``."""
    return any(p.scheme in schemes and p.covers(url) for p in prefixes)


def fetchable(url: str, prefixes: tuple[SourcePrefix, ...]) -> bool:
    """Whether a node whose ``install_sources`` are ``prefixes`` fetches ``url``: any
    ``https://`` URL, and an ``http://`` or ``file://`` one that a prefix of its scheme covers.
    A URL that cannot be matched (another scheme, ``..`` segments) is never fetched."""
    try:
        scheme = split_url(url)[0]
    except ValueError:
        return False
    return scheme == "https" or allowed(url, prefixes, schemes=(scheme,))
