"""A model's tokenizer files as the control plane gets them: read from its own disk (a
profile's ``path:``) or fetched once from a URL into ``<state_dir>/tokenizers/<sha256>``,
each checked by its SHA-256 (a URL's always), under rules that keep the fetch from being an
oracle for whoever writes the catalog or reads a model's problem (viewers too).

Where from. An ``https://`` URL is fetched when its host is, and resolves to, public
addresses only (no loopback, private, link-local, shared or reserved ones); an ``http://``
URL, or one on such an address, only under a prefix server.yaml's ``tokenizer_sources``
lists (the syntax of agent.yaml's ``install_sources``, :mod:`llmgw.contracts.sources`). The
address is checked again on the connected socket (a name that resolves elsewhere the second
time gains nothing), except through a proxy (``https_proxy``), which connects for us. A
redirect is followed only within the same scheme, host and port, or to a listed prefix, at
most :data:`MAX_REDIRECTS` times. A path inside the state directory or naming one of the
control plane's secrets (its tokens, the database password, the TLS key) is never read.

What is said. A failure is "download failed", "read failed" or "checksum mismatch" with the
fix, never the status, the connection's error or a digest: those go to the server's log.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import ipaddress
import logging
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from llmgw.contracts.catalog import FileRef
from llmgw.contracts.sources import SourcePrefix, allowed
from llmgw.errors import FileError, TokenizerError
from llmgw.fsutil import atomic_write, make_dir
from llmgw.log import kv

__all__ = ["MAX_FILE_BYTES", "MAX_REDIRECTS", "TokenizerFiles"]

log = logging.getLogger("llmgw.server.tokenizer_files")

MAX_FILE_BYTES = 64 << 20
"""The largest tokenizer or chat template file read or fetched (a tokenizer.json is a few
MiB; Llama 3's is 9)."""
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})

Resolver = Callable[[str], list[str]]


class _Refused(Exception):
    """Why a URL or an address is not fetched from (for the log only)."""


def _resolve(host: str) -> list[str]:
    return [str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]


