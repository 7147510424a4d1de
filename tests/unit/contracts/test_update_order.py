"""The signed update order: signed by the control plane, verified with nothing but the CA
certificate, in exactly one canonical form, with fields both sides check the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.contracts.update_order import (
    canonical_order,
    check_order_fields,
    machine_arch,
    parse_order,
    trust_move,
    verify_order,
)
from llmgw.errors import UpdateError
from llmgw.pki import Authority, cert_pem, init_ca, load_ca, rotate_ca
from llmgw.server.fleet.updates import sign_order
from tests.unit.orders import order_for


def test_sign_then_verify_round_trips(authority: Authority) -> None:
    order = order_for()
    data, signature = sign_order(authority.key, order)
    assert data == json.dumps(order, sort_keys=True, separators=(",", ":")).encode()
    assert data == canonical_order(order)
    ca_pem = (authority.directory / "ca.crt").read_bytes()
    assert verify_order(ca_pem, data, signature) == order


def test_every_tampered_byte_is_refused(authority: Authority) -> None:
    data, signature = sign_order(authority.key, order_for())
    ca_pem = (authority.directory / "ca.crt").read_bytes()
    for i in range(0, len(data), 7):
        changed = bytearray(data)
        changed[i] ^= 0x01
        with pytest.raises(UpdateError, match=r"does not verify|not JSON|wrong fields|refused"):
            verify_order(ca_pem, bytes(changed), signature)
    broken = bytearray(signature)
    broken[-1] ^= 0x01
    with pytest.raises(UpdateError, match="does not verify"):
        verify_order(ca_pem, data, bytes(broken))


def test_another_key_is_refused(authority: Authority, other_authority: Authority) -> None:
    data, signature = sign_order(other_authority.key, order_for())
    with pytest.raises(UpdateError, match="does not verify against the cluster CA"):
        verify_order((authority.directory / "ca.crt").read_bytes(), data, signature)


def test_a_signed_but_not_canonical_order_is_refused(authority: Authority) -> None:
    data = json.dumps(order_for()).encode()  # spaces: valid JSON, not the canonical form
    signature = authority.key.sign(data, ec.ECDSA(hashes.SHA256()))
    with pytest.raises(UpdateError, match="canonical"):
        verify_order((authority.directory / "ca.crt").read_bytes(), data, signature)


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"counter": 0}, "counter is not a positive"),
        ({"counter": True}, "counter is not a positive"),
        ({"sha256": "ABC"}, "sha256"),
        ({"arch": "riscv"}, "arch"),
        ({"url": "file:///etc/passwd"}, "url"),
        ({"node_id": "Not A Node"}, "node_id"),
        ({"extra": 1}, "wrong fields"),
    ],
)
def test_sign_order_refuses_malformed_fields(
    authority: Authority, changes: dict[str, Any], words: str
) -> None:
    with pytest.raises(UpdateError, match=words):
        sign_order(authority.key, order_for(**changes))


def test_parse_order_reads_the_fields_without_a_signature() -> None:
    order = order_for()
    assert parse_order(canonical_order(order)) == order
    with pytest.raises(UpdateError, match="not JSON"):
        parse_order(b"\xff not json")
    with pytest.raises(UpdateError, match="not a JSON object"):
        parse_order(b"[1, 2]")


@pytest.mark.parametrize(
    ("machine", "arch"),
    [
        ("x86_64", "x64"),
        ("AMD64", "x64"),
        ("aarch64", "arm64"),
        ("arm64", "arm64"),
        ("riscv64", None),
    ],
)
def test_machine_arch_names_the_bundle_architecture(machine: str, arch: str | None) -> None:
    assert machine_arch(machine) == arch


def test_rotation_fields_come_together_and_well_formed() -> None:
    pin = "sha256:" + "b" * 64
    with pytest.raises(UpdateError, match="ca_pin without ca_certs"):
        check_order_fields(order_for(ca_pin=pin))
    with pytest.raises(UpdateError, match="ca_certs without ca_pin"):
        check_order_fields(order_for(ca_certs=["x"]))
    with pytest.raises(UpdateError, match="ca_pin is not sha256"):
        check_order_fields(order_for(ca_pin="sha256:XYZ", ca_certs=["x"]))
    for bad in ([], "pem", [1], ["a"] * 5):
        with pytest.raises(UpdateError, match="ca_certs is not a list"):
            check_order_fields(order_for(ca_pin=pin, ca_certs=bad))
    assert check_order_fields(order_for(ca_pin=pin, ca_certs=["x"]))["ca_pin"] == pin
    with pytest.raises(UpdateError, match="wrong fields"):
        check_order_fields(order_for(ca_pin=pin, ca_certs=["x"], extra=1))


def test_trust_move_names_the_new_ca_only_when_it_changes(tmp_path: Path) -> None:
    d = tmp_path / "pki"
    old = init_ca(d)
    rotate_ca(d, overlap=60)
    new = load_ca(d)
    fields = {"ca_pin": new.ca_hash(), "ca_certs": [cert_pem(new.cert).decode()]}
    assert trust_move(order_for(**fields), cert_pem(old.cert)) == (
        new.ca_hash(),
        cert_pem(new.cert),
    )
    assert trust_move(order_for(**fields), cert_pem(new.cert)) is None
    assert trust_move(order_for(), cert_pem(old.cert)) is None
