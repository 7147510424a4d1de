"""Checking certificates and certificate requests: whether a peer carries the control plane's
identity, whether one certificate issued another, and what a node's CSR may ask for (plus
:func:`make_csr`, the request :func:`check_csr` accepts)."""

from __future__ import annotations

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
)
from cryptography.x509.oid import NameOID

from llmgw.errors import (
    CSRError,
)
from llmgw.netaddr import (
    RESERVED_NAMES,
    RESERVED_PREFIX,
    validate_node_id,
)
from llmgw.pki.certs import (
    CONTROL_PLANE_OID,
    cert_sans,
    serial_hex,
)


def _usages(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    try:
        return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        return []


def control_plane_problem(cert: x509.Certificate | bytes | None) -> str | None:
    """None when ``cert`` (parsed, or DER as TLS hands it over) carries the control plane's
    identity (:data:`CONTROL_PLANE_OID`); else why not, in words that name the certificate.
    Only the usage is checked here: the TLS handshake has verified the chain already."""
    if cert is None:
        return "it presented no certificate"
    if isinstance(cert, bytes | bytearray):
        try:
            cert = x509.load_der_x509_certificate(bytes(cert))
        except ValueError as exc:
            return f"its certificate cannot be read ({exc})"
    try:
        usages = _usages(cert)
        subject = cert.subject.rfc4514_string()
    except (ValueError, x509.DuplicateExtension) as exc:  # malformed, though CA-signed
        return f"its certificate's extensions cannot be read ({exc})"
    if CONTROL_PLANE_OID in usages:
        return None
    return (
        f"its certificate ({subject}, serial {serial_hex(cert)}) lacks the control plane's "
        f"extended key usage {CONTROL_PLANE_OID.dotted_string}: it is a node's certificate, or "
        "a control plane's from before llmgw marked them (restart 'llmgw server' to reissue it)"
    )


def control_plane_names(cert: x509.Certificate) -> frozenset[str]:
    """Every name in ``cert``'s SANs: DNS names lower-cased without a final dot, addresses as
    text. For a control-plane certificate these are the names a node id must never take."""
    names: set[str] = set()
    for entry in cert_sans(cert):
        if isinstance(entry, x509.DNSName):
            names.add(entry.value)
        elif isinstance(entry, x509.IPAddress):
            names.add(str(entry.value))
    return frozenset(names)


def is_ca_certificate(cert: x509.Certificate) -> bool:
    """Whether ``cert`` says it is a CA (basic constraints ``ca=True``)."""
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether ``issuer``'s key signed ``cert`` (and the names chain). Only the signature and
    the names: no validity period, no usage."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


# --------------------------------------------------------------------------- certificate requests

_CURVES = ("secp256r1", "secp384r1", "secp521r1")
MIN_RSA_BITS = 2048
_ACCEPTED_KEYS = (
    "use ECDSA on P-256, P-384 or P-521, or RSA of 2048 bits or more "
    "('llmgw agent join' makes an ECDSA P-256 key)"
)


def make_csr(key: CertificateIssuerPrivateKeyTypes, node_id: str) -> x509.CertificateSigningRequest:
    """A certificate request for node ``node_id`` (CN and SAN DNS = node id), signed by ``key``."""
    validate_node_id(node_id)
    ed_key = isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey)
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_id)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(node_id)]), critical=False)
        .sign(key, None if ed_key else hashes.SHA256())
    )


def load_csr(pem: bytes | str) -> x509.CertificateSigningRequest:
    """Parse a PEM certificate request; CSRError ``csr_malformed`` if it is not one."""
    try:
        data = pem.encode("utf-8") if isinstance(pem, str) else bytes(pem)
        return x509.load_pem_x509_csr(data)
    # UnicodeError is a ValueError; InvalidVersion is cryptography's own (not a ValueError).
    except (ValueError, TypeError, UnsupportedAlgorithm, x509.InvalidVersion) as e:
        raise CSRError(
            f"the certificate request is not a PEM CSR ({e}); send the request that "
            "'llmgw agent join' makes, starting '-----BEGIN CERTIFICATE REQUEST-----'",
            code="csr_malformed",
        ) from e


def _key_kind(key: object) -> str:
    kinds = {
        ed25519.Ed25519PublicKey: "Ed25519",
        ed448.Ed448PublicKey: "Ed448",
        dsa.DSAPublicKey: "DSA",
    }
    for cls, name in kinds.items():
        if isinstance(key, cls):
            return name
    return type(key).__name__