def _public(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global


class TokenizerFiles:
    """Reads a profile's files: ``cache_dir`` (``<state_dir>/tokenizers``) keeps what was
    fetched (None: URLs are refused), ``sources`` are server.yaml's ``tokenizer_sources``,
    ``private`` the directories and files never read (the state directory, the secrets)."""

    def __init__(
        self,
        cache_dir: Path | None,
        *,
        sources: Iterable[SourcePrefix] = (),
        private: Iterable[Path] = (),
        fetch_timeout: float = 30.0,
        max_bytes: int = MAX_FILE_BYTES,
        resolve: Resolver = _resolve,
    ) -> None:
        self.cache_dir = cache_dir
        self.sources = tuple(sources)
        self.private = tuple(private)
        self.fetch_timeout = fetch_timeout
        self.max_bytes = max_bytes
        self.resolve = resolve
        self.fetches = 0

    def read(self, ref: FileRef, model: str, key: str) -> bytes:
        """The bytes of ``ref`` (the profile's ``key``), checked by its SHA-256."""
        where = f"model {model}: {key} {ref.location}"
        if not ref.is_url:
            data = self._read_profile_path(Path(ref.location), where, key)
            _check(
                data,
                ref,
                where,
                fix=f"put the right file at {ref.location}, or set {key}.sha256 to its digest",
            )
            return data
        if self.cache_dir is None:
            raise TokenizerError(
                f"{where} is a URL and this control plane keeps no cache of fetched files; "
                f"give {key}.path (an absolute path here) instead"
            )
        cached = self.cache_dir / ref.sha256
        if cached.exists():
            data = self._read_path(cached, where, key)
            if hashlib.sha256(data).hexdigest() == ref.sha256:
                return data
            log.warning(
                "a cached tokenizer file does not match its SHA-256; fetching it again",
                extra=kv(model=model, path=str(cached)),
            )
            with contextlib.suppress(OSError):
                cached.unlink()
        data = self._fetch(ref.location, where, key)
        _check(
            data,
            ref,
            where,
            fix=f"if the file there changed, check it (sha256sum) and set {key}.sha256 in "
            "the catalog to its digest, or point the url at the release you meant",
        )
        try:
            make_dir(self.cache_dir)
            atomic_write(cached, data, mode=0o600)
        except FileError as exc:
            # Still usable now; fetched again at the next start.
            log.warning(
                "cannot keep a fetched tokenizer file", extra=kv(model=model, error=exc.message)
            )
        return data

    # -- paths ---------------------------------------------------------------------------------

    def _read_profile_path(self, path: Path, where: str, key: str) -> bytes:
        real = Path(os.path.realpath(path))
        for secret in self.private:
            inside = Path(os.path.realpath(secret))
            if real == inside or real.is_relative_to(inside) or path.is_relative_to(secret):
                raise TokenizerError(
                    f"{where}: refused: the control plane reads no {key} file inside its "
                    "state directory or among its secrets; put the file in a directory of "
                    f"its own and set {key}.path to it"
                )
        return self._read_path(path, where, key, refuse_private=True)

    def _read_path(
        self, path: Path, where: str, key: str, *, refuse_private: bool = False
    ) -> bytes:
        try:
            with path.open("rb") as f:
                if refuse_private and self._is_private_file(os.fstat(f.fileno())):
                    raise _Refused("the file is one of the control plane's secrets (a link)")
                data = f.read(self.max_bytes + 1)
        except (OSError, _Refused) as exc:
            log.warning(
                "cannot read a tokenizer file",
                extra=kv(file=where, error=getattr(exc, "strerror", None) or str(exc)),
            )
            raise TokenizerError(
                f"{where}: read failed (the control plane's log says why); put the file there, "
                f"readable by the control plane's user, or fix the profile's {key}.path"
            ) from exc
        if len(data) > self.max_bytes:
            raise TokenizerError(
                f"{where} is over {self.max_bytes >> 20} MiB; give the model's own {key} file"
            )
        return data

    def _is_private_file(self, st: os.stat_result) -> bool:
        """A hard link to a secret file, under another name."""
        for secret in self.private:
            with contextlib.suppress(OSError):
                other = secret.stat()
                if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                    return True
        return False

    # -- URLs ----------------------------------------------------------------------------------

    def _fetch(self, url: str, where: str, key: str) -> bytes:
        self.fetches += 1
        try:
            return self._follow(url)
        except (_Refused, urllib.error.URLError, http.client.HTTPException, OSError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            log.warning(
                "a tokenizer file was not fetched", extra=kv(file=where, reason=str(reason))
            )
            raise TokenizerError(
                f"{where}: download failed (the control plane's log says why); check that the "
                "URL serves the file to this control plane, that an http:// URL or one on a "
                "private network is under a prefix of tokenizer_sources in server.yaml, or "
                f"copy the file here and give {key}.path"
            ) from exc

    def _follow(self, url: str) -> bytes:
        for _ in range(MAX_REDIRECTS + 1):
            check = self._admit(url)
            request = urllib.request.Request(url, headers={"User-Agent": "llmgw"})
            try:
                with _opener(check).open(request, timeout=self.fetch_timeout) as response:
                    data: bytes = response.read(self.max_bytes + 1)
            except urllib.error.HTTPError as exc:
                with contextlib.closing(exc):
                    location = exc.headers.get("Location") if exc.code in _REDIRECTS else None
                    if location is None:
                        raise _Refused(f"HTTP {exc.code} {exc.reason} from {url}") from exc
                target = urllib.parse.urljoin(url, location)
                if not self._may_redirect(url, target):
                    raise _Refused(f"{url} redirects to {target}, another host") from exc
                url = target
                continue
            if len(data) > self.max_bytes:
                raise _Refused(f"{url} sent more than {self.max_bytes >> 20} MiB")
            return data
        raise _Refused(f"more than {MAX_REDIRECTS} redirects")

    def _listed(self, url: str) -> bool:
        return allowed(url, self.sources, schemes=("https", "http"))

    def _admit(self, url: str) -> Callable[[str], None] | None:
        """Refuse ``url`` unless it may be fetched; the check of the connected address (None:
        none, the URL is listed or a proxy connects)."""
        parts = urllib.parse.urlsplit(url)
        if self._listed(url):
            return None
        if parts.scheme != "https":
            raise _Refused(f"{url} is not https:// and no tokenizer_sources prefix lists it")
        host = parts.hostname or ""
        proxied = _proxied(parts.scheme, host)
        try:
            addresses = self.resolve(host)
        except OSError as exc:
            if proxied:
                return None  # the proxy resolves it; this machine may not
            raise _Refused(f"cannot resolve {host}: {exc}") from exc
        bad = [a for a in addresses if not _public(a)]
        if bad or not addresses:
            raise _Refused(
                f"{host} resolves to {', '.join(bad) or 'nothing'}, not a public address, and "
                "no tokenizer_sources prefix lists the URL"
            )
        return None if proxied else _connected_public

    def _may_redirect(self, url: str, target: str) -> bool:
        a, b = urllib.parse.urlsplit(url), urllib.parse.urlsplit(target)
        same = (a.scheme, a.hostname, a.port) == (b.scheme, b.hostname, b.port)
        return same or self._listed(target)


def _connected_public(address: str) -> None:
    if not _public(address):
        raise _Refused(f"connected to {address}, not a public address")


def _proxied(scheme: str, host: str) -> bool:
    proxies = urllib.request.getproxies()
    return scheme in proxies and not urllib.request.proxy_bypass(host)


def _opener(check: Callable[[str], None] | None) -> urllib.request.OpenerDirector:
    """An opener that follows no redirect (the caller does, checking each) and, with
    ``check``, checks the address each connection reaches before anything is sent."""
    handlers: list[Any] = [_NoRedirect()]
    if check is not None:
        handlers += [_CheckedHTTPSHandler(check)]
    return urllib.request.build_opener(*handlers)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # urllib raises the 3xx as an HTTPError, with its Location


class _CheckedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, check: Callable[[str], None]) -> None:
        super().__init__()
        self.check = check

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        factory = functools.partial(_checked_connection, self.check)
        return self.do_open(factory, req, context=self._context)  # type: ignore[attr-defined]


def _checked_connection(
    check: Callable[[str], None], host: str, **kwargs: Any
) -> http.client.HTTPSConnection:
    conn = http.client.HTTPSConnection(host, **kwargs)
    connect = conn._create_connection  # type: ignore[attr-defined]

    def create_connection(*args: Any, **kw: Any) -> socket.socket:
        sock: socket.socket = connect(*args, **kw)
        try:
            check(sock.getpeername()[0])
        except BaseException:
            sock.close()
            raise
        return sock

    conn._create_connection = create_connection  # type: ignore[attr-defined]
    return conn


def _check(data: bytes, ref: FileRef, where: str, *, fix: str) -> None:
    if not ref.sha256:
        return
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        log.warning(
            "a tokenizer file does not match its SHA-256",
            extra=kv(file=where, sha256=digest, expected=ref.sha256),
        )
        raise TokenizerError(f"{where}: checksum mismatch; nothing was kept: {fix}")
