"""Issuing leaf certificates: a node's (made here, or signed from its CSR, one shape either
way), the control plane's server and client certificates, and the control plane's start-up
check that (re)issues its own when they are missing, stale or lack its identity."""

from __future__ import annotations

import datetime as dt
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificatePublicKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import (
    CertificateError,
    ConfigError,
    PKIError,
)
from llmgw.fsutil import write_private
from llmgw.netaddr import (
    CONTROL_PLANE_NAME,
    validate_node_id,
)
from llmgw.pki.ca import (
    PREVIOUS_CA_KEY,
    TRUST_BUNDLE,
    cross_certificates,
    finish_rotation_locked,
    init_ca_locked,
    read_rotation,
    write_trust,
)
from llmgw.pki.certs import (
    BACKDATE,
    CA_CERT,
    CA_KEY,
    CONTROL_PLANE_CN,
    CONTROL_PLANE_OID,
    DEFAULT_CA_CN,
    RENEW_BEFORE,
    SERVER_CN,
    Authority,
    Identity,
    bundle_pem,
    cert_common_name,
    cert_pem,
    cert_sans,
    check_stem,
    dir_lock,
    key_matches,
    key_pem,
    key_usage,
    load_cert,
    load_key,
    make_pki_dir,
    new_private_key,
    normal_san,
    server_sans,
    utc_now,
    write_public,
    write_public_if_changed,
)
from llmgw.pki.verify import (
    check_csr,
)

# --------------------------------------------------------------------------- leaf certificates


def _leaf(
    ca: Authority,
    public_key: CertificatePublicKeyTypes,
    *,
    common_name: str,
    sans: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    lifetime: dt.timedelta,
) -> x509.Certificate:
    """A leaf certificate for ``public_key`` signed by ``ca``, never outliving the CA."""
    now = utc_now()
    not_after = min(now + lifetime, ca.cert.not_valid_after_utc)
    try:
        ca_ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), False)
        .add_extension(aki, critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca.key, hashes.SHA256())


def _node_leaf(
    ca: Authority, public_key: CertificatePublicKeyTypes, node_id: str, lifetime: dt.timedelta
) -> x509.Certificate:
    """The one shape of a node certificate, whether its key was made here or came in a CSR."""
    return _leaf(
        ca,
        public_key,
        common_name=node_id,
        sans=[x509.DNSName(node_id)],
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH],
        lifetime=lifetime,
    )


def _write_identity(
    ca: Authority, out_dir: Path, name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
) -> Identity:
    identity = Identity(
        cert=out_dir / f"{name}.crt", key=out_dir / f"{name}.key", ca=out_dir / CA_CERT
    )
    write_private(identity.key, key_pem(key))
    write_public(identity.cert, cert_pem(cert))
    write_public_if_changed(identity.ca, cert_pem(ca.cert))
    return identity


def _prepare(out_dir: Path, name: str, valid_days: int) -> Path:
    check_stem(name)
    if valid_days < 1:
        raise ConfigError(f"must be at least 1, not {valid_days}", key="valid_days")
    out_dir = Path(out_dir)
    make_pki_dir(out_dir, tighten=False)
    return out_dir


def _issue(
    ca: Authority,
    out_dir: Path,
    name: str,
    *,
    common_name: str,
    sans: list[x509.GeneralName],
    usages: list[x509.ObjectIdentifier],
    valid_days: int,
) -> Identity:
    out_dir = _prepare(out_dir, name, valid_days)
    key = new_private_key()
    cert = _leaf(
        ca,
        key.public_key(),
        common_name=common_name,
        sans=sans,
        usages=usages,
        lifetime=dt.timedelta(days=valid_days),
    )
    return _write_identity(ca, out_dir, name, key, cert)


def issue_node_cert(
    ca: Authority, node_id: str, out_dir: Path, *, valid_days: int = 365, name: str = "node"
) -> Identity:
    """Issue ``out_dir/{name}.crt|.key`` (+ ``ca.crt``) for node ``node_id``: CN and SAN DNS =
    node id, usable both as TLS client (to the control plane) and server (its data plane)."""
    validate_node_id(node_id)
    out_dir = _prepare(out_dir, name, valid_days)
    key = new_private_key()
    cert = _node_leaf(ca, key.public_key(), node_id, dt.timedelta(days=valid_days))
    return _write_identity(ca, out_dir, name, key, cert)


def issue_server_cert(
    ca: Authority,
    out_dir: Path,
    *,
    hosts: Iterable[str],
    name: str = "server",
    valid_days: int = 365,
) -> Identity:
    """Issue the control plane's TLS server certificate for ``hosts`` (plus loopback and
    :data:`CONTROL_PLANE_NAME`), carrying :data:`CONTROL_PLANE_OID`."""
    return _issue(
        ca,
        out_dir,
        name,
        common_name=SERVER_CN,
        sans=server_sans(hosts),
        usages=[ExtendedKeyUsageOID.SERVER_AUTH, CONTROL_PLANE_OID],
        valid_days=valid_days,
    )


def issue_control_plane_client_cert(
    ca: Authority, out_dir: Path, *, name: str = "client", valid_days: int = 365
) -> Identity:
    """Issue the certificate the control plane presents to agents' data planes (clientAuth and
    :data:`CONTROL_PLANE_OID`, SAN :data:`CONTROL_PLANE_NAME`)."""
    return _issue(
        ca,
        out_dir,
        name,
        common_name=CONTROL_PLANE_CN,
        sans=[x509.DNSName(CONTROL_PLANE_NAME)],
        usages=[ExtendedKeyUsageOID.CLIENT_AUTH, CONTROL_PLANE_OID],
        valid_days=valid_days,
    )


