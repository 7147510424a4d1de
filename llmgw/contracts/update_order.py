"""The signed update order (DESIGN §5, §7): its fields, the canonical JSON the cluster CA
signs, the checks every side runs on it, and the spool through which the agent hands an
order to the root helper.

The control plane (``llmgw.server.updates``) signs an order, the canonical JSON of
``{node_id, version, counter, sha256, url, arch, expires}``, with the cluster CA's key
(ECDSA P-256, SHA-256, DER). The agent (``llmgw.agent.update_spool``), never root, reads
where to download the bundle from (:func:`parse_order`), and renames a finished directory
holding ``order.json``, ``order.sig`` and ``bundle.tar.gz`` to ``<spool>/request``. The
root helper (``llmgw.updater``) verifies the order with nothing but the CA certificate
(:func:`verify_order`) and writes its verdict to ``<spool>/status.json``, whose ``state``
the agent reports and the control plane keeps (:data:`FINAL_STATES` end an update).
"""

from __future__ import annotations

import json
import platform
import re
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.contracts.paths import DEFAULT_AGENT_STATE_DIR
from llmgw.errors import ConfigError, UpdateError
from llmgw.netaddr import validate_node_id
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
    "SIGNATURE_FILE",
    "STATUS",
    "canonical_order",
    "check_order_fields",
    "machine_arch",
    "parse_order",
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
FINAL_STATES = frozenset({"done", "failed", "refused", "rolled-back", "busy", "expired"})

_SHA256 = re.compile(r"[0-9a-f]{64}")


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
    if keys != ORDER_KEYS:
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
    return order


def parse_order(order_bytes: bytes) -> dict[str, Any]:
    """The fields of an order, unverified (the agent reads only where to download from)."""
    try:
        order = json.loads(order_bytes)
    except (ValueError, UnicodeDecodeError):
        raise UpdateError("the update order is not JSON; the control plane sent garbage") from None
    return check_order_fields(order)


def verify_order(ca_cert_pem: bytes, order_bytes: bytes, signature: bytes) -> dict[str, Any]:
    """The order, if ``signature`` is the cluster CA's ECDSA-SHA256 signature of exactly
    ``order_bytes`` (the canonical form) and its fields are sane; UpdateError otherwise.
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
    try:
        public.verify(signature, order_bytes, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise UpdateError(
            "the update order's signature does not verify against the cluster CA: it was "
            "changed after signing or signed by another key; nothing was installed"
        ) from None
    order = parse_order(order_bytes)
    if canonical_order(order) != order_bytes:
        raise UpdateError("the update order is signed but not in canonical form; it is refused")
    return order
