"""The signed update order (DESIGN §5, §7): its fields, the canonical JSON the cluster CA
signs, the checks every side runs on it, and the spool through which the agent hands an
order to the root helper.

The control plane (``llmgw.server.fleet.updates``) signs an order, the canonical JSON of
``{node_id, version, counter, sha256, url, arch, expires}``, with the cluster CA's key
(ECDSA P-256, SHA-256, DER). The agent (``llmgw.agent.update_spool``), never root, reads
where to download the bundle from (:func:`parse_order`), and renames a finished directory
holding ``order.json``, ``order.sig`` and ``bundle.tar.gz`` to ``<spool>/request``. The
root helper (``llmgw.updater``) verifies the order with nothing but the CA certificate
(:func:`verify_order`) and writes its verdict to ``<spool>/status.json``, whose ``state``
the agent reports and the control plane keeps (:data:`FINAL_STATES` end an update).

**Across a CA rotation** an order also carries ``ca_pin`` (the new CA's ``sha256:`` pin)
and ``ca_certs`` (PEM: the new CA, and the cross-certificate the old CA signed for it),
both inside the signed bytes. A helper that still trusts the old CA verifies the order
through that cross-certificate (a CA certificate with the trusted CA's own subject, signed
by the trusted CA's key and valid now: the trusted CA's word for the new key) and then moves
its trust to the CA the pin names (:func:`trust_move`); a helper that trusts the new CA
verifies it directly. A node's own certificate, though the CA signed it too, is never a CA
certificate, so the agent cannot sign orders with its key.
"""

from __future__ import annotations

import json
import platform
import re
import time
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.contracts.paths import DEFAULT_AGENT_STATE_DIR
from llmgw.errors import CertificateError, ConfigError, UpdateError
from llmgw.netaddr import validate_node_id
from llmgw.pki import fingerprint, is_ca_certificate, issued_by, load_certs
from llmgw.versions import is_version

__all__ = [
    "ARCHES",
    "BUNDLE_FILE",
    "DEFAULT_SPOOL",
    "FINAL_STATES",
    "MAX_BUNDLE",
    "MAX_SMALL",
    "ORDER_FILE",
    "ORDER_KEYS",
    "REQUEST",
    "REQUEST_FILES",
    "ROTATION_KEYS",
    "SIGNATURE_FILE",
    "STATUS",
    "canonical_order",
    "check_order_fields",
    "machine_arch",
    "parse_order",
    "trust_move",
    "verify_order",
]

# -- the spool: the agent writes a request, the root helper its verdict --------------------------

DEFAULT_SPOOL = DEFAULT_AGENT_STATE_DIR / "update"
REQUEST = "request"
STATUS = "status.json"
ORDER_FILE = "order.json"
SIGNATURE_FILE = "order.sig"
BUNDLE_FILE = "bundle.tar.gz"
REQUEST_FILES = frozenset({ORDER_FILE, SIGNATURE_FILE, BUNDLE_FILE})
MAX_SMALL = 64 * 1024
"""The most either side reads of an order, a signature, a status or a bundle's BUILD-INFO."""
MAX_BUNDLE = 4 << 30
"""The biggest bundle the agent downloads and the helper copies."""

# -- the order ----------------------------------------------------------------------------------

ARCHES: dict[str, tuple[str, ...]] = {"x64": ("x86_64", "amd64"), "arm64": ("aarch64", "arm64")}
ORDER_KEYS = frozenset({"node_id", "version", "counter", "sha256", "url", "arch", "expires"})
ROTATION_KEYS = frozenset({"ca_pin", "ca_certs"})
"""Present together, and only across a CA rotation (older helpers refuse unknown fields)."""
MAX_CA_CERTS = 4
FINAL_STATES = frozenset({"done", "failed", "refused", "rolled-back", "busy", "expired"})

_SHA256 = re.compile(r"[0-9a-f]{64}")
_PIN = re.compile(r"sha256:[0-9a-f]{64}")


def canonical_order(order: dict[str, Any]) -> bytes:
    """The exact bytes that are signed: sorted keys, no spaces, UTF-8."""
    return json.dumps(order, sort_keys=True, separators=(",", ":")).encode()


