"""What the control plane process keeps whatever its role: its token files, the usage it
flushes, the TLS it dials the agents' data planes with, :8080's middlewares and
``ctl.yaml``."""

from __future__ import annotations

import asyncio
import logging
import secrets
import ssl
from pathlib import Path

from aiohttp.typedefs import Middleware
from cryptography import x509

from llmgw.client import write_ctl_config
from llmgw.contracts.keypolicy import UsageRow
from llmgw.errors import ConfigError, LlmgwError, StoreError
from llmgw.fsutil import write_private
from llmgw.log import kv
from llmgw.netaddr import format_hostport, parse_hostport
from llmgw.pki import CA_CERT, Identity, load_cert
from llmgw.server.common.config import ServerConfig
from llmgw.server.common.httpapi import error_middleware
from llmgw.server.common.tls import ServingCertificate
from llmgw.server.gateway.limits import KeyLimits
from llmgw.server.gateway.usage import UsageBook
from llmgw.server.ha.drain import Drain
from llmgw.server.ha.proxies import TrustedProxies, forwarded_middleware
from llmgw.server.store import Store

__all__ = [
    "DataPlaneTLS",
    "UsageFlusher",
    "middlewares",
    "probe_readers",
    "read_or_create_token",
    "write_ctl_yaml",
]

log = logging.getLogger("llmgw.server")


def read_or_create_token(path: Path, what: str = "admin") -> str:
    try:
        token = path.read_text().strip()
        if token:
            return token
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(
            f"cannot read the {what} token: {exc.strerror}; it must be readable by the control "
            "plane's user",
            file=str(path),
        ) from exc
    token = f"llmgw-{what}-" + secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, (token + "\n").encode())
    return token


def _dns_names(cert: Path) -> list[str]:
    """The DNS names (no wildcards) a certificate file is for; none if it cannot be read."""
    try:
        san = load_cert(cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (LlmgwError, x509.ExtensionNotFound):
        return []
    return [n for n in san.value.get_values_for_type(x509.DNSName) if "*" not in n]


def middlewares(cfg: ServerConfig, drain: Drain) -> list[Middleware]:
    """Of :8080's application, a leader's or a standby's: the requests in flight counted for
    a stop's drain, the client behind a trusted proxy in place of the proxy, then the JSON
    errors."""
    return [
        drain.middleware,
        forwarded_middleware(TrustedProxies(cfg.trusted_proxies)),
        error_middleware,
    ]


def probe_readers(cfg: ServerConfig) -> tuple[str, ...]:
    """The tokens that read /metrics and /healthz's details (llmgw.server.gateway.probes)."""
    return (
        read_or_create_token(cfg.metrics_token_path, "metrics"),
        read_or_create_token(cfg.admin_token_file),
    )


def write_ctl_yaml(cfg: ServerConfig, host: str, http_tls: ServingCertificate | None) -> None:
    """``STATE/ctl.yaml``: how ``llmgw ctl`` on this machine reaches this control plane
    (``LLMGW_STATE_DIR=STATE llmgw ctl ...``; /var/lib/llmgw's is found without it); *host*
    is host:port of :8080 as this machine dials it."""
    tls = cfg.tls
    ca = None
    if tls is not None and tls.cluster:
        ca = cfg.state_dir / "pki" / CA_CERT  # the certificate covers this machine's addresses
    elif tls is not None and http_tls is not None:
        # The operator's certificate names the server as the world knows it.
        names = _dns_names(http_tls.cert)
        if names:
            host = format_hostport(names[0], parse_hostport(host)[1])
    try:
        write_ctl_config(
            cfg.state_dir / "ctl.yaml", f"{cfg.http_scheme}://{host}", cfg.admin_token_file, ca=ca
        )
    except OSError as exc:
        log.warning(
            "cannot write ctl.yaml; llmgw ctl needs --server and --token",
            extra=kv(state_dir=str(cfg.state_dir), error=exc.strerror or str(exc)),
        )


class UsageFlusher:
    """The usage not stored yet, flushed every second to the process's store (whatever its
    role: a standby's gateway serves and counts too)."""

    def __init__(self) -> None:
        self.book: UsageBook | None = None
        self._task: asyncio.Task[None] | None = None
        self.store: Store | None = None

    def start(self, store: Store, limits: KeyLimits) -> UsageBook:
        self.store = store
        if self.book is None:
            self.book = UsageBook(store, limits)
        if self._task is None:
            self._task = asyncio.create_task(self.book.run(), name="usage")
        return self.book

    def pending(self) -> list[UsageRow]:
        """This instance's usage not stored yet (the admin API adds it to the store's)."""
        return self.book.pending() if self.book is not None else []

    def budget_spent(self, key_id: str, since_day: str) -> int:
        """What the store holds of a key's tokens since a day (read once per key and budget
        period; the usage flushes keep it current after)."""
        if self.store is None:
            return 0
        try:
            return self.store.tokens_since(since_day, [key_id]).get(key_id, 0)
        except StoreError as exc:
            log.warning("cannot read a key's budget use", extra=kv(key=key_id, error=str(exc)))
            return 0

    async def stop(self) -> None:
        """Stop the flushes and store what is left (the store still open)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self.book is not None:
            try:
                self.book.flush()
            except LlmgwError as exc:
                log.warning(
                    "cannot store the last usage counts at shutdown; they are lost",
                    extra=kv(error=str(exc), rows=len(self.book.pending())),
                )


class DataPlaneTLS:
    """The TLS context the gateway dials agents' data planes with: made once, made afresh
    when a CA rotation reissues the client certificate (a context's trust can only grow:
    after a drop the old CA must be trusted no more)."""

    def __init__(self) -> None:
        self.identity: Identity | None = None
        self._ctx: ssl.SSLContext | None = None

    def context(self) -> ssl.SSLContext:
        assert self.identity is not None
        if self._ctx is None:
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.identity.ca))
            ctx.load_cert_chain(self.identity.cert, self.identity.key)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            self._ctx = ctx
        return self._ctx

    def renewed(self) -> ssl.SSLContext | None:
        """A fresh context after a reissue; None when none was made yet."""
        if self._ctx is None or self.identity is None:
            return None
        self._ctx = None
        return self.context()
