"""The helper's trust (``install_trust``, ``llmgw agent update-trust``): the CA is written only
when it matches the operator's pin (or the one recorded, or the CA trusted now) and is the
CA's own self-signed certificate, and nothing is read or written through a symlink."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from llmgw import pki
from llmgw.contracts.update_order import MAX_SMALL
from llmgw.errors import UpdateError
from llmgw.pki import Authority
from llmgw.updater.trust import install_trust


def ca_pem(ca: Authority) -> bytes:
    return (ca.directory / "ca.crt").read_bytes()


@pytest.fixture
def trust_dir(tmp_path: Path) -> Path:
    trust = tmp_path / "trust"
    trust.mkdir()
    return trust


def staged(tmp_path: Path, data: bytes, name: str = "staged-ca.crt") -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_trust_is_written_only_for_the_pinned_ca(
    tmp_path: Path, trust_dir: Path, authority: Authority
) -> None:
    pin = authority.ca_hash()
    assert install_trust(staged(tmp_path, ca_pem(authority)), trust_dir, pin) is True
    assert (trust_dir / "ca.pem").read_bytes() == ca_pem(authority)
    assert (trust_dir / "ca-hash").read_text() == pin + "\n"
    assert (trust_dir / "ca.pem").stat().st_mode & 0o777 == 0o644
    # Again: nothing changes; and upper case pins are the same pin.
    assert install_trust(staged(tmp_path, ca_pem(authority)), trust_dir, pin.upper()) is False


def test_another_ca_is_refused_and_the_trust_kept(
    tmp_path: Path, trust_dir: Path, authority: Authority, other_authority: Authority
) -> None:
    install_trust(staged(tmp_path, ca_pem(authority)), trust_dir, authority.ca_hash())
    before = {p.name: p.read_bytes() for p in trust_dir.iterdir()}
    # The agent swapped its ca.crt: with the operator's pin ...
    with pytest.raises(UpdateError, match="keeps the CA it trusts"):
        install_trust(staged(tmp_path, ca_pem(other_authority)), trust_dir, authority.ca_hash())
    # ... and without one (the pin recorded at the first install counts).
    with pytest.raises(UpdateError, match=r"the pin recorded in .*ca-hash"):
        install_trust(staged(tmp_path, ca_pem(other_authority)), trust_dir, None)
    assert {p.name: p.read_bytes() for p in trust_dir.iterdir()} == before


def test_without_a_recorded_pin_the_trusted_ca_is_the_pin(
    tmp_path: Path, trust_dir: Path, authority: Authority, other_authority: Authority
) -> None:
    # An install from before the pin was recorded: ca.pem alone.
    (trust_dir / "ca.pem").write_bytes(ca_pem(authority))
    with pytest.raises(UpdateError, match=r"the CA trusted now"):
        install_trust(staged(tmp_path, ca_pem(other_authority)), trust_dir, None)
    assert (trust_dir / "ca.pem").read_bytes() == ca_pem(authority)
    assert install_trust(staged(tmp_path, ca_pem(authority)), trust_dir, None) is True
    assert (trust_dir / "ca-hash").read_text() == authority.ca_hash() + "\n"


def test_no_pin_at_all_writes_nothing(
    tmp_path: Path, trust_dir: Path, authority: Authority
) -> None:
    with pytest.raises(UpdateError, match="no pin to check"):
        install_trust(staged(tmp_path, ca_pem(authority)), trust_dir, None)
    assert list(trust_dir.iterdir()) == []


def test_a_rekey_with_a_new_pin_rotates_the_trust(
    tmp_path: Path, trust_dir: Path, authority: Authority, other_authority: Authority
) -> None:
    install_trust(staged(tmp_path, ca_pem(authority)), trust_dir, authority.ca_hash())
    new_pin = other_authority.ca_hash()
    assert install_trust(staged(tmp_path, ca_pem(other_authority)), trust_dir, new_pin)
    assert (trust_dir / "ca.pem").read_bytes() == ca_pem(other_authority)
    assert (trust_dir / "ca-hash").read_text() == new_pin + "\n"


def test_a_symlinked_ca_is_not_read(tmp_path: Path, trust_dir: Path, authority: Authority) -> None:
    secret = staged(tmp_path, ca_pem(authority), "secret")  # stands for /etc/shadow
    link = tmp_path / "ca.crt"
    link.symlink_to(secret)
    with pytest.raises(UpdateError, match="it is a symlink"):
        install_trust(link, trust_dir, authority.ca_hash())
    assert list(trust_dir.iterdir()) == []


@pytest.mark.parametrize("what", ["not-pem", "leaf", "fifo", "huge"])
def test_what_is_not_a_ca_is_refused(
    tmp_path: Path, trust_dir: Path, authority: Authority, what: str
) -> None:
    path = tmp_path / "ca.crt"
    if what == "not-pem":
        path.write_bytes(b"root:$6$hash:19000:0:99999:7:::\n")
    elif what == "leaf":
        # A node certificate of the right cluster: signed by the CA, but not a CA itself.
        leaf = pki.issue_node_cert(authority, "gpu-9", tmp_path / "leaf")
        path.write_bytes(leaf.cert.read_bytes())
    elif what == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(ca_pem(authority) + b"#" * (MAX_SMALL + 1))
    with pytest.raises(UpdateError):
        install_trust(path, trust_dir, authority.ca_hash())
    assert list(trust_dir.iterdir()) == []


def test_a_symlink_in_the_trust_directory_is_not_followed(
    tmp_path: Path, trust_dir: Path, authority: Authority
) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    (trust_dir / "ca.pem").symlink_to(outside)
    with pytest.raises(UpdateError, match="a symlink"):
        install_trust(staged(tmp_path, ca_pem(authority)), trust_dir, authority.ca_hash())
    assert outside.read_bytes() == b"keep"
    linked = tmp_path / "linked-trust"
    linked.symlink_to(trust_dir)
    with pytest.raises(UpdateError, match="never a symlink"):
        install_trust(staged(tmp_path, ca_pem(authority)), linked, authority.ca_hash())


def test_update_trust_command_line(
    tmp_path: Path, trust_dir: Path, authority: Authority, other_authority: Authority
) -> None:
    def run_cli(ca: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "llmgw",
                "agent",
                "update-trust",
                "--ca",
                str(ca),
                "--trust",
                str(trust_dir),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )

    good = staged(tmp_path, ca_pem(authority))
    first = run_cli(good, "--ca-hash", authority.ca_hash())
    assert first.returncode == 0 and first.stdout == "trust: written\n", first
    again = run_cli(good)
    assert again.returncode == 0 and again.stdout == "trust: unchanged\n", again
    bad = run_cli(staged(tmp_path, ca_pem(other_authority), "other.crt"))
    assert bad.returncode == 1 and "error: the CA in" in bad.stderr and bad.stdout == ""
    assert (trust_dir / "ca.pem").read_bytes() == ca_pem(authority)


def test_a_trust_bundle_is_read_and_the_pin_picks_the_ca(tmp_path: Path, trust_dir: Path) -> None:
    """Across a CA rotation the agent's ca.crt holds the new CA and the old one: only a pin
    (the operator's --ca-hash) moves the trust; without one the recorded pin keeps it."""
    d = tmp_path / "cp"
    old = pki.init_ca(d)
    install_trust(staged(tmp_path, pki.cert_pem(old.cert)), trust_dir, old.ca_hash())
    pki.rotate_ca(d, overlap=60)
    new = pki.load_ca(d)
    bundle = staged(tmp_path, pki.cert_pem(new.cert) + pki.cert_pem(old.cert), "bundle.crt")
    # A re-run without --ca-hash: the recorded (old) pin picks the old CA; nothing changes.
    assert install_trust(bundle, trust_dir, None) is False
    assert (trust_dir / "ca.pem").read_bytes() == pki.cert_pem(old.cert)
    # upgrade/rekey --ca-hash NEW: the new CA alone is written.
    assert install_trust(bundle, trust_dir, new.ca_hash()) is True
    assert (trust_dir / "ca.pem").read_bytes() == pki.cert_pem(new.cert)
    assert (trust_dir / "ca-hash").read_text() == new.ca_hash() + "\n"
    # The cross-certificate carries the new key too, but the self-signed CA is what is kept.
    cross = (d / pki.CROSS_CERT).read_bytes()
    install_trust(
        staged(tmp_path, cross + pki.cert_pem(new.cert), "x.crt"), trust_dir, new.ca_hash()
    )
    assert (trust_dir / "ca.pem").read_bytes() == pki.cert_pem(new.cert)


def test_a_bundle_without_the_pinned_ca_names_what_it_holds(
    tmp_path: Path, trust_dir: Path, authority: Authority, other_authority: Authority
) -> None:
    bundle = staged(tmp_path, ca_pem(authority) + ca_pem(other_authority))
    pin = "sha256:" + "a" * 64
    with pytest.raises(UpdateError) as caught:
        install_trust(bundle, trust_dir, pin)
    assert authority.ca_hash() in caught.value.message
    assert other_authority.ca_hash() in caught.value.message
    assert not (trust_dir / "ca.pem").exists()


def _forged(
    authority: Authority, *, ca: bool, signer: Any, issuer: str = "llmgw cluster CA"
) -> bytes:
    """A certificate carrying the cluster CA's public key (which is public): the pin matches
    it, whoever made it."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw cluster CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
        .public_key(authority.cert.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .sign(signer, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("signed-by-another-key", "is not the CA's own: it is not self-issued, or its signature"),
        ("not-self-issued", "is not the CA's own: it is not self-issued, or its signature"),
        ("not-a-ca", "is not a CA certificate"),
    ],
)
def test_a_certificate_that_only_carries_the_pinned_key_is_refused(
    tmp_path: Path, trust_dir: Path, authority: Authority, what: str, message: str
) -> None:
    """The pin compared only the public key: a certificate anyone made around the CA's
    public key (with basic constraints CA, but signed by another key, or not self-issued)
    became the trusted ca.pem."""
    if what == "signed-by-another-key":
        pem = _forged(authority, ca=True, signer=pki.new_private_key())
    elif what == "not-self-issued":
        pem = _forged(authority, ca=True, signer=authority.key, issuer="someone else")
    else:
        pem = _forged(authority, ca=False, signer=authority.key)
    with pytest.raises(UpdateError) as caught:
        install_trust(staged(tmp_path, pem), trust_dir, authority.ca_hash())
    assert message in caught.value.message
    assert list(trust_dir.iterdir()) == []
    # With the real CA beside it, the real one is what is trusted.
    both = staged(tmp_path, pem + ca_pem(authority), "both.crt")
    assert install_trust(both, trust_dir, authority.ca_hash()) is True
    assert (trust_dir / "ca.pem").read_bytes() == ca_pem(authority)
