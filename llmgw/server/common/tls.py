"""The control plane's TLS material, reloaded from its files when they change: the certificate
HTTPS presents on the gateway/admin listener (:8080) and on enrolment (:8443), so that an
ACME renewal or a CA rotation needs no restart, and the gRPC stream's (:7443) certificate
and trust (:class:`StreamCredentials`), which a CA rotation replaces.

Every TLS handshake runs the context's SNI callback (OpenSSL calls it for every ClientHello,
with or without a server name). The callback compares the files' stat stamps with those of
the pair being served; when they changed it loads the new pair into a fresh context and
hands that context to this and every later handshake. A new pair that does not load (a
certificate renewed before its key, a typo) is logged once per change and the previous pair
keeps being served.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from pathlib import Path

import grpc

from llmgw.errors import CertificateError
from llmgw.log import kv
from llmgw.pki import Identity
from llmgw.server.common.config import TLSConfig

__all__ = ["ServingCertificate", "StreamCredentials", "serving_certificate"]

log = logging.getLogger("llmgw.server.tls")

_Stamp = tuple[tuple[int, int, int], ...]


class ServingCertificate:
    """A certificate/key pair served over TLS and reloaded when the files change.

    ``context`` is what the listener is given; :meth:`current` is the context holding the
    newest pair that loaded. Raises :class:`CertificateError` when the pair cannot be
    loaded at start (there is nothing older to fall back to)."""

    def __init__(self, cert: Path, key: Path, *, what: str = "tls") -> None:
        self.cert = Path(cert)
        self.key = Path(key)
        self.what = what  # the configuration key, for messages
        try:
            stamp = self._stamp()
            self.context = self._load()
        except (OSError, ssl.SSLError) as exc:
            raise CertificateError(
                f"{what}: cannot load the certificate {self.cert} with the key {self.key}: "
                f"{_reason(exc)}; check that both files exist, are readable by the control "
                "plane's user and belong together"
            ) from exc
        self.context.sni_callback = self._on_client_hello
        self._current = self.context
        self._served = stamp  # the files' stamps when the pair being served was read
        # The stamps (or the stat error) of a changed pair that did not load: logged once.
        self._refused: _Stamp | str | None = None
        self.reloads = 0

    def current(self) -> ssl.SSLContext:
        """The context with the newest pair that loaded, checking the files first."""
        self.reload_if_changed()
        return self._current

    def reload_if_changed(self) -> bool:
        """Load the pair again if its files changed since it was read; True when a new
        pair is served from now on. Never raises: a pair that does not load is logged and
        the previous one kept."""
        try:
            stamp = self._stamp()
        except OSError as exc:
            # Mid-renewal (a file replaced by rename) or removed: keep serving what we have.
            self._refuse(f"unreadable: {exc}", exc)
            return False
        if stamp == self._served or stamp == self._refused:
            return False
        try:
            context = self._load()
        except (OSError, ssl.SSLError) as exc:
            self._refuse(stamp, exc)
            return False
        self._current = context
        self._served = stamp
        self._refused = None
        self.reloads += 1
        log.info(
            "TLS certificate reloaded; new connections get the new one",
            extra=kv(cert=str(self.cert), key=str(self.key)),
        )
        return True

    def _on_client_hello(
        self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _ctx: ssl.SSLContext
    ) -> None:
        try:
            context = self.current()
            if context is not self.context:
                conn.context = context
        except Exception as exc:  # an exception here would fail the handshake
            log.warning(
                "cannot switch to the reloaded TLS certificate",
                extra=kv(cert=str(self.cert), error=str(exc)),
            )

    def _refuse(self, what: _Stamp | str, exc: BaseException) -> None:
        if what == self._refused:
            return
        self._refused = what
        log.warning(
            "the changed TLS certificate cannot be loaded; still serving the previous one. Fix "
            "the files (the certificate and its key must belong together); they are read "
            "again on the next connection after they change",
            extra=kv(cert=str(self.cert), key=str(self.key), error=_reason(exc)),
        )

    def _stamp(self) -> _Stamp:
        # Following links on purpose: certbot's live/ names are links into archive/.
        stamps = []
        for path in (self.cert, self.key):
            st = os.stat(path)
            stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)

    def _load(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and not isinstance(exc, ssl.SSLError) and exc.strerror:
        return f"{exc.strerror} ({exc.filename})" if exc.filename else exc.strerror
    return str(exc)


def serving_certificate(tls: TLSConfig | None, identity: Identity) -> ServingCertificate | None:
    """What the :8080 listener serves for server.yaml's ``tls``: nothing (plain HTTP), the
    control plane's certificate from the cluster CA (``cluster``), or the operator's pair."""
    if tls is None:
        return None
    if tls.cert is None or tls.key is None:
        return ServingCertificate(identity.cert, identity.key, what="tls: cluster")
    return ServingCertificate(tls.cert, tls.key, what="tls")


class StreamCredentials:
    """The gRPC stream's server credentials: the control plane's certificate (with the chain
    after it) and the CAs a node's certificate must come from (the trust bundle), read again
    for the next handshake once any of the three files changed (a CA rotation reissues the
    certificate and changes the trust). A change that does not load is logged and the
    previous credentials kept; open streams are untouched."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._lock = threading.Lock()  # gRPC may ask from its own threads
        try:
            self._stamp = self._stamps()
            initial = self._config()
        except OSError as exc:
            raise CertificateError(
                f"cannot load the stream's certificate {identity.cert} ({_reason(exc)}); "
                "restart 'llmgw server' to reissue it"
            ) from exc
        self._refused: _Stamp | None = None
        self.reloads = 0
        # grpc's stubs say the fetcher returns a configuration; its documentation (and
        # core) take None as "no change", which is what _fetch says nearly every time.
        self.credentials = grpc.dynamic_ssl_server_credentials(
            initial,
            self._fetch,  # type: ignore[arg-type]
            require_client_authentication=True,
        )

    def _paths(self) -> tuple[Path, Path, Path]:
        return (self.identity.cert, self.identity.key, self.identity.ca)

    def _stamps(self) -> _Stamp:
        out = []
        for path in self._paths():
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def _config(self) -> grpc.ServerCertificateConfiguration:
        ident = self.identity
        return grpc.ssl_server_certificate_configuration(
            [(ident.key.read_bytes(), ident.cert.read_bytes())],
            root_certificates=ident.ca.read_bytes(),
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question before a handshake: None keeps what it has."""
        with self._lock:
            try:
                stamp = self._stamps()
                if stamp in (self._stamp, self._refused):
                    return None
                config = self._config()
            except Exception as exc:  # an exception here would fail the handshake
                if self._refused is None:
                    log.warning(
                        "the stream's changed certificate cannot be loaded; still serving the "
                        "previous one",
                        extra=kv(cert=str(self.identity.cert), error=_reason(exc)),
                    )
                    self._refused = self._stamp
                return None
            self._stamp, self._refused = stamp, None
            self.reloads += 1
        log.info(
            "stream certificate and trust reloaded; new streams get them",
            extra=kv(cert=str(self.identity.cert), trust=str(self.identity.ca)),
        )
        return config
