"""The cluster CA and the certificates it issues (ECDSA P-256, SHA-256).

Layout of a PKI directory (mode 0700)::

    ca.crt  ca.key            the cluster CA (key 0600)
    trust.crt                 what verifiers trust: the CA, and during a rotation the old one
    server.crt server.key     the control plane's TLS server certificate
    client.crt client.key     the control plane's client certificate (CN ``llmgw-control-plane``)

and during a CA rotation (see "CA rotation" below) ``previous-ca.crt``/``previous-ca.key``,
``ca-cross.crt`` and ``rotation.json``.

Node certificates carry CN = SAN DNS = node id and both clientAuth and serverAuth, because an
agent presents the same certificate to the control plane and on its own data plane.

**The control plane's identity.** Being issued by the cluster CA is not enough to act as the
control plane: a node is issued by it too, and a node id may look like any host name. Both
control-plane certificates (server and client) therefore carry what no node certificate can:

- the extended key usage :data:`CONTROL_PLANE_OID`, ``2.25.21242712681526740565347737651871607661``
  (an OID under the ``2.25`` arc of ITU-T X.667, derived from UUID
  ``0ffb3298-e281-4223-b680-f5913b09eb6d``: anyone may mint one there without registration,
  and no other body will ever assign this one);
- the DNS name :data:`CONTROL_PLANE_NAME` among their SANs, which :func:`validate_node_id`
  refuses as a node id.

Node certificates are built here from the node id alone (never from what a CSR asks for), and
:func:`check_csr` refuses a request that asks for that usage or a reserved name, so neither
can reach a node. Every client of the control plane checks one or the other: the agent's
stream pins the TLS name to :data:`CONTROL_PLANE_NAME` (the gRPC library cannot check an
extended key usage), the join client, the update download, the data plane, ``llmgw ctl`` and
a standby forwarding to the leader check the OID with :func:`control_plane_problem` once the
handshake is done (the last three through :mod:`llmgw.controlpeer`).

Every file is written atomically (llmgw.fsutil); private keys are created 0600 and are never
readable by anyone else, not even for an instant. Node ids and host names are checked by
llmgw.netaddr, which also knows this machine's addresses.

Why one module of ~1,150 lines: it is one concept, what the cluster CA signs and how. The CA,
its rotation, the leaf certificates and the CSR checks share one policy (the control plane's identity above,
the one shape of a node certificate that :func:`sign_csr` and :func:`issue_node_cert` both
build, the SANs a control plane must carry), and splitting them would scatter that policy
over modules that must change together.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificatePublicKeyTypes,
    PublicKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import (
    CertificateError,
    ConfigError,
    CSRError,
    FileError,
    NoAuthority,
    PKIError,
)
from llmgw.fsutil import atomic_write, make_dir, write_private
from llmgw.netaddr import (
    CONTROL_PLANE_NAME,
    LOOPBACK_HOSTS,
    RESERVED_NAMES,
    RESERVED_PREFIX,
    parse_host,
    validate_node_id,
)

CONTROL_PLANE_CN = "llmgw-control-plane"
CONTROL_PLANE_OID = x509.ObjectIdentifier("2.25.21242712681526740565347737651871607661")
"""Extended key usage only control-plane certificates carry (see the module docstring)."""
SERVER_CN = "llmgw control plane"
DEFAULT_CA_CN = "llmgw cluster CA"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
RENEW_BEFORE = dt.timedelta(days=30)

# Certificates start a little in the past so that a peer whose clock is slightly behind accepts them.
_BACKDATE = dt.timedelta(minutes=5)
# Public: how far certificates are backdated for clock skew (not part of their lifetime).
BACKDATE = _BACKDATE
_FILE_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(eq=False)
class Authority:
    """A loaded cluster CA.

    One object per control plane, shared by every part that signs (enrolment, renewal,
    update orders): a CA rotation moves it to the new CA in place (:meth:`move_to`), so each
    of them signs with the new key from the next signature on."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    directory: Path

    def ca_hash(self) -> str:
        """``sha256:<hex>`` of the CA certificate's DER SubjectPublicKeyInfo (kubeadm's format)."""
        return fingerprint(self.cert.public_key())

    def move_to(self, other: Authority) -> None:
        """Sign as ``other`` from now on (a rotation's new CA, loaded from the same directory)."""
        self.cert, self.key, self.directory = other.cert, other.key, other.directory


