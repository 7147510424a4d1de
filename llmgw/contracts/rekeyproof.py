"""The proof of the old key that a rekey carries: the node signs, with the key it has now, a
message naming itself, its uid, the new key and the token, and the control plane accepts
the rekey only if that key is one it issued a live certificate for.

A rekey token is bound to the node's uid, but a uid is no secret (``ctl nodes`` shows it, a
re-pair command prints it): without this proof anyone holding a plain rekey token could
put their own key on an approved node. A node whose state directory is gone has no old key
and re-pairs with a re-pair token instead, which sends the node back to approval.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw import pki

__all__ = ["MAX_PROOF_FIELD", "proof_message", "sign_proof", "verify_proof"]

_CONTEXT = "llmgw-rekey-proof-v1"
MAX_PROOF_FIELD = 4096
"""Longest ``key`` or ``signature`` accepted (a P-256 public key in PEM is under 200)."""


def proof_message(*, node_id: str, node_uid: str, new_key_fingerprint: str, token: str) -> bytes:
    """What the old key signs: bound to this node, its uid, the key that replaces it and the
    token spent (as its SHA-256, never the token itself), so that it proves nothing else."""
    token_hash = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()
    return "\n".join((_CONTEXT, node_id, node_uid, new_key_fingerprint, token_hash)).encode()


def sign_proof(key: ec.EllipticCurvePrivateKey, message: bytes) -> dict[str, str]:
    """The ``proof`` field of a rekey request: the old public key (PEM) and its signature
    (ECDSA with SHA-256, DER, base64) of *message*."""
    public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    signature = key.sign(message, ec.ECDSA(hashes.SHA256()))
    return {"key": public.decode("ascii"), "signature": base64.b64encode(signature).decode()}


def verify_proof(proof: object, message: bytes) -> str:
    """The fingerprint of the key that signed *message* in *proof* (a ``sign_proof`` dict);
    ValueError says why a proof is not one."""
    if not isinstance(proof, Mapping) or set(proof) != {"key", "signature"}:
        raise ValueError("it is not an object with 'key' and 'signature'")
    key_pem, signature = proof["key"], proof["signature"]
    if not isinstance(key_pem, str) or not isinstance(signature, str):
        raise ValueError("its 'key' and 'signature' are not strings")
    if len(key_pem) > MAX_PROOF_FIELD or len(signature) > MAX_PROOF_FIELD:
        raise ValueError("its 'key' or 'signature' is too long")
    try:
        public = serialization.load_pem_public_key(key_pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError, TypeError):
        raise ValueError("its 'key' is not a PEM public key") from None
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise ValueError("its 'key' is not an EC public key")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("its 'signature' is not base64") from None
    try:
        public.verify(raw, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise ValueError(
            "its signature does not verify (not made for this node, uid, new key and token)"
        ) from None
    return pki.fingerprint(public)