def machine_arch(machine: str | None = None) -> str | None:
    """The bundle architecture (x64, arm64) of ``uname -m``, or None."""
    name = (machine or platform.machine()).lower()
    return next((arch for arch, names in ARCHES.items() if name in names), None)


def check_order_fields(order: object) -> dict[str, Any]:
    """The order if it has exactly the fields of an update order with sane values;
    UpdateError naming the field otherwise."""
    if not isinstance(order, dict):
        raise UpdateError("the update order is not a JSON object; the control plane sent garbage")
    keys = set(order)
    rotation = keys & ROTATION_KEYS
    if rotation and rotation != ROTATION_KEYS:
        raise UpdateError(
            f"the update order has {sorted(rotation)[0]} without "
            f"{sorted(ROTATION_KEYS - rotation)[0]}; a CA rotation's order carries both; it "
            "is refused"
        )
    if keys - rotation != ORDER_KEYS:
        keys -= rotation
        missing, extra = sorted(ORDER_KEYS - keys), sorted(keys - ORDER_KEYS)
        raise UpdateError(
            f"the update order has the wrong fields (missing {missing or 'none'}, unknown "
            f"{extra or 'none'}); the control plane and this agent disagree on the format: "
            "upgrade them to the same release by hand"
        )

    def bad(field: str, why: str) -> UpdateError:
        return UpdateError(f"the update order's {field} {why}; it is refused")

    if not isinstance(order["node_id"], str):
        raise bad("node_id", "is not a string")
    try:
        validate_node_id(order["node_id"])
    except ConfigError as exc:
        raise bad("node_id", f"is not a node id ({exc})") from None
    if not isinstance(order["version"], str) or not is_version(order["version"]):
        raise bad("version", "is not a version such as 0.2.0")
    for field in ("counter", "expires"):
        value = order[field]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise bad(field, "is not a positive whole number")
    if not isinstance(order["sha256"], str) or not _SHA256.fullmatch(order["sha256"]):
        raise bad("sha256", "is not 64 lowercase hex characters")
    if not isinstance(order["url"], str) or not order["url"].startswith(("https://", "http://")):
        raise bad("url", "is not an http(s) URL")
    if order["arch"] not in ARCHES:
        raise bad("arch", f"is not one of {', '.join(ARCHES)}")
    if rotation:
        if not isinstance(order["ca_pin"], str) or not _PIN.fullmatch(order["ca_pin"]):
            raise bad("ca_pin", "is not sha256:<64 lowercase hex digits>")
        certs = order["ca_certs"]
        if (
            not isinstance(certs, list)
            or not 1 <= len(certs) <= MAX_CA_CERTS
            or not all(isinstance(c, str) for c in certs)
        ):
            raise bad("ca_certs", f"is not a list of 1 to {MAX_CA_CERTS} PEM certificates")
    return order


def _ca_certs(order: dict[str, Any]) -> list[x509.Certificate]:
    """The certificates an order carries across a rotation (none otherwise)."""
    out: list[x509.Certificate] = []
    for pem in order.get("ca_certs") or []:
        try:
            out.extend(load_certs(pem.encode(), what="a certificate of the order's ca_certs"))
        except (CertificateError, UnicodeError) as exc:
            raise UpdateError(f"{exc}; the update order is refused") from None
    return out


def _endorsed(cert: x509.Certificate, trusted: x509.Certificate, now: float) -> bool:
    """Whether ``cert`` is the trusted CA's word for another key: a CA certificate, issued
    to and by the trusted CA's subject, signed by its key, valid at ``now``."""
    try:
        return (
            is_ca_certificate(cert)
            and cert.subject == trusted.subject
            and cert.issuer == trusted.subject
            and issued_by(cert, trusted)
            and cert.not_valid_before_utc.timestamp() <= now < cert.not_valid_after_utc.timestamp()
        )
    except (ValueError, x509.DuplicateExtension):
        return False