@dataclass(frozen=True)
class Identity:
    """Paths of a certificate, its private key and the CA certificate that verifies it."""

    cert: Path
    key: Path
    ca: Path


# --------------------------------------------------------------------------- helpers


def fingerprint(public_key: PublicKeyTypes) -> str:
    """``sha256:<hex>`` of the DER SubjectPublicKeyInfo of ``public_key``."""
    der = public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(der).hexdigest()


def cert_common_name(cert: x509.Certificate) -> str:
    """The subject CN of ``cert``; CertificateError if it has none."""
    attrs = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not attrs:
        raise CertificateError(
            f"certificate '{cert.subject.rfc4514_string()}' has no common name; "
            "use a certificate issued by 'llmgw ctl cert'"
        )
    value = attrs[0].value
    return value.decode() if isinstance(value, bytes) else value


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


def load_cert(path: Path) -> x509.Certificate:
    """Read a PEM certificate; CertificateError naming the file if it cannot be read or parsed."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CertificateError(
            f"cannot read certificate {path}: {e.strerror or e}; check the path and its permissions"
        ) from e
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise CertificateError(
            f"{path} is not a PEM certificate ({e}); replace it with the certificate that was issued"
        ) from e


def _load_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CertificateError(
            f"cannot read private key {path}: {e.strerror or e}; check the path and its permissions"
        ) from e
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError as e:
        raise CertificateError(
            f"{path} is an encrypted private key; llmgw needs an unencrypted key (mode 0600)"
        ) from e
    except (ValueError, UnsupportedAlgorithm) as e:
        raise CertificateError(
            f"{path} is not a readable PEM private key ({e}); restore it from a backup"
        ) from e
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateError(
            f"{path} holds a {type(key).__name__}, not an ECDSA key; llmgw issues ECDSA P-256 keys"
        )
    return key


def _spki(public_key: PublicKeyTypes) -> bytes:
    return public_key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    return _spki(cert.public_key()) == _spki(key.public_key())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write_public(path: Path, data: bytes) -> None:
    atomic_write(path, data, mode=0o644)


def _write_public_if_changed(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    _write_public(path, data)


def _make_dir(directory: Path, *, tighten: bool) -> None:
    """Create ``directory`` 0700 if missing; with ``tighten`` also chmod an existing one to 0700."""
    try:
        make_dir(directory, mode=0o700, tighten=tighten)
    except FileError as e:
        raise PKIError(e.message) from e


@contextlib.contextmanager
def _dir_lock(directory: Path) -> Iterator[None]:
    """Exclusive flock on the directory itself, so two processes never create a CA at once."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise PKIError(f"cannot open directory {directory}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as an unencrypted PKCS#8 PEM, the form every llmgw key file has."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    """``cert`` as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    """Signatures only; a CA also signs certificates and CRLs."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _check_stem(name: str) -> None:
    if not _FILE_STEM.fullmatch(name) or name == "ca":
        raise ConfigError(
            f"{name!r} cannot name a certificate file; use letters, digits, '_', '.', '-' "
            "(and not 'ca', which is the CA's own file)",
            key="name",
        )


# --------------------------------------------------------------------------- names


def control_plane_names(cert: x509.Certificate) -> frozenset[str]:
    """Every name in ``cert``'s SANs: DNS names lower-cased without a final dot, addresses as
    text. For a control-plane certificate these are the names a node id must never take."""
    names: set[str] = set()
    for entry in _cert_sans(cert):
        if isinstance(entry, x509.DNSName):
            names.add(entry.value)
        elif isinstance(entry, x509.IPAddress):
            names.add(str(entry.value))
    return frozenset(names)


