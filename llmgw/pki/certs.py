"""What every part of the cluster CA shares: the file names and the constants, the loaded
CA (:class:`Authority`) and an issued identity's files (:class:`Identity`), keys and
certificates to and from PEM, the SAN entries, and the locked, private PKI directory."""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import (
    PublicKeyTypes,
)
from cryptography.x509.oid import NameOID

from llmgw.errors import (
    CertificateError,
    ConfigError,
    FileError,
    PKIError,
)
from llmgw.fsutil import atomic_write, make_dir
from llmgw.netaddr import (
    CONTROL_PLANE_NAME,
    LOOPBACK_HOSTS,
    parse_host,
)

CONTROL_PLANE_CN = "llmgw-control-plane"
CONTROL_PLANE_OID = x509.ObjectIdentifier("2.25.21242712681526740565347737651871607661")
"""Extended key usage only control-plane certificates carry (see the module docstring)."""
SERVER_CN = "llmgw control plane"
DEFAULT_CA_CN = "llmgw cluster CA"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
RENEW_BEFORE = dt.timedelta(days=30)

# Certificates start a little in the past so that a peer whose clock is slightly behind
# accepts them (not part of their lifetime).
BACKDATE = dt.timedelta(minutes=5)
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


def load_key(path: Path) -> ec.EllipticCurvePrivateKey:
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


def key_matches(cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> bool:
    return _spki(cert.public_key()) == _spki(key.public_key())


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def write_public(path: Path, data: bytes) -> None:
    atomic_write(path, data, mode=0o644)


def write_public_if_changed(path: Path, data: bytes) -> None:
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    write_public(path, data)


def make_pki_dir(directory: Path, *, tighten: bool) -> None:
    """Create ``directory`` 0700 if missing; with ``tighten`` also chmod an existing one to 0700."""
    try:
        make_dir(directory, mode=0o700, tighten=tighten)
    except FileError as e:
        raise PKIError(e.message) from e


@contextlib.contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
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


def key_usage(*, ca: bool) -> x509.KeyUsage:
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


def check_stem(name: str) -> None:
    if not _FILE_STEM.fullmatch(name) or name == "ca":
        raise ConfigError(
            f"{name!r} cannot name a certificate file; use letters, digits, '_', '.', '-' "
            "(and not 'ca', which is the CA's own file)",
            key="name",
        )


def new_private_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 key, the kind every llmgw identity is made of."""
    return ec.generate_private_key(ec.SECP256R1())


def serial_hex(cert: x509.Certificate) -> str:
    """The certificate's serial number in lowercase hex, as the store keeps it."""
    return format(cert.serial_number, "x")


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


def _parse_host(host: str) -> x509.GeneralName | None:
    """A SAN entry for ``host``: IPAddress if it parses as one, else DNSName; None if blank."""
    name = parse_host(host)
    if name is None:
        return None
    if isinstance(name, str):
        return x509.DNSName(name)
    return x509.IPAddress(name)


def server_sans(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """The control plane's server SANs: ``hosts``, the reserved name, loopback."""
    return _san_entries([*hosts, CONTROL_PLANE_NAME])


def _san_entries(hosts: Iterable[str]) -> list[x509.GeneralName]:
    entries: list[x509.GeneralName] = []
    for host in [*hosts, *LOOPBACK_HOSTS]:
        entry = _parse_host(host)
        if entry is not None and entry not in entries:
            entries.append(entry)
    return entries


def cert_sans(cert: x509.Certificate) -> list[x509.GeneralName]:
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return [normal_san(n) for n in ext.value]


def normal_san(name: x509.GeneralName) -> x509.GeneralName:
    if isinstance(name, x509.DNSName):
        return x509.DNSName(name.value.lower().rstrip("."))
    return name