def _signed_by(public: object, data: bytes, signature: bytes) -> bool:
    if not isinstance(public, ec.EllipticCurvePublicKey):
        return False
    try:
        public.verify(signature, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def parse_order(order_bytes: bytes) -> dict[str, Any]:
    """The fields of an order, unverified (the agent reads only where to download from)."""
    try:
        order = json.loads(order_bytes)
    except (ValueError, UnicodeDecodeError):
        raise UpdateError("the update order is not JSON; the control plane sent garbage") from None
    return check_order_fields(order)


def verify_order(
    ca_cert_pem: bytes, order_bytes: bytes, signature: bytes, *, now: float | None = None
) -> dict[str, Any]:
    """The order, if ``signature`` is an ECDSA-SHA256 signature of exactly ``order_bytes``
    (the canonical form) by the trusted CA in ``ca_cert_pem`` or, across a rotation, by a key
    the trusted CA endorses through a cross-certificate among the order's ``ca_certs`` (the
    order must then name that key's pin), and its fields are sane; UpdateError otherwise.
    Expiry, node id and counter are the caller's to check."""
    try:
        ca = x509.load_pem_x509_certificate(ca_cert_pem)
    except ValueError as exc:
        raise UpdateError(
            f"the trusted CA certificate is unreadable ({exc}); reinstall the agent so that "
            "the installer writes it again",
            state="failed",
        ) from None
    public = ca.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise UpdateError(
            "the trusted CA certificate has no EC key; it is not an llmgw cluster CA",
            state="failed",
        )
    if _signed_by(public, order_bytes, signature):
        order = parse_order(order_bytes)
    else:
        order = _verify_through_cross(ca, order_bytes, signature, now)
    if canonical_order(order) != order_bytes:
        raise UpdateError("the update order is signed but not in canonical form; it is refused")
    return order


def _verify_through_cross(
    ca: x509.Certificate, order_bytes: bytes, signature: bytes, now: float | None
) -> dict[str, Any]:
    refused = UpdateError(
        "the update order's signature does not verify against the cluster CA: it was "
        "changed after signing or signed by another key; nothing was installed. If the "
        "cluster CA was rotated and its overlap has ended, run the installer's upgrade with "
        "the new --ca-hash ('llmgw ctl cert' shows it)"
    )
    try:
        unverified = parse_order(order_bytes)
    except UpdateError:
        raise refused from None
    when = time.time() if now is None else now
    for cert in _ca_certs(unverified):  # unverified: anyone's certificates until one checks out
        try:
            if not _endorsed(cert, ca, when):
                continue
            public = cert.public_key()
        except (ValueError, UnsupportedAlgorithm, x509.DuplicateExtension):
            continue
        if not _signed_by(public, order_bytes, signature):
            continue
        signer = fingerprint(public)
        if unverified.get("ca_pin") != signer:
            raise UpdateError(
                f"the update order is signed by CA {signer}, which the trusted CA endorses, "
                f"but names the pin {unverified.get('ca_pin')}; it is refused"
            )
        return unverified
    raise refused


def trust_move(order: dict[str, Any], trusted_pem: bytes) -> tuple[str, bytes] | None:
    """The CA a verified order moves the helper's trust to, as (pin, PEM): the self-signed
    CA certificate among its ``ca_certs`` whose key hashes to its ``ca_pin``; None when the
    order names no pin or the one trusted already. UpdateError when it names a pin but
    carries no such certificate."""
    pin = order.get("ca_pin")
    if pin is None:
        return None
    try:
        trusted = x509.load_pem_x509_certificate(trusted_pem)
    except ValueError as exc:
        raise UpdateError(
            f"the trusted CA certificate is unreadable ({exc})", state="failed"
        ) from None
    if fingerprint(trusted.public_key()) == pin:
        return None
    for cert in _ca_certs(order):
        if (
            is_ca_certificate(cert)
            and cert.subject == cert.issuer
            and fingerprint(cert.public_key()) == pin
            and issued_by(cert, cert)
        ):
            return pin, cert.public_bytes(serialization.Encoding.PEM)
    raise UpdateError(
        f"the update order names the new CA {pin} but carries no self-signed certificate of "
        "it; it is refused"
    )
