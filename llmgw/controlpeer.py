"""The control plane's identity checked on a TLS peer, once the handshake is done and before a
byte of the request is sent.

The cluster CA issues node certificates too, and a node id may look like any host name, so a
peer that passes TLS with a certificate the cluster CA issued is the control plane only when
that certificate carries :data:`llmgw.pki.CONTROL_PLANE_OID` (:func:`llmgw.pki.control_plane_problem`).
The ssl module cannot check an extended key usage, so :func:`require_control_plane` gives a
context an ``SSLObject`` class (asyncio, aiohttp) and an ``SSLSocket`` class (urllib,
http.client) whose handshake ends in that check. A peer another CA certified (an operator's own
certificate, trusted through the system store or a company CA) is left to the context's trust.

Every client of the control plane that does not pin the reserved TLS name uses it: the agent's
bundle download, a standby's forwarding of the admin API to the leader, and ``llmgw ctl``.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import NameOID

from llmgw.errors import CertificateError
from llmgw.pki import DEFAULT_CA_CN, control_plane_problem, load_bundle

__all__ = [
    "NotControlPlane",
    "cluster_cas_in",
    "cluster_peer_problem",
    "require_control_plane",
]

Cas = Sequence[x509.Certificate] | Path
"""The cluster CA's certificates, or the file they are in (read at each handshake, so that a
rotated CA is seen without a restart)."""


class NotControlPlane(ssl.SSLCertVerificationError):
    """The TLS peer holds a certificate from the cluster CA that is not the control plane's."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem

    def __str__(self) -> str:
        return self.problem


def cluster_cas_in(certs: Sequence[x509.Certificate]) -> list[x509.Certificate]:
    """The llmgw cluster CAs among ``certs`` (the subject llmgw gives every cluster CA, kept
    across rotations): a CA file given to ``llmgw ctl`` may be an operator's own CA, whose
    server certificates carry no control-plane usage and need none (it issues no node's)."""
    out = []
    for cert in certs:
        try:
            names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        except ValueError:
            continue
        if any(n.value == DEFAULT_CA_CN for n in names):
            out.append(cert)
    return out


def cluster_peer_problem(der: bytes | None, cas: Cas) -> str | None:
    """Why a TLS peer is not acceptable as the control plane: None for a certificate none of
    the cluster CAs ``cas`` issued (the TLS context's trust judged it) or one that carries the
    control plane's identity; else the problem, in words that name the certificate."""
    if der is None:
        return "it presented no certificate"
    try:
        authorities = load_bundle(cas) if isinstance(cas, Path) else cas
    except CertificateError as exc:
        return str(exc)
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        return f"its certificate cannot be read ({exc})"
    for ca in authorities:
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return control_plane_problem(cert)
    return None


def _checked(cas: Cas) -> tuple[type[ssl.SSLObject], type[ssl.SSLSocket]]:
    def check(der: bytes | None) -> None:
        problem = cluster_peer_problem(der, cas)
        if problem is not None:
            raise NotControlPlane(problem)

    class ControlPlaneObject(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()
            check(self.getpeercert(binary_form=True))

    class ControlPlaneSocket(ssl.SSLSocket):
        def do_handshake(self, block: bool = False) -> None:
            super().do_handshake(block)
            check(self.getpeercert(binary_form=True))

    return ControlPlaneObject, ControlPlaneSocket


def require_control_plane(context: ssl.SSLContext, cas: Cas) -> ssl.SSLContext:
    """``context`` (changed in place, and returned) with a handshake that fails with
    :class:`NotControlPlane` for a peer one of the cluster CAs ``cas`` certified without the
    control plane's identity, before the request is sent: the token, the password or the
    cookie it carries never reach a node posing as the control plane."""
    obj, sock = _checked(cas)
    context.sslobject_class = obj
    context.sslsocket_class = sock
    return context
