"""The rekey proof: the old key signs one node, uid, new key and token; nothing else verifies."""

from __future__ import annotations

import base64
import hashlib

import pytest

from llmgw import pki
from llmgw.contracts.rekeyproof import proof_message, sign_proof, verify_proof


def message(**kw: str) -> bytes:
    args = {"node_id": "gpu-1", "node_uid": "u1", "new_key_fingerprint": "sha256:ab", "token": "t"}
    return proof_message(**(args | kw))


def test_a_proof_names_the_key_that_signed() -> None:
    key = pki.new_private_key()
    proof = sign_proof(key, message())
    assert verify_proof(proof, message()) == pki.fingerprint(key.public_key())
    # The token is bound by its hash, never carried.
    secret = "llmgwjt_secret"
    assert secret.encode() not in message(token=secret)
    assert (
        message(token=secret).split(b"\n")[-1]
        == hashlib.sha256(secret.encode()).hexdigest().encode()
    )


@pytest.mark.parametrize(
    "other",
    [
        {"node_id": "gpu-2"},
        {"node_uid": "u2"},
        {"new_key_fingerprint": "sha256:cd"},
        {"token": "x"},
    ],
)
def test_a_proof_for_anything_else_does_not_verify(other: dict[str, str]) -> None:
    proof = sign_proof(pki.new_private_key(), message())
    with pytest.raises(ValueError, match="does not verify"):
        verify_proof(proof, message(**other))


@pytest.mark.parametrize(
    ("proof", "piece"),
    [
        (None, "not an object with 'key' and 'signature'"),
        ({"key": "k"}, "not an object with 'key' and 'signature'"),
        ({"key": "k", "signature": "s", "x": 1}, "not an object with 'key' and 'signature'"),
        ({"key": 1, "signature": "s"}, "are not strings"),
        ({"key": "k" * 5000, "signature": "s"}, "too long"),
        ({"key": "not pem", "signature": "s"}, "not a PEM public key"),
        ({"key": "PEM", "signature": "!!"}, "not base64"),
    ],
)
def test_malformed_proofs_say_why(proof: object, piece: str) -> None:
    if isinstance(proof, dict) and proof.get("key") == "PEM":
        proof = dict(sign_proof(pki.new_private_key(), message()), signature="!!")
    with pytest.raises(ValueError, match=piece):
        verify_proof(proof, message())


def test_a_signature_of_garbage_does_not_verify() -> None:
    proof = dict(sign_proof(pki.new_private_key(), message()))
    proof["signature"] = base64.b64encode(b"\x30\x06\x02\x01\x01\x02\x01\x01").decode()
    with pytest.raises(ValueError, match="does not verify"):
        verify_proof(proof, message())
