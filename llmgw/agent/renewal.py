"""Certificate renewal over the stream: a new key and CSR at two thirds of the lifetime, and
at once when the cluster CA was rotated.

The new key and certificate replace the old ones on disk atomically and only once the
control plane has answered with a certificate for our key from a CA we trust; the data
plane takes them for new connections and the next stream uses them, so no shard is touched.

**CA rotation.** The control plane sends its trust bundle (:class:`pb.TrustBundle`): the
cluster CA first, then, during the overlap, the CA it replaces. :meth:`Renewer.trust` keeps
of it only the CAs this node trusts already and those a CA it trusts vouches for with a
cross-certificate valid now (the stream is authenticated, and still a CA of the control
plane's choosing is never taken on its word alone), writes them as the node's CA file
(``tls.ca``: current CA first), and renews at once when the node certificate is not the
first CA's. A bundle without the old CA (after the overlap) removes it from the file. The
root update helper never reads this file as trust: only as a candidate checked against a
pin (llmgw.updater.trust).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.agent.config import TLSConfig
from llmgw.errors import CertificateError
from llmgw.fsutil import atomic_write, write_private
from llmgw.log import kv
from llmgw.pki import (
    BACKDATE,
    bundle_pem,
    cert_common_name,
    cert_pem,
    fingerprint,
    is_ca_certificate,
    issued_by,
    key_pem,
    load_bundle,
    load_cert,
    make_csr,
    new_private_key,
)
from llmgw.proto import control_pb2 as pb

__all__ = ["Renewer", "renew_at"]

log = logging.getLogger("llmgw.agent.renewal")

RETRY = 30.0


def renew_at(cert: x509.Certificate) -> float:
    """Epoch seconds at two thirds of the certificate's lifetime, counted from its issue
    (certificates are backdated for clock skew; that margin is not lifetime)."""
    end = cert.not_valid_after_utc.timestamp()
    start = min(cert.not_valid_before_utc.timestamp() + BACKDATE.total_seconds(), end)
    return start + (end - start) * 2 / 3


def retry_delay(cert: x509.Certificate | None) -> float:
    """After a failed attempt: soon for a short-lived certificate, at most RETRY seconds."""
    if cert is None:
        return RETRY
    left = cert.not_valid_after_utc.timestamp() - time.time()
    return min(RETRY, max(0.5, left / 10))


class Renewer:
    """Watches the node certificate's age and renews it through ``send``."""

    def __init__(
        self,
        tls: TLSConfig,
        node_id: str,
        send: Callable[[pb.AgentMessage], bool],
        on_renewed: Callable[[], None],
    ) -> None:
        self.tls = tls
        self.node_id = node_id
        self.send = send
        self.on_renewed = on_renewed
        self._pending_key: ec.EllipticCurvePrivateKey | None = None
        self._answer: asyncio.Future[pb.RenewCertificate] | None = None
        self._wake = asyncio.Event()

    def due(self, cert: x509.Certificate) -> float:
        """When to renew ``cert``: at two thirds of its life, or now when the CA this node
        trusts first (the cluster CA, after a rotation the new one) did not issue it."""
        try:
            first = load_bundle(self.tls.ca)[0]
        except (CertificateError, IndexError):
            return renew_at(cert)
        return renew_at(cert) if issued_by(cert, first) else 0.0

    def trust(self, msg: pb.TrustBundle) -> bool:
        """Take the control plane's trust bundle (see the module docstring); True when the
        node's CA file changed. Never raises: a bundle that cannot be used is logged and the
        file kept."""
        try:
            changed = self._trust(msg)
        except (CertificateError, OSError) as exc:
            log.warning("cannot take the control plane's trust bundle", extra=kv(error=str(exc)))
            return False
        self._wake.set()  # renew at once when the certificate is not the new CA's
        if changed:
            # The data plane trusts exactly the file's CAs from its next handshake on.
            with contextlib.suppress(Exception):
                self.on_renewed()
        return changed

    def _trust(self, msg: pb.TrustBundle) -> bool:
        trusted = load_bundle(self.tls.ca)
        trusted_pins = {fingerprint(c.public_key()) for c in trusted}
        now = time.time()
        crosses = []
        for pem in msg.cross_pems:
            try:
                crosses.append(x509.load_pem_x509_certificate(pem.encode()))
            except ValueError:
                log.warning("ignoring an unreadable cross-certificate in the trust bundle")
        if len(msg.pins) != len(msg.ca_pems):
            raise CertificateError("the trust bundle's pins do not match its CAs; it is ignored")
        keep: list[x509.Certificate] = []
        for pem, pin in zip(msg.ca_pems, msg.pins, strict=True):
            try:
                ca = x509.load_pem_x509_certificate(pem.encode())
            except ValueError as exc:
                raise CertificateError(f"a CA of the trust bundle does not parse: {exc}") from exc
            got = fingerprint(ca.public_key())
            if got != pin or not is_ca_certificate(ca) or not issued_by(ca, ca):
                raise CertificateError(
                    f"the trust bundle's CA {got} is not the self-signed CA of pin {pin}; it "
                    "is ignored"
                )
            if got in trusted_pins or any(_vouches(cross, ca, trusted, now) for cross in crosses):
                keep.append(ca)
            else:
                log.info(
                    "not trusting a CA of the bundle that no trusted CA vouches for",
                    extra=kv(ca=got),
                )
        if not keep:
            raise CertificateError(
                "no CA of the trust bundle is trusted by this node or vouched for by one it "
                "trusts (it missed the CA rotation's overlap); rejoin the node "
                "('llmgw ctl join-command --rekey NODE')"
            )
        data = bundle_pem(keep)
        if self.tls.ca.read_bytes() == data:
            return False
        atomic_write(self.tls.ca, data, mode=0o644)
        log.warning(
            "the cluster CA changed; this node now trusts the control plane's new trust bundle",
            extra=kv(cas=",".join(fingerprint(c.public_key()) for c in keep)),
        )
        return True

    def answer(self, msg: pb.RenewCertificate) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(msg)

    async def run(self) -> None:
        """Renew whenever due; returns only when cancelled."""
        while True:
            self._wake.clear()
            try:
                due = self.due(load_cert(self.tls.cert))
            except CertificateError as exc:
                log.warning("cannot read the node certificate", extra=kv(error=str(exc)))
                await asyncio.sleep(RETRY)
                continue
            wait = due - time.time()
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(wait, 3600.0))
                continue
            if await self.renew_once():
                await asyncio.sleep(1.0)  # never renew back to back
            else:
                try:
                    cert: x509.Certificate | None = load_cert(self.tls.cert)
                except CertificateError:
                    cert = None
                await asyncio.sleep(retry_delay(cert))

    async def renew_once(self, timeout: float = 30.0) -> bool:
        key = new_private_key()
        csr = make_csr(key, self.node_id)
        loop = asyncio.get_running_loop()
        self._answer = loop.create_future()
        self._pending_key = key
        pem = csr.public_bytes(serialization.Encoding.PEM).decode()
        if not self.send(pb.AgentMessage(cert_request=pb.CertificateRequest(csr_pem=pem))):
            return False
        log.info("asking the control plane for a new certificate", extra=kv(node=self.node_id))
        try:
            answer = await asyncio.wait_for(self._answer, timeout)
        except TimeoutError:
            log.warning("no answer to the renewal request; will retry", extra=kv(node=self.node_id))
            return False
        finally:
            self._answer = None
        if answer.error:
            log.warning("the control plane refused the renewal", extra=kv(error=answer.error))
            return False
        try:
            self._install(key, answer)
        except CertificateError as exc:
            log.warning("refused the renewed certificate", extra=kv(error=str(exc)))
            return False
        with contextlib.suppress(Exception):
            self.on_renewed()
        return True

    def _install(self, key: ec.EllipticCurvePrivateKey, answer: pb.RenewCertificate) -> None:
        try:
            cert = x509.load_pem_x509_certificate(answer.certificate_pem.encode())
            ca = x509.load_pem_x509_certificate(answer.ca_pem.encode())
        except ValueError as exc:
            raise CertificateError(f"the renewed certificate does not parse: {exc}") from exc
        if cert_common_name(cert) != self.node_id:
            raise CertificateError(
                f"the renewed certificate is for {cert_common_name(cert)!r}, not {self.node_id!r}"
            )
        if ca not in load_bundle(self.tls.ca):
            raise CertificateError(
                f"the renewed certificate comes with a CA this node does not trust "
                f"({fingerprint(ca.public_key())}); it takes a new CA only from the control "
                "plane's trust bundle (CA rotation), else rejoin the node"
            )
        if not issued_by(cert, ca):
            raise CertificateError("the renewed certificate is not from the cluster CA")
        if fingerprint(key.public_key()) != fingerprint(cert.public_key()):
            raise CertificateError("the renewed certificate is not for the key we sent")
        # Key first, then certificate: a crash in between leaves node.key.new's
        # predecessor recoverable from node.key.old.
        old_key, old_cert = self.tls.key.read_bytes(), self.tls.cert.read_bytes()
        write_private(self.tls.key.with_name(self.tls.key.name + ".old"), old_key)
        atomic_write(self.tls.cert.with_name(self.tls.cert.name + ".old"), old_cert)
        write_private(self.tls.key, key_pem(key))
        atomic_write(self.tls.cert, cert_pem(cert))
        log.info(
            "installed a renewed certificate",
            extra=kv(node=self.node_id, until=cert.not_valid_after_utc.isoformat()),
        )