def sign_csr(
    ca: Authority, csr: x509.CertificateSigningRequest, *, node_id: str, lifetime: float
) -> x509.Certificate:
    """A node certificate for the key in ``csr``, shaped exactly like :func:`issue_node_cert`'s,
    valid ``lifetime`` seconds (never past the CA's own end). Refuses what :func:`check_csr`
    refuses; the caller stores and sends the certificate."""
    validate_node_id(node_id)
    if not (isinstance(lifetime, int | float) and math.isfinite(lifetime) and lifetime > 0):
        raise ConfigError(
            f"must be a positive number of seconds, not {lifetime!r}", key="cert_lifetime"
        )
    check_csr(csr, node_id)
    remaining = (ca.cert.not_valid_after_utc - utc_now()).total_seconds()
    span = dt.timedelta(seconds=max(0.0, min(float(lifetime), remaining)))
    return _node_leaf(ca, csr.public_key(), node_id, span)


# --------------------------------------------------------------------------- control plane start


def _usable(
    ca: Authority,
    identity: Identity,
    *,
    common_name: str,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName],
) -> bool:
    """True if the identity's files exist, match, are signed by ``ca``, fit the purpose (``usage``
    and the control plane's own, :data:`CONTROL_PLANE_OID`), name every one of ``sans`` and do
    not expire within RENEW_BEFORE. A certificate from before the OID existed is not usable:
    existing clusters get marked certificates on their next start."""
    try:
        cert = load_cert(identity.cert)
        key = load_key(identity.key)
        if not key_matches(cert, key):
            return False
        cert.verify_directly_issued_by(ca.cert)
        if cert_common_name(cert) != common_name:
            return False
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        if usage not in eku or CONTROL_PLANE_OID not in eku:
            return False
    except (CertificateError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    if cert.not_valid_after_utc - utc_now() < RENEW_BEFORE:
        return False
    if cert.not_valid_before_utc > utc_now() + BACKDATE:
        return False
    have = cert_sans(cert)
    return all(normal_san(s) in have for s in sans)


def _tighten_key(path: Path) -> None:
    try:
        if path.exists() and (path.stat().st_mode & 0o077):
            os.chmod(path, 0o600)
    except OSError as e:
        raise PKIError(f"cannot restrict {path} to mode 0600: {e.strerror or e}") from e


def ensure_server_identity(
    pki_dir: Path, *, hosts: Iterable[str]
) -> tuple[Authority, Identity, Identity]:
    """What the control plane runs on every start (and after a CA rotation): the CA, its server
    certificate (covering every host in ``hosts``) and its client certificate, each (re)issued
    when missing, expiring within 30 days, signed by another CA (the one a rotation replaced,
    too), without the control plane's identity (:data:`CONTROL_PLANE_OID` and
    :data:`CONTROL_PLANE_NAME`, which older versions did not add) or (server) not covering the
    hosts. A rotation whose overlap has ended is finished here (the old CA dropped). The
    identities' ``ca`` is the trust bundle (``trust.crt``); while a rotation is under way
    their certificate files carry the cross-certificate after the leaf."""
    pki_dir = Path(pki_dir)
    wanted = server_sans(hosts)  # validate hosts before touching anything
    make_pki_dir(pki_dir, tighten=True)
    with dir_lock(pki_dir):
        ca = init_ca_locked(pki_dir, DEFAULT_CA_CN, 3650, exist_ok=True)
        _tighten_key(pki_dir / CA_KEY)
        rotation = read_rotation(pki_dir)
        if rotation is not None and rotation.active and rotation.drop_at <= time.time():
            finish_rotation_locked(pki_dir)
        _tighten_key(pki_dir / PREVIOUS_CA_KEY)
        write_trust(pki_dir)
        chain = bundle_pem(cross_certificates(pki_dir))
        trust = pki_dir / TRUST_BUNDLE

        server = Identity(cert=pki_dir / "server.crt", key=pki_dir / "server.key", ca=trust)
        if _usable(
            ca, server, common_name=SERVER_CN, usage=ExtendedKeyUsageOID.SERVER_AUTH, sans=wanted
        ):
            _tighten_key(server.key)
        else:
            hosts_list = [str(n.value) for n in wanted]
            issue_server_cert(ca, pki_dir, hosts=hosts_list, name="server")
        _carry_chain(server.cert, chain)

        client = Identity(cert=pki_dir / "client.crt", key=pki_dir / "client.key", ca=trust)
        if _usable(
            ca,
            client,
            common_name=CONTROL_PLANE_CN,
            usage=ExtendedKeyUsageOID.CLIENT_AUTH,
            sans=[x509.DNSName(CONTROL_PLANE_NAME)],
        ):
            _tighten_key(client.key)
        else:
            issue_control_plane_client_cert(ca, pki_dir, name="client")
        _carry_chain(client.cert, chain)
    return ca, server, client


def _carry_chain(path: Path, chain: bytes) -> None:
    """The leaf in ``path`` followed by exactly ``chain`` (the rotation's cross-certificate,
    or nothing), rewritten only when it differs."""
    leaf = cert_pem(load_cert(path))
    write_public_if_changed(path, leaf + chain)