def _parse_host(host: str) -> x509.GeneralName | None:
    """A SAN entry for ``host``: IPAddress if it parses as one, else DNSName; None if blank."""
    name = parse_host(host)
    if name is None:
        return None
    if isinstance(name, str):
        return x509.DNSName(name)
    return x509.IPAddress(name)


def _server_sans(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """The control plane's server SANs: ``hosts``, the reserved name, loopback."""
    return _san_entries([*hosts, CONTROL_PLANE_NAME])


def _san_entries(hosts: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in [*hosts, *LOOPBACK_HOSTS]:
        entry = _parse_host(host)
        if entry is not None and entry not in entries:
            entries.append(entry)
    return entries


def _cert_sans(cert: x509.Certificate) -> list[x509.GeneralName]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return [_normal_san(n) for n in ext.value]


def _normal_san(name: x509.GeneralName) -> x509.GeneralName:
    if isinstance(name, x509.DNSName):
        return x509.DNSName(name.value.lower().rstrip("."))
    return name


# --------------------------------------------------------------------------- the CA


def _ca_present(directory: Path) -> bool:
    return (directory / CA_CERT).exists() or (directory / CA_KEY).exists()


def _already_exists(directory: Path) -> PKIError:
    try:
        what = f"ca-hash {fingerprint(load_cert(directory / CA_CERT).public_key())}"
    except CertificateError:
        what = f"its {CA_CERT} is missing or unreadable"
    return PKIError(f"a CA already exists in {directory} ({what}); refusing to overwrite it")


def init_ca(
    directory: Path,
    *,
    common_name: str = DEFAULT_CA_CN,
    valid_days: int = 3650,
    exist_ok: bool = False,
) -> Authority:
    """Create a CA in ``directory``; if one exists, load it (``exist_ok``) or raise PKIError."""
    directory = Path(directory)
    if _ca_present(directory):  # decided before touching anything
        if exist_ok:
            return load_ca(directory)
        raise _already_exists(directory)
    _make_dir(directory, tighten=True)
    with _dir_lock(directory):
        return _init_ca_locked(directory, common_name, valid_days, exist_ok)


def _init_ca_locked(
    directory: Path, common_name: str, valid_days: int, exist_ok: bool
) -> Authority:
    if _ca_present(directory):
        if exist_ok:
            return load_ca(directory)
        raise _already_exists(directory)
    if valid_days < 1:
        raise ConfigError(f"must be at least 1, not {valid_days}", key="valid_days")
    key = new_private_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = _self_signed_ca(key, name, dt.timedelta(days=valid_days))
    # Key first: a crash in between leaves a key without a certificate, which load_ca reports.
    write_private(directory / CA_KEY, key_pem(key))
    _write_public(directory / CA_CERT, cert_pem(cert))
    return Authority(cert=cert, key=key, directory=directory)


def _ca_cert(
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    *,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    not_after: dt.datetime,
) -> x509.Certificate:
    """A CA certificate for ``public_key``: self-signed when ``issuer_key`` is its own key,
    else a cross-certificate. Path length 0 (only leaves below it)."""
    ski = x509.SubjectKeyIdentifier.from_public_key(public_key)
    aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
        x509.SubjectKeyIdentifier.from_public_key(issuer_key.public_key())
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(aki, critical=False)
        .sign(issuer_key, hashes.SHA256())
    )


def _self_signed_ca(
    key: ec.EllipticCurvePrivateKey, name: x509.Name, lifetime: dt.timedelta
) -> x509.Certificate:
    return _ca_cert(
        name, key.public_key(), issuer=name, issuer_key=key, not_after=_now() + lifetime
    )


def load_ca(directory: Path) -> Authority:
    """Load the CA in ``directory``: NoAuthority if there is none, CertificateError if it is bad."""
    directory = Path(directory)
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    has_cert, has_key = cert_path.exists(), key_path.exists()
    if not has_cert and not has_key:
        raise NoAuthority(str(directory))
    if not has_cert:
        raise CertificateError(
            f"{cert_path} is missing but {key_path} exists; restore {CA_CERT} from a backup, or "
            f"move {directory} aside and run 'llmgw ctl cert init-ca' to start a new CA "
            "(certificates issued by the old one will no longer be trusted)"
        )
    if not has_key:
        raise CertificateError(
            f"{key_path} is missing but {cert_path} exists; restore {CA_KEY} from a backup, or "
            f"move {directory} aside and run 'llmgw ctl cert init-ca' to start a new CA "
            "(certificates issued by the old one will no longer be trusted)"
        )
    cert = load_cert(cert_path)
    key = _load_key(key_path)
    if not _key_matches(cert, key):
        raise CertificateError(
            f"{key_path} does not belong to {cert_path}; restore the matching pair from a backup"
        )
    if not is_ca_certificate(cert):
        raise CertificateError(
            f"{cert_path} is not a CA certificate; point at the directory made by "
            "'llmgw ctl cert init-ca'"
        )
    if cert.not_valid_after_utc <= _now():
        raise CertificateError(
            f"the CA in {directory} expired on {cert.not_valid_after_utc:%Y-%m-%d}; create a new one "
            "with 'llmgw ctl cert init-ca' in another directory and re-issue every certificate"
        )
    return Authority(cert=cert, key=key, directory=directory)


def is_ca_certificate(cert: x509.Certificate) -> bool:
    """Whether ``cert`` says it is a CA (basic constraints ``ca=True``)."""
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def ensure_ca(directory: Path) -> Authority:
    """Load the CA in ``directory``, creating it first if there is none."""
    return init_ca(directory, exist_ok=True)


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
    now = _now()
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
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
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
    _write_public(identity.cert, cert_pem(cert))
    _write_public_if_changed(identity.ca, cert_pem(ca.cert))
    return identity


def _prepare(out_dir: Path, name: str, valid_days: int) -> Path:
    _check_stem(name)
    if valid_days < 1:
        raise ConfigError(f"must be at least 1, not {valid_days}", key="valid_days")
    out_dir = Path(out_dir)
    _make_dir(out_dir, tighten=False)
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
        sans=_server_sans(hosts),
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


# --------------------------------------------------------------------------- certificate requests

_CURVES = ("secp256r1", "secp384r1", "secp521r1")
MIN_RSA_BITS = 2048
_ACCEPTED_KEYS = (
    "use ECDSA on P-256, P-384 or P-521, or RSA of 2048 bits or more "
    "('llmgw agent join' makes an ECDSA P-256 key)"
)


def new_private_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 key, the kind every llmgw identity is made of."""
    return ec.generate_private_key(ec.SECP256R1())


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
    remaining = (ca.cert.not_valid_after_utc - _now()).total_seconds()
    span = dt.timedelta(seconds=max(0.0, min(float(lifetime), remaining)))
    return _node_leaf(ca, csr.public_key(), node_id, span)


def serial_hex(cert: x509.Certificate) -> str:
    """The certificate's serial number in lowercase hex, as the store keeps it."""
    return format(cert.serial_number, "x")


# --------------------------------------------------------------------------- CA rotation
#
# A rotation (``llmgw ctl cert rotate-ca``) makes a new CA with a new key and the old CA's
# own subject name, and has the old CA sign that new key too: the cross-certificate
# ``ca-cross.crt`` (RFC 4210's "NewWithOld"), valid until the old CA is dropped. Whoever
# trusts only the old CA still verifies what the new one issued, through the cross-
# certificate that every control-plane certificate carries after its leaf; whoever has the
# trust bundle (``trust.crt``: the new CA, then the old) verifies both directly. The shared
# subject name is what makes this work with the CAs llmgw has always made (path length 0):
# a certificate whose issuer and subject names are equal is self-issued, and self-issued CA
# certificates do not count against a path length (RFC 5280, 4.2.1.9).
#
# Files of a rotation, beside ca.crt/ca.key (now the new CA):
#   previous-ca.crt previous-ca.key   the old CA, until it is dropped (key 0600)
#   ca-cross.crt                      the new CA's key, signed by the old CA
#   trust.crt                         what every verifier trusts: the new CA, then the old
#   rotation.json                     the pins, when it started, when the old CA is dropped

TRUST_BUNDLE = "trust.crt"
PREVIOUS_CA_CERT = "previous-ca.crt"
PREVIOUS_CA_KEY = "previous-ca.key"
CROSS_CERT = "ca-cross.crt"
ROTATION_FILE = "rotation.json"
DEFAULT_OVERLAP = 7 * 86400.0
"""Seconds both CAs are trusted after a rotation, unless ``--overlap`` says otherwise."""


@dataclass(frozen=True)
class Rotation:
    """The latest CA rotation of a PKI directory: the old and new CA's pins (``ca-hash``),
    when it started, when the old CA is (or was) dropped, and whether it has been."""

    previous: str
    current: str
    started: float
    drop_at: int
    dropped: int | None = None

    @property
    def active(self) -> bool:
        """Both CAs are trusted now (the old one not dropped yet)."""
        return self.dropped is None

    def to_json(self) -> dict[str, object]:
        return {
            "previous": self.previous,
            "current": self.current,
            "started": self.started,
            "drop_at": self.drop_at,
            "dropped": self.dropped,
        }

    @classmethod
    def from_json(cls, data: object) -> Rotation:
        """The record :meth:`to_json` made; ValueError, KeyError or TypeError when ``data``
        is not one."""
        if not isinstance(data, dict):
            raise TypeError(f"a rotation record is a JSON object, not {type(data).__name__}")
        return cls(
            previous=str(data["previous"]),
            current=str(data["current"]),
            started=float(data["started"]),
            drop_at=int(data["drop_at"]),
            dropped=None if data.get("dropped") is None else int(data["dropped"]),
        )


def load_certs(data: bytes, *, what: str = "the bundle") -> list[x509.Certificate]:
    """Every certificate in a PEM bundle, in order; CertificateError naming ``what`` when
    there is none or one does not parse."""
    try:
        certs = x509.load_pem_x509_certificates(bytes(data))
    except ValueError as e:
        raise CertificateError(
            f"{what} is not a list of PEM certificates ({e}); replace it with the cluster's "
            "trust bundle"
        ) from e
    return certs


def load_bundle(path: Path) -> list[x509.Certificate]:
    """The certificates of a PEM file (a CA, or a trust bundle of several)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CertificateError(
            f"cannot read {path}: {e.strerror or e}; check the path and its permissions"
        ) from e
    return load_certs(data, what=str(path))


def bundle_pem(certs: Iterable[x509.Certificate]) -> bytes:
    """Certificates as one PEM file, in the order given."""
    return b"".join(cert_pem(c) for c in certs)


def issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether ``issuer``'s key signed ``cert`` (and the names chain). Only the signature and
    the names: no validity period, no usage."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature, UnsupportedAlgorithm):
        return False
    return True


def cross_sign(
    issuer: Authority, ca_cert: x509.Certificate, *, until: dt.datetime
) -> x509.Certificate:
    """``ca_cert``'s subject and key, as a CA certificate signed by ``issuer`` and valid until
    ``until`` (never past ``issuer``'s own end): the old CA's word for the new one."""
    public = ca_cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise CertificateError("only an llmgw CA (ECDSA) can be cross-signed")
    return _ca_cert(
        ca_cert.subject,
        public,
        issuer=issuer.cert.subject,
        issuer_key=issuer.key,
        not_after=min(until, issuer.cert.not_valid_after_utc),
    )


def read_rotation(directory: Path) -> Rotation | None:
    """The latest rotation of the PKI directory, or None when its CA was never rotated."""
    path = Path(directory) / ROTATION_FILE
    try:
        return Rotation.from_json(json.loads(path.read_bytes()))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PKIError(f"cannot read {path}: {e.strerror or e}; check its permissions") from e
    except (ValueError, KeyError, TypeError) as e:
        raise PKIError(
            f"{path} is not a rotation record ({e}); restore it from a backup, or, when no "
            "rotation is under way, remove it"
        ) from e


def trust_certificates(directory: Path) -> list[x509.Certificate]:
    """What the control plane trusts: its CA, then the one a rotation replaced (until dropped)."""
    directory = Path(directory)
    certs = [load_cert(directory / CA_CERT)]
    previous = directory / PREVIOUS_CA_CERT
    if previous.exists():
        certs.append(load_cert(previous))
    return certs


def cross_certificates(directory: Path) -> list[x509.Certificate]:
    """The cross-certificate of a rotation under way (none otherwise)."""
    path = Path(directory) / CROSS_CERT
    return [load_cert(path)] if path.exists() else []


def rotation_json(rotation: Rotation) -> bytes:
    """What ``rotation.json`` holds for ``rotation``."""
    return (json.dumps(rotation.to_json(), sort_keys=True, indent=2) + "\n").encode()


def write_rotation(
    directory: Path, rotation: Rotation, *, owner: tuple[int, int] | None = None
) -> None:
    """``rotation.json`` of ``directory`` (0600; ``owner`` (uid, gid): given to them)."""
    atomic_write(Path(directory) / ROTATION_FILE, rotation_json(rotation), mode=0o600, owner=owner)


def _write_trust(directory: Path) -> list[x509.Certificate]:
    certs = trust_certificates(directory)
    _write_public_if_changed(directory / TRUST_BUNDLE, bundle_pem(certs))
    return certs


def rotate_ca(
    directory: Path, *, overlap: float = DEFAULT_OVERLAP, valid_days: int = 3650
) -> Rotation:
    """Replace the CA in ``directory`` with a new one (new key, same subject) that the old one
    cross-signs, both trusted for ``overlap`` seconds. The leaves are the caller's to reissue
    (:func:`ensure_server_identity` does). PKIError while a rotation is under way."""
    directory = Path(directory)
    if not (math.isfinite(overlap) and overlap >= 1):
        raise ConfigError(
            f"must be at least 1s (a duration like 7d), not {overlap!r}", key="overlap"
        )
    if valid_days < 1:
        raise ConfigError(f"must be at least 1, not {valid_days}", key="valid_days")
    if not _ca_present(directory):
        raise NoAuthority(str(directory))
    with _dir_lock(directory):
        old = load_ca(directory)
        current = read_rotation(directory)
        if current is not None and current.active:
            raise PKIError(
                f"a CA rotation is under way: CA {current.previous} is dropped at "
                f"{_utc(current.drop_at)}; drop it first ('llmgw ctl cert finish-rotation'), "
                "then rotate again"
            )
        started = time.time()
        drop_at = math.ceil(started + overlap)
        end = dt.datetime.fromtimestamp(drop_at, dt.UTC)
        if old.cert.not_valid_after_utc < end:
            drop_at = int(old.cert.not_valid_after_utc.timestamp())
            end = old.cert.not_valid_after_utc
        key = new_private_key()
        cert = _self_signed_ca(key, old.cert.subject, dt.timedelta(days=valid_days))
        cross = cross_sign(old, cert, until=end)
        rotation = Rotation(
            previous=old.ca_hash(),
            current=fingerprint(key.public_key()),
            started=started,
            drop_at=drop_at,
        )
        # The old CA is kept first: a crash at any later step leaves it recoverable.
        write_private(directory / PREVIOUS_CA_KEY, key_pem(old.key))
        _write_public(directory / PREVIOUS_CA_CERT, cert_pem(old.cert))
        _write_public(directory / CROSS_CERT, cert_pem(cross))
        write_rotation(directory, rotation)
        write_private(directory / CA_KEY, key_pem(key))
        _write_public(directory / CA_CERT, cert_pem(cert))
        _write_trust(directory)
    return rotation


def finish_rotation(directory: Path) -> Rotation:
    """Drop the old CA of the rotation under way: its certificate leaves the trust bundle,
    its key and the cross-certificate are deleted. PKIError when none is under way."""
    directory = Path(directory)
    with _dir_lock(directory):
        return _finish_rotation_locked(directory)


def _finish_rotation_locked(directory: Path) -> Rotation:
    rotation = read_rotation(directory)
    if rotation is None or not rotation.active:
        raise PKIError(
            f"no CA rotation is under way in {directory}; 'llmgw ctl cert rotate-ca' starts one"
        )
    done = Rotation(
        previous=rotation.previous,
        current=rotation.current,
        started=rotation.started,
        drop_at=rotation.drop_at,
        dropped=int(time.time()),
    )
    write_rotation(directory, done)
    for name in (CROSS_CERT, PREVIOUS_CA_CERT, PREVIOUS_CA_KEY):
        try:
            (directory / name).unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise PKIError(
                f"cannot remove {directory / name}: {e.strerror or e}; remove it by hand"
            ) from e
    _write_trust(directory)
    return done


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))


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
        key = _load_key(identity.key)
        if not _key_matches(cert, key):
            return False
        cert.verify_directly_issued_by(ca.cert)
        if cert_common_name(cert) != common_name:
            return False
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        if usage not in eku or CONTROL_PLANE_OID not in eku:
            return False
    except (CertificateError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    if cert.not_valid_after_utc - _now() < RENEW_BEFORE:
        return False
    if cert.not_valid_before_utc > _now() + _BACKDATE:
        return False
    have = _cert_sans(cert)
    return all(_normal_san(s) in have for s in sans)


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
    wanted = _server_sans(hosts)  # validate hosts before touching anything
    _make_dir(pki_dir, tighten=True)
    with _dir_lock(pki_dir):
        ca = _init_ca_locked(pki_dir, DEFAULT_CA_CN, 3650, exist_ok=True)
        _tighten_key(pki_dir / CA_KEY)
        rotation = read_rotation(pki_dir)
        if rotation is not None and rotation.active and rotation.drop_at <= time.time():
            _finish_rotation_locked(pki_dir)
        _tighten_key(pki_dir / PREVIOUS_CA_KEY)
        _write_trust(pki_dir)
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
    _write_public_if_changed(path, leaf + chain)


__all__ = [
    "BACKDATE",
    "CA_CERT",
    "CA_KEY",
    "CONTROL_PLANE_CN",
    "CONTROL_PLANE_OID",
    "CROSS_CERT",
    "DEFAULT_OVERLAP",
    "MIN_RSA_BITS",
    "PREVIOUS_CA_CERT",
    "PREVIOUS_CA_KEY",
    "ROTATION_FILE",
    "TRUST_BUNDLE",
    "Authority",
    "Identity",
    "Rotation",
    "bundle_pem",
    "cert_common_name",
    "cert_pem",
    "check_csr",
    "control_plane_names",
    "control_plane_problem",
    "cross_certificates",
    "cross_sign",
    "ensure_ca",
    "ensure_server_identity",
    "fingerprint",
    "finish_rotation",
    "init_ca",
    "is_ca_certificate",
    "issue_control_plane_client_cert",
    "issue_node_cert",
    "issue_server_cert",
    "issued_by",
    "key_pem",
    "load_bundle",
    "load_ca",
    "load_cert",
    "load_certs",
    "load_csr",
    "make_csr",
    "new_private_key",
    "read_rotation",
    "rotate_ca",
    "rotation_json",
    "serial_hex",
    "sign_csr",
    "trust_certificates",
    "write_rotation",
]
