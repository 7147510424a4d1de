"""The agent's side of a CA rotation (llmgw.agent.renewal): the trust bundle is taken only
for CAs the node trusts or that a trusted CA cross-signed, the node renews at once under
the new CA, a renewed certificate from a CA it does not trust is refused, and the old CA
leaves the node's file when the control plane drops it."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from llmgw import pki
from llmgw.agent.config import TLSConfig
from llmgw.agent.renewal import Renewer
from llmgw.proto import control_pb2 as pb

NODE = "gpu-1"


class Node:
    """A control plane's PKI (rotated on demand) and a node whose files its old CA made."""

    def __init__(self, tmp: Path) -> None:
        self.pki_dir = tmp / "cp"
        self.old = pki.init_ca(self.pki_dir)
        ident = pki.issue_node_cert(self.old, NODE, tmp / "node")
        self.tls = TLSConfig(cert=ident.cert, key=ident.key, ca=ident.ca)
        self.sent: list[pb.AgentMessage] = []
        self.renewed = 0
        self.renewer = Renewer(self.tls, NODE, send=self._send, on_renewed=self._renewed)

    def _send(self, msg: pb.AgentMessage) -> bool:
        self.sent.append(msg)
        return True

    def _renewed(self) -> None:
        self.renewed += 1

    def rotate(self) -> pki.Authority:
        pki.rotate_ca(self.pki_dir, overlap=3600)
        return pki.load_ca(self.pki_dir)

    def bundle(self, *, drop: bool = False) -> pb.TrustBundle:
        """What the control plane sends (llmgw.server.fleet.authority)."""
        cas = pki.trust_certificates(self.pki_dir)
        crosses = [] if drop else pki.cross_certificates(self.pki_dir)
        return pb.TrustBundle(
            ca_pems=[pki.cert_pem(c).decode() for c in cas],
            pins=[pki.fingerprint(c.public_key()) for c in cas],
            cross_pems=[pki.cert_pem(c).decode() for c in crosses],
        )

    def trusted(self) -> list[str]:
        return [pki.fingerprint(c.public_key()) for c in pki.load_bundle(self.tls.ca)]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


def test_the_new_ca_is_taken_through_the_old_cas_cross_certificate(node: Node) -> None:
    new = node.rotate()
    assert node.renewer.due(pki.load_cert(node.tls.cert)) > 0  # before: not due
    assert node.renewer.trust(node.bundle()) is True
    assert node.trusted() == [new.ca_hash(), node.old.ca_hash()]
    assert node.renewed == 1  # the data plane reloads its trust
    assert node.renewer.due(pki.load_cert(node.tls.cert)) == 0.0  # renew at once
    assert node.renewer.trust(node.bundle()) is False  # the same again: nothing to write
    assert node.renewed == 1


def test_a_ca_nobody_trusted_vouches_for_is_not_taken(node: Node, tmp_path: Path) -> None:
    rogue = pki.init_ca(tmp_path / "rogue")  # the cluster CA's very name, another key
    before = node.tls.ca.read_bytes()
    msg = pb.TrustBundle(ca_pems=[pki.cert_pem(rogue.cert).decode()], pins=[rogue.ca_hash()])
    assert node.renewer.trust(msg) is False
    assert node.tls.ca.read_bytes() == before
    # Vouched for by itself (a cross-certificate the rogue CA signed) is no better.
    cross = pki.cross_sign(rogue, rogue.cert, until=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
    msg.cross_pems.append(pki.cert_pem(cross).decode())
    assert node.renewer.trust(msg) is False
    assert node.tls.ca.read_bytes() == before
    # Beside the trusted CA it is left out; the trusted one stays.
    msg = pb.TrustBundle(
        ca_pems=[pki.cert_pem(node.old.cert).decode(), pki.cert_pem(rogue.cert).decode()],
        pins=[node.old.ca_hash(), rogue.ca_hash()],
    )
    assert node.renewer.trust(msg) is False
    assert node.trusted() == [node.old.ca_hash()]


def test_a_bundle_whose_pins_lie_is_ignored(node: Node) -> None:
    new = node.rotate()
    msg = node.bundle()
    msg.pins[0] = node.old.ca_hash()
    before = node.tls.ca.read_bytes()
    assert node.renewer.trust(msg) is False
    assert node.tls.ca.read_bytes() == before
    del msg.pins[:]
    assert node.renewer.trust(msg) is False
    assert new.ca_hash() not in node.trusted()


def test_an_expired_cross_certificate_vouches_for_nothing(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    node.rotate()
    import llmgw.agent.renewal as renewal

    real = renewal.time.time
    monkeypatch.setattr(renewal.time, "time", lambda: real() + 2 * 3600)
    assert node.renewer.trust(node.bundle()) is False
    assert node.trusted() == [node.old.ca_hash()]


def test_renewal_under_the_new_ca_and_the_drop(node: Node) -> None:
    new = node.rotate()
    node.renewer.trust(node.bundle())

    async def renew() -> bool:
        task = asyncio.create_task(node.renewer.renew_once(timeout=5))
        await asyncio.sleep(0)  # it sends its request, then waits for the answer
        csr = pki.load_csr(node.sent[-1].cert_request.csr_pem)
        cert = pki.sign_csr(new, csr, node_id=NODE, lifetime=3600)
        node.renewer.answer(
            pb.RenewCertificate(
                certificate_pem=pki.cert_pem(cert).decode(),
                ca_pem=pki.cert_pem(new.cert).decode(),
            )
        )
        return await task

    assert node.renewed == 1  # the new trust reloaded the data plane
    assert asyncio.run(renew()) is True
    assert node.renewed == 2
    assert pki.issued_by(pki.load_cert(node.tls.cert), new.cert)
    assert node.renewer.due(pki.load_cert(node.tls.cert)) > 0
    # The control plane drops the old CA: it leaves the node's file.
    pki.finish_rotation(node.pki_dir)
    assert node.renewer.trust(node.bundle(drop=True)) is True
    assert node.trusted() == [new.ca_hash()]


def test_a_renewed_certificate_from_an_untrusted_ca_is_refused(node: Node) -> None:
    new = node.rotate()  # the bundle never arrived: the node trusts the old CA only
    before = node.tls.cert.read_bytes()

    async def renew() -> bool:
        task = asyncio.create_task(node.renewer.renew_once(timeout=5))
        await asyncio.sleep(0)  # it sends its request, then waits for the answer
        csr = pki.load_csr(node.sent[-1].cert_request.csr_pem)
        cert = pki.sign_csr(new, csr, node_id=NODE, lifetime=3600)
        node.renewer.answer(
            pb.RenewCertificate(
                certificate_pem=cert.public_bytes(serialization.Encoding.PEM).decode(),
                ca_pem=pki.cert_pem(new.cert).decode(),
            )
        )
        return await task

    assert asyncio.run(renew()) is False
    assert node.tls.cert.read_bytes() == before
    assert node.renewed == 0
