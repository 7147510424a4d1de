"""The cluster CA itself: created, loaded, and rotated (a new CA that the old one
cross-signs, both trusted for an overlap, then the old one dropped).

A rotation (``llmgw ctl cert rotate-ca``) makes a new CA with a new key and the old CA's
own subject name, and has the old CA sign that new key too: the cross-certificate
``ca-cross.crt`` (RFC 4210's "NewWithOld"), valid until the old CA is dropped. Whoever
trusts only the old CA still verifies what the new one issued, through the cross-
certificate that every control-plane certificate carries after its leaf; whoever has the
trust bundle (``trust.crt``: the new CA, then the old) verifies both directly. The shared
subject name is what makes this work with the CAs llmgw has always made (path length 0):
a certificate whose issuer and subject names are equal is self-issued, and self-issued CA
certificates do not count against a path length (RFC 5280, 4.2.1.9).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from llmgw.errors import (
    CertificateError,
    ConfigError,
    NoAuthority,
    PKIError,
)
from llmgw.fsutil import atomic_write, write_private
from llmgw.pki.certs import (
    BACKDATE,
    CA_CERT,
    CA_KEY,
    DEFAULT_CA_CN,
    Authority,
    bundle_pem,
    cert_pem,
    dir_lock,
    fingerprint,
    key_matches,
    key_pem,
    key_usage,
    load_cert,
    load_key,
    make_pki_dir,
    new_private_key,
    utc_now,
    write_public,
    write_public_if_changed,
)
from llmgw.pki.verify import (
    is_ca_certificate,
)


def ca_present(directory: Path) -> bool:
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
    if ca_present(directory):  # decided before touching anything
        if exist_ok:
            return load_ca(directory)
        raise _already_exists(directory)
    make_pki_dir(directory, tighten=True)
    with dir_lock(directory):
        return init_ca_locked(directory, common_name, valid_days, exist_ok)


def init_ca_locked(directory: Path, common_name: str, valid_days: int, exist_ok: bool) -> Authority:
    if ca_present(directory):
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
    write_public(directory / CA_CERT, cert_pem(cert))
    return Authority(cert=cert, key=key, directory=directory)


def ca_certificate(
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
        .not_valid_before(utc_now() - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(ca=True), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(aki, critical=False)
        .sign(issuer_key, hashes.SHA256())
    )


def _self_signed_ca(
    key: ec.EllipticCurvePrivateKey, name: x509.Name, lifetime: dt.timedelta
) -> x509.Certificate:
    return ca_certificate(
        name, key.public_key(), issuer=name, issuer_key=key, not_after=utc_now() + lifetime
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
    key = load_key(key_path)
    if not key_matches(cert, key):
        raise CertificateError(
            f"{key_path} does not belong to {cert_path}; restore the matching pair from a backup"
        )
    if not is_ca_certificate(cert):
        raise CertificateError(
            f"{cert_path} is not a CA certificate; point at the directory made by "
            "'llmgw ctl cert init-ca'"
        )
    if cert.not_valid_after_utc <= utc_now():
        raise CertificateError(
            f"the CA in {directory} expired on {cert.not_valid_after_utc:%Y-%m-%d}; create a new one "
            "with 'llmgw ctl cert init-ca' in another directory and re-issue every certificate"
        )
    return Authority(cert=cert, key=key, directory=directory)


def ensure_ca(directory: Path) -> Authority:
    """Load the CA in ``directory``, creating it first if there is none."""
    return init_ca(directory, exist_ok=True)


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


def cross_sign(
    issuer: Authority, ca_cert: x509.Certificate, *, until: dt.datetime
) -> x509.Certificate:
    """``ca_cert``'s subject and key, as a CA certificate signed by ``issuer`` and valid until
    ``until`` (never past ``issuer``'s own end): the old CA's word for the new one."""
    public = ca_cert.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise CertificateError("only an llmgw CA (ECDSA) can be cross-signed")
    return ca_certificate(
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


def write_trust(directory: Path) -> list[x509.Certificate]:
    certs = trust_certificates(directory)
    write_public_if_changed(directory / TRUST_BUNDLE, bundle_pem(certs))
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
    if not ca_present(directory):
        raise NoAuthority(str(directory))
    with dir_lock(directory):
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
        write_public(directory / PREVIOUS_CA_CERT, cert_pem(old.cert))
        write_public(directory / CROSS_CERT, cert_pem(cross))
        write_rotation(directory, rotation)
        write_private(directory / CA_KEY, key_pem(key))
        write_public(directory / CA_CERT, cert_pem(cert))
        write_trust(directory)
    return rotation


def finish_rotation(directory: Path) -> Rotation:
    """Drop the old CA of the rotation under way: its certificate leaves the trust bundle,
    its key and the cross-certificate are deleted. PKIError when none is under way."""
    directory = Path(directory)
    with dir_lock(directory):
        return finish_rotation_locked(directory)


def finish_rotation_locked(directory: Path) -> Rotation:
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
    write_trust(directory)
    return done


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(seconds))
