"""The cluster CA's export, for another control-plane instance to sign and verify as this one
does: what it carries (:class:`CAExport`), read from one instance's PKI directory (written
into another's by :mod:`llmgw.caimport`), and sealed under a passphrase (scrypt, then
AES-256-GCM).

``llmgw ctl cert export-ca`` has a running instance seal it (:mod:`llmgw.server.admin.ca`);
``llmgw server --import-ca FILE`` opens it and installs it (:mod:`llmgw.cli.server`). The
file is one JSON object::

    {"format": "llmgw-ca-export/1", "ca_hash": "sha256:…", "cluster_id": "…",
     "exported_at": 1767225600, "cipher": "aes-256-gcm",
     "kdf": {"name": "scrypt", "n": 131072, "r": 8, "p": 1, "salt": B64},
     "check": B64, "nonce": B64, "ciphertext": B64}

Everything but ``ciphertext`` is the header: in clear, so that an operator can see which CA
a file holds, and bound to the ciphertext as GCM's associated data (its canonical JSON), so
that a byte changed anywhere fails the opening. scrypt makes 64 bytes of the passphrase and
the salt: the AES key, then a key whose HMAC of a fixed label is ``check``, which tells a
wrong passphrase from a file altered after its export.

It carries the CA's certificate and key; during a CA rotation the old CA's certificate, the
cross-certificate and the rotation record (so the new instance trusts both CAs, carries the
cross-certificate after its own certificates and drops the old CA when the others do); the
rotation record of a finished rotation too (``ctl cert`` shows when the old CA was dropped,
and agents are sent the trust bundle alike); the cluster id; and the admin token, so that
``llmgw ctl`` with one token works against every instance. Not carried: an instance's own
server and client certificates (each instance makes its own at start, so that one can be
retired alone), ``trust.crt`` (made from the CAs), and the old CA's key, which signs nothing
after a rotation (:func:`llmgw.pki.rotate_ca` keeps it on the machine that rotated only to
undo a rotation that crashed half-way).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from llmgw import pki
from llmgw.errors import CAExportError, ConfigError, FileError

__all__ = [
    "CA_PASSPHRASE_ENV",
    "FORMAT",
    "KDF",
    "MIN_PASSPHRASE",
    "CAExport",
    "Header",
    "check_passphrase",
    "collect",
    "read_export",
    "read_header",
    "seal",
    "unseal",
]

FORMAT = "llmgw-ca-export/1"
_FAMILY = "llmgw-ca-export/"
CA_PASSPHRASE_ENV = "LLMGW_CA_PASSPHRASE"
MIN_PASSPHRASE = 12
MAX_EXPORT = 1 << 20
"""The largest file read as an export: one is a few KiB."""

_CIPHER = "aes-256-gcm"
_CHECK_LABEL = b"llmgw-ca-export/1 passphrase check"
_HEADER_KEYS = frozenset(
    {"format", "ca_hash", "cluster_id", "exported_at", "cipher", "kdf", "check", "nonce"}
)
# What a file's kdf may ask for: memory 128 * n * r bytes, time about n * r * p.
_MAX_N, _MIN_N, _MAX_R, _MAX_P = 2**20, 2**14, 32, 16
_MAX_MEMORY = 256 * 1024 * 1024


@dataclass(frozen=True)
class KDF:
    """scrypt's cost: 2**17 (128 MiB and about half a second per try) makes guessing a
    passphrase of a stolen file dear; tests pass a cheaper one."""

    n: int = 2**17
    r: int = 8
    p: int = 1


@dataclass(frozen=True)
class CAExport:
    """What another instance needs to sign and verify as this one (see the module's doc)."""

    ca_cert: x509.Certificate
    ca_key: ec.EllipticCurvePrivateKey
    cluster_id: str
    admin_token: str
    previous_ca_cert: x509.Certificate | None = None
    cross_cert: x509.Certificate | None = None
    rotation: pki.Rotation | None = None

    @property
    def ca_hash(self) -> str:
        return pki.fingerprint(self.ca_cert.public_key())

    def problem(self) -> str | None:
        """None when the parts fit together; else what does not."""
        if pki.fingerprint(self.ca_key.public_key()) != self.ca_hash:
            return "the CA key does not belong to the CA certificate"
        if not pki.is_ca_certificate(self.ca_cert):
            return "the CA certificate is not a CA's"
        if self.ca_cert.not_valid_after_utc.timestamp() <= time.time():
            return f"the CA expired on {self.ca_cert.not_valid_after_utc:%Y-%m-%d}"
        if not self.admin_token or self.admin_token != self.admin_token.strip():
            return "the admin token is empty or has spaces around it"
        rotation = self.rotation
        if rotation is not None and rotation.current != self.ca_hash:
            return f"the rotation record is of CA {rotation.current}, not of {self.ca_hash}"
        if rotation is None or not rotation.active:
            if self.previous_ca_cert is not None or self.cross_cert is not None:
                return "it holds an old CA, but no CA rotation is under way"
            return None
        previous, cross = self.previous_ca_cert, self.cross_cert
        if previous is None or cross is None:
            return "a CA rotation is under way, but the old CA or the cross-certificate is missing"
        if pki.fingerprint(previous.public_key()) != rotation.previous:
            return f"the old CA is not {rotation.previous}, the one the rotation replaced"
        if pki.fingerprint(cross.public_key()) != self.ca_hash or not pki.issued_by(
            cross, previous
        ):
            return "the cross-certificate is not the old CA's signature of the CA"
        return None

    def to_json(self) -> dict[str, Any]:
        def pem(cert: x509.Certificate | None) -> str | None:
            return None if cert is None else pki.cert_pem(cert).decode("ascii")

        return {
            "ca_cert": pem(self.ca_cert),
            "ca_key": pki.key_pem(self.ca_key).decode("ascii"),
            "previous_ca_cert": pem(self.previous_ca_cert),
            "cross_cert": pem(self.cross_cert),
            "rotation": None if self.rotation is None else self.rotation.to_json(),
            "ca_hash": self.ca_hash,
            "cluster_id": self.cluster_id,
            "admin_token": self.admin_token,
        }

    @classmethod
    def from_json(cls, data: Any) -> CAExport:
        """ValueError, KeyError or TypeError when ``data`` is not what :meth:`to_json` made."""
        if not isinstance(data, dict):
            raise TypeError("the payload is not a JSON object")

        def cert(field: str) -> x509.Certificate | None:
            value = data[field]
            return None if value is None else x509.load_pem_x509_certificate(value.encode())

        key = serialization.load_pem_private_key(data["ca_key"].encode(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TypeError(f"the CA key is a {type(key).__name__}, not an ECDSA key")
        ca_cert = cert("ca_cert")
        if ca_cert is None:
            raise TypeError("the CA certificate is missing")
        for field in ("cluster_id", "admin_token", "ca_hash"):
            if not isinstance(data[field], str):
                raise TypeError(f"{field} is not a string")
        export = cls(
            ca_cert=ca_cert,
            ca_key=key,
            cluster_id=data["cluster_id"],
            admin_token=data["admin_token"],
            previous_ca_cert=cert("previous_ca_cert"),
            cross_cert=cert("cross_cert"),
            rotation=None if data["rotation"] is None else pki.Rotation.from_json(data["rotation"]),
        )
        if export.ca_hash != data["ca_hash"]:
            raise ValueError(f"it says CA {data['ca_hash']} but holds {export.ca_hash}")
        return export


def collect(pki_dir: Path, ca: pki.Authority, *, cluster_id: str, admin_token: str) -> CAExport:
    """The export of the CA ``ca`` signs with (the running instance's, so exactly the key
    it signs with) and the rotation files of ``pki_dir``; CAExportError when they do not
    fit together (a rotation changed the directory meanwhile: try again)."""
    pki_dir = Path(pki_dir)
    rotation = pki.read_rotation(pki_dir)
    previous = cross = None
    if rotation is not None and rotation.active:
        previous = pki.load_cert(pki_dir / pki.PREVIOUS_CA_CERT)
        cross = pki.load_cert(pki_dir / pki.CROSS_CERT)
    export = CAExport(
        ca_cert=ca.cert,
        ca_key=ca.key,
        cluster_id=cluster_id,
        admin_token=admin_token,
        previous_ca_cert=previous,
        cross_cert=cross,
        rotation=rotation,
    )
    problem = export.problem()
    if problem is not None:
        raise CAExportError(
            f"the CA in {pki_dir} cannot be exported: {problem}; nothing was exported. If a CA "
            "rotation just ran, export again; else restore the directory from a backup"
        )
    return export


# -- sealing ---------------------------------------------------------------------------------


def check_passphrase(passphrase: object) -> str:
    """``passphrase`` when it may seal an export; ConfigError saying why not."""
    if not isinstance(passphrase, str) or len(passphrase) < MIN_PASSPHRASE:
        raise ConfigError(
            f"the passphrase of a CA export must have at least {MIN_PASSPHRASE} characters (it "
            "alone protects the CA key in the file); nothing was exported. Choose a longer one"
        )
    return passphrase


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _keys(passphrase: str, salt: bytes, kdf: KDF) -> tuple[bytes, bytes]:
    """The AES key and the passphrase check of ``passphrase`` and ``salt``."""
    derived = Scrypt(salt=salt, length=64, n=kdf.n, r=kdf.r, p=kdf.p).derive(passphrase.encode())
    check = hmac.new(derived[32:], _CHECK_LABEL, hashlib.sha256).digest()
    return derived[:32], check


def seal(export: CAExport, passphrase: str, *, kdf: KDF | None = None) -> bytes:
    """The export file of ``export``, encrypted under ``passphrase`` (a fresh salt and
    nonce each time)."""
    check_passphrase(passphrase)
    kdf = kdf or KDF()
    salt, nonce = os.urandom(16), os.urandom(12)
    key, check = _keys(passphrase, salt, kdf)
    header: dict[str, Any] = {
        "format": FORMAT,
        "ca_hash": export.ca_hash,
        "cluster_id": export.cluster_id,
        "exported_at": int(time.time()),
        "cipher": _CIPHER,
        "kdf": {"name": "scrypt", "n": kdf.n, "r": kdf.r, "p": kdf.p, "salt": _b64(salt)},
        "check": _b64(check),
        "nonce": _b64(nonce),
    }
    ciphertext = AESGCM(key).encrypt(nonce, _canonical(export.to_json()), _canonical(header))
    return (json.dumps({**header, "ciphertext": _b64(ciphertext)}, indent=2) + "\n").encode()


@dataclass(frozen=True)
class Header:
    """What an export file says in clear."""

    ca_hash: str
    cluster_id: str
    exported_at: int
    kdf: KDF
    salt: bytes
    check: bytes
    nonce: bytes


def _altered(source: str, what: str) -> CAExportError:
    return CAExportError(
        f"{source} is not a readable CA export ({what}); nothing was imported. Use the file "
        "'llmgw ctl cert export-ca' wrote, unchanged, or export the CA again"
    )


def _parse(data: bytes, source: str) -> tuple[Header, bytes, bytes]:
    """The header, the associated data it makes and the ciphertext of an export file."""
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        raise _altered(source, "it is not JSON") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("format"), str):
        raise _altered(source, "it names no format")
    fmt = obj["format"]
    if fmt != FORMAT:
        if fmt.startswith(_FAMILY):
            raise CAExportError(
                f"{source} is a CA export of format {fmt}, which this llmgw cannot read (it "
                f"reads {FORMAT}); nothing was imported. Import it with the llmgw release that "
                "exported it, or a newer one"
            )
        raise _altered(source, f"its format is {fmt!r}, not {FORMAT}")
    fields = set(obj) - {"ciphertext"}
    if fields != _HEADER_KEYS or "ciphertext" not in obj:
        odd = sorted(fields ^ _HEADER_KEYS) or ["ciphertext"]
        raise _altered(source, f"unexpected or missing field(s): {', '.join(odd)}")
    try:
        kdf_obj = obj["kdf"]
        if not isinstance(kdf_obj, dict) or set(kdf_obj) != {"name", "n", "r", "p", "salt"}:
            raise ValueError("kdf")
        ints = [kdf_obj[k] for k in ("n", "r", "p")]
        if kdf_obj["name"] != "scrypt" or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ints
        ):
            raise ValueError("kdf")
        if not all(isinstance(obj[k], str) for k in ("ca_hash", "cluster_id", "check", "nonce")):
            raise ValueError("fields")
        exported_at = obj["exported_at"]
        if not isinstance(exported_at, int) or isinstance(exported_at, bool):
            raise ValueError("exported_at")
        header = Header(
            ca_hash=obj["ca_hash"],
            cluster_id=obj["cluster_id"],
            exported_at=exported_at,
            kdf=KDF(n=ints[0], r=ints[1], p=ints[2]),
            salt=base64.b64decode(kdf_obj["salt"], validate=True),
            check=base64.b64decode(obj["check"], validate=True),
            nonce=base64.b64decode(obj["nonce"], validate=True),
        )
        ciphertext = base64.b64decode(obj["ciphertext"], validate=True)
    except (ValueError, TypeError, binascii.Error):
        raise _altered(source, "its header is malformed") from None
    if obj["cipher"] != _CIPHER or len(header.nonce) != 12 or len(header.salt) < 16:
        raise _altered(source, "its cipher, nonce or salt is not one llmgw makes")
    n, r, p = header.kdf.n, header.kdf.r, header.kdf.p
    if (
        not _MIN_N <= n <= _MAX_N
        or n & (n - 1)
        or not 1 <= r <= _MAX_R
        or not 1 <= p <= _MAX_P
        or 128 * n * r > _MAX_MEMORY
    ):
        raise _altered(source, f"its scrypt cost n={n} r={r} p={p} is outside what llmgw makes")
    aad = _canonical({k: obj[k] for k in _HEADER_KEYS})
    return header, aad, ciphertext


def read_header(data: bytes, *, source: str) -> Header:
    """What an export file says in clear (checked before a passphrase is asked for);
    CAExportError when it is not an export this llmgw reads."""
    return _parse(data, source)[0]


def unseal(data: bytes, passphrase: str, *, source: str) -> CAExport:
    """The export in ``data`` (``source`` names it in messages); CAExportError when the
    passphrase is wrong or the file was altered."""
    header, aad, ciphertext = _parse(data, source)
    key, check = _keys(passphrase, header.salt, header.kdf)
    if not hmac.compare_digest(check, header.check):
        raise CAExportError(
            f"wrong passphrase for {source} (or its header was altered); nothing was imported. "
            f"Give the passphrase it was exported with ({CA_PASSPHRASE_ENV} or the prompt), or "
            "export the CA again"
        )
    try:
        payload = AESGCM(key).decrypt(header.nonce, ciphertext, aad)
    except InvalidTag:
        raise CAExportError(
            f"{source} was altered or damaged after its export (the passphrase is right, but "
            "its contents fail their check); nothing was imported. Export the CA again"
        ) from None
    try:
        export = CAExport.from_json(json.loads(payload))
    except (ValueError, KeyError, TypeError, UnsupportedAlgorithm) as exc:
        raise _altered(source, f"its contents: {exc}") from None
    if export.ca_hash != header.ca_hash or export.cluster_id != header.cluster_id:
        raise _altered(source, "its header names another CA or cluster than its contents")
    problem = export.problem()
    if problem is not None:
        raise CAExportError(
            f"{source} holds a CA that cannot be used: {problem}; nothing was imported. Export "
            "the CA again from an instance whose 'llmgw ctl cert' shows it valid"
        )
    return export


def read_export(path: Path) -> bytes:
    """The bytes of the export file ``path`` (FileError when it cannot be read, or is far
    larger than any export)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_EXPORT + 1)
    except OSError as exc:
        raise FileError(
            f"cannot read {path}: {exc.strerror or exc}; give the file 'llmgw ctl cert "
            "export-ca' wrote, readable by this user",
            path=str(path),
        ) from exc
    if len(data) > MAX_EXPORT:
        raise _altered(str(path), f"it is larger than {MAX_EXPORT} bytes")
    return data