def check_csr(csr: x509.CertificateSigningRequest, node_id: str) -> None:
    """Refuse (CSRError) a request whose signature fails, whose subject CN is not ``node_id``,
    or whose key is weak or of a kind llmgw does not issue for."""
    try:
        signed = csr.is_signature_valid
    except UnsupportedAlgorithm as e:
        raise CSRError(
            f"the certificate request is signed with an algorithm llmgw does not accept ({e}); "
            + _ACCEPTED_KEYS,
            code="csr_weak_key",
        ) from e
    except ValueError as e:
        raise CSRError(
            f"the certificate request's signature cannot be checked ({e}); make a new request "
            "with 'llmgw agent join'",
            code="csr_bad_signature",
        ) from e
    if not signed:
        raise CSRError(
            "the certificate request's signature does not match its key (altered in transit, or "
            "made wrongly); make a new request with 'llmgw agent join'",
            code="csr_bad_signature",
        )
    try:
        names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except ValueError as e:
        raise CSRError(
            f"the certificate request's subject cannot be read ({e}); make a new request with "
            "'llmgw agent join'",
            code="csr_malformed",
        ) from e
    values = [
        v.value.decode(errors="replace") if isinstance(v.value, bytes) else v.value for v in names
    ]
    if values != [node_id]:
        found = "no common name" if not values else "common name " + " and ".join(map(repr, values))
        raise CSRError(
            f"the certificate request has {found}, but it is joining as node {node_id}; make the "
            f"request with CN {node_id} ('llmgw agent join --node-id {node_id}')",
            code="csr_cn_mismatch",
        )
    _check_csr_extensions(csr, node_id)
    try:
        key = csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as e:
        raise CSRError(
            f"the certificate request's key is of a kind llmgw cannot read ({e}); "
            + _ACCEPTED_KEYS,
            code="csr_weak_key",
        ) from e
    if isinstance(key, ec.EllipticCurvePublicKey):
        if key.curve.name not in _CURVES:
            raise CSRError(
                f"the certificate request's key is ECDSA on {key.curve.name} "
                f"({key.curve.key_size} bits), which llmgw does not accept; " + _ACCEPTED_KEYS,
                code="csr_weak_key",
            )
    elif isinstance(key, rsa.RSAPublicKey):
        if key.key_size < MIN_RSA_BITS:
            raise CSRError(
                f"the certificate request's key is RSA of {key.key_size} bits, too weak; "
                + _ACCEPTED_KEYS,
                code="csr_weak_key",
            )
    else:
        raise CSRError(
            f"the certificate request's key is {_key_kind(key)}, which llmgw does not issue "
            "certificates for; " + _ACCEPTED_KEYS,
            code="csr_weak_key",
        )


def _check_csr_extensions(csr: x509.CertificateSigningRequest, node_id: str) -> None:
    """Refuse a request that asks for the control plane's usage or a reserved name. What a
    request asks for is never copied into the certificate; refusing it still tells the operator
    that someone tried, and keeps the policy explicit."""
    try:
        extensions = list(csr.extensions)
    except (ValueError, x509.DuplicateExtension, x509.UnsupportedGeneralNameType) as e:
        raise CSRError(
            f"the certificate request's extensions cannot be read ({e}); make a new request with "
            "'llmgw agent join'",
            code="csr_malformed",
        ) from e
    for ext in extensions:
        value = ext.value
        if isinstance(value, x509.ExtendedKeyUsage) and CONTROL_PLANE_OID in value:
            raise CSRError(
                f"the certificate request asks for the control plane's extended key usage "
                f"{CONTROL_PLANE_OID.dotted_string}, which no node may hold; make the request "
                "with 'llmgw agent join', which asks for none",
                code="csr_forbidden_usage",
            )
        if isinstance(value, x509.SubjectAlternativeName):
            for name in value.get_values_for_type(x509.DNSName):
                text = name.lower().rstrip(".")
                if text in RESERVED_NAMES or text.startswith(RESERVED_PREFIX):
                    raise CSRError(
                        f"the certificate request asks for the name {name!r}, which is reserved "
                        f"for the control plane; a node's request names only itself "
                        f"({node_id}): make it with 'llmgw agent join'",
                        code="csr_reserved_name",
                    )
