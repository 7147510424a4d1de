"""The cluster CA's rotation on the control plane (llmgw.server.fleet.authority): the shared
Authority moves to the new CA so every part signs with it, agents get the trust bundle,
the old CA is dropped early only when no node still holds its certificates (unless forced),
and by itself when the overlap ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from cryptography.hazmat.primitives import serialization

from llmgw import pki
from llmgw.errors import Conflict
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.authority import ClusterAuthority
from llmgw.server.fleet.nodes import Membership
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "llmgw.db")
    yield s
    s.close()


class Rig:
    """A control plane's PKI, a store with nodes joined under its CA, their live sessions,
    and the ClusterAuthority over them (its reloads counted)."""

    def __init__(self, tmp: Path, store: Store) -> None:
        self.pki_dir = tmp / "pki"
        self.ca, _, _ = pki.ensure_server_identity(self.pki_dir, hosts=["cp.example"])
        self.old = pki.Authority(self.ca.cert, self.ca.key, self.ca.directory)  # a copy
        self.store = store
        self.sessions: dict[str, NodeSession] = {}
        self.membership = Membership(
            store,
            cast(Any, SimpleNamespace(kick=lambda: None)),
            Router(),
            sessions=self.sessions,
            ca=self.ca,
            cert_lifetime=3600.0,
        )
        self.reloads = 0
        self.authority = ClusterAuthority(
            self.pki_dir,
            self.ca,
            store,
            sessions=self.sessions,
            hosts=["cp.example"],
            on_reissued=self._reissued,
        )
        for node in ("gpu-1", "gpu-2"):
            self.join(node)

    def _reissued(self) -> None:
        self.reloads += 1

    def join(self, node_id: str) -> None:
        ident = pki.issue_node_cert(self.ca, node_id, self.pki_dir.parent / node_id)
        cert = pki.load_cert(ident.cert)
        self.membership.admit(node_id, cert)
        self.membership.approve(
            node_id, self.store.get_node(node_id).fingerprint or "", actor="operator"
        )
        session = NodeSession(
            node_id=node_id,
            dataplane_addr="127.0.0.1:1",
            epoch=1,
            engines=frozenset(),
            serial=pki.serial_hex(cert),
            approved=True,
        )
        self.sessions[node_id] = session

    def sent(self, node_id: str) -> list[pb.ServerMessage | None]:
        queue = self.sessions[node_id].queue
        out = []
        while not queue.empty():
            out.append(queue.get_nowait())
        return out

    def renew(self, node_id: str) -> pb.RenewCertificate:
        key = pki.new_private_key()
        csr = pki.make_csr(key, node_id).public_bytes(serialization.Encoding.PEM).decode()
        self.membership.renew(self.sessions[node_id], csr)
        msgs = [m for m in self.sent(node_id) if m is not None]
        return next(m.renew_certificate for m in msgs if m.WhichOneof("msg") == "renew_certificate")


@pytest.fixture
def rig(tmp_path: Path, store: Store) -> Rig:
    return Rig(tmp_path, store)


def test_no_bundle_is_sent_before_any_rotation(rig: Rig) -> None:
    assert rig.authority.bundle_message() is None
    rig.authority.on_connect(rig.sessions["gpu-1"])
    assert rig.sent("gpu-1") == []
    status = rig.authority.status()
    assert status["current"]["ca_hash"] == rig.old.ca_hash()
    assert (status["previous"], status["rotation"], status["nodes_on_previous"]) == (None, None, [])


def test_rotate_moves_every_signer_and_tells_every_agent(rig: Rig) -> None:
    status = rig.authority.rotate(3600, actor="operator")
    new = pki.load_ca(rig.pki_dir)
    assert rig.ca.ca_hash() == new.ca_hash() != rig.old.ca_hash()  # the shared object moved
    assert rig.reloads == 1
    assert status["previous"]["ca_hash"] == rig.old.ca_hash()
    assert sorted(status["nodes_on_previous"]) == ["gpu-1", "gpu-2"]
    for node in ("gpu-1", "gpu-2"):
        (msg,) = rig.sent(node)
        assert msg is not None
        bundle = msg.trust_bundle
        assert list(bundle.pins) == [new.ca_hash(), rig.old.ca_hash()]
        assert [pki.load_certs(p.encode())[0] for p in bundle.ca_pems] == [new.cert, rig.old.cert]
        (cross,) = [pki.load_certs(p.encode())[0] for p in bundle.cross_pems]
        assert pki.issued_by(cross, rig.old.cert)
        assert bundle.drop_at == status["rotation"]["drop_at"]
    events = [e.kind for e in rig.store.list_events()]
    assert "ca_rotated" in events
    # Renewal signs with the new CA and says so.
    answer = rig.renew("gpu-1")
    assert answer.error == ""
    cert = pki.load_certs(answer.certificate_pem.encode())[0]
    assert pki.issued_by(cert, new.cert)
    assert pki.load_certs(answer.ca_pem.encode())[0] == new.cert
    assert rig.authority.nodes_on_previous() == ["gpu-2"]


def test_finish_is_refused_while_a_node_holds_an_old_certificate(rig: Rig) -> None:
    rig.authority.rotate(3600, actor="operator")
    rig.renew("gpu-1")
    with pytest.raises(
        Conflict, match=r"nodes gpu-2 still hold certificates of the old CA.*--force"
    ):
        rig.authority.finish(actor="operator")
    assert (rig.pki_dir / pki.PREVIOUS_CA_CERT).exists()
    rig.renew("gpu-2")
    assert rig.authority.nodes_on_previous() == []
    rig.sent("gpu-1"), rig.sent("gpu-2")
    status = rig.authority.finish(actor="operator")
    assert status["previous"] is None and status["rotation"]["dropped"] is not None
    assert not (rig.pki_dir / pki.PREVIOUS_CA_KEY).exists()
    for node in ("gpu-1", "gpu-2"):
        (msg,) = rig.sent(node)
        assert msg is not None and list(msg.trust_bundle.pins) == [rig.ca.ca_hash()]
        assert not msg.trust_bundle.cross_pems and msg.trust_bundle.drop_at == 0
    with pytest.raises(Conflict, match="no CA rotation is under way"):
        rig.authority.finish(actor="operator")


def test_a_forced_finish_cuts_the_nodes_left_on_the_old_ca(rig: Rig) -> None:
    rig.authority.rotate(3600, actor="operator")
    rig.renew("gpu-1")
    rig.sent("gpu-2")
    rig.authority.finish(force=True, actor="operator")
    msgs = rig.sent("gpu-2")
    assert msgs[-1] is None  # its stream is closed
    assert all(m is not None for m in rig.sent("gpu-1"))
    dropped = [e for e in rig.store.list_events() if e.kind == "ca_dropped"]
    assert dropped and "cut off: gpu-2" in dropped[-1].message


def test_a_second_rotation_is_refused_while_one_is_under_way(rig: Rig) -> None:
    rig.authority.rotate(3600, actor="operator")
    with pytest.raises(Conflict, match="finish-rotation"):
        rig.authority.rotate(3600, actor="operator")


def test_revoked_and_renewed_nodes_are_not_counted(rig: Rig) -> None:
    rig.authority.rotate(3600, actor="operator")
    rig.membership.revoke("gpu-2", actor="operator")
    rig.renew("gpu-1")
    assert rig.authority.nodes_on_previous() == []


def test_run_drops_the_old_ca_when_the_overlap_ends(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.authority.rotate(60, actor="operator")
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 61)

    async def main() -> None:
        task = asyncio.create_task(rig.authority.run())
        try:
            for _ in range(200):
                rotation = pki.read_rotation(rig.pki_dir)
                if rotation is not None and not rotation.active:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("the old CA was not dropped")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert not (rig.pki_dir / pki.PREVIOUS_CA_CERT).exists()
    # Both nodes were still on the old CA: dropped all the same, and cut off.
    assert rig.sent("gpu-1")[-1] is None