def _matches(key_pem: bytes, cert_pem: bytes) -> bool:
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except (ValueError, TypeError):
        return False
    return fingerprint(key.public_key()) == fingerprint(cert.public_key())


def recover_identity(tls: TLSConfig) -> None:
    """Undo a key swap that a crash interrupted: the key must match the certificate."""
    try:
        key, cert = tls.key.read_bytes(), tls.cert.read_bytes()
    except OSError:
        return  # missing files are reported by the caller with the fix
    if _matches(key, cert):
        return
    old_key = tls.key.with_name(tls.key.name + ".old")
    with contextlib.suppress(OSError):
        if _matches(old_key.read_bytes(), cert):
            write_private(tls.key, old_key.read_bytes())
            log.warning(
                "restored the previous key: a renewal was interrupted", extra=kv(key=str(tls.key))
            )
            return
    raise CertificateError(
        f"the node key {tls.key} does not belong to the certificate {tls.cert}; rejoin the node "
        "('llmgw agent join --rekey')"
    )


def _vouches(
    cross: x509.Certificate, ca: x509.Certificate, trusted: list[x509.Certificate], now: float
) -> bool:
    """Whether ``cross`` is a trusted CA's word for ``ca``'s key: a CA certificate for the
    same key and name, signed by a trusted CA, valid at ``now``."""
    return (
        is_ca_certificate(cross)
        and fingerprint(cross.public_key()) == fingerprint(ca.public_key())
        and cross.subject == ca.subject
        and cross.not_valid_before_utc.timestamp() <= now < cross.not_valid_after_utc.timestamp()
        and any(issued_by(cross, t) for t in trusted)
    )
