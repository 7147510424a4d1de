"""Renewal over the stream (llmgw.server.fleet.nodes): only for approved nodes, and the renewed
certificate replaces the old one everywhere: its serial is on the deny list the stream and
the gateway's data-plane check read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import pki
from llmgw.bodies import BodyBudget
from llmgw.errors import Conflict
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.config import load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.fleet.nodes import Membership
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.gateway import Gateway, GatewaySettings
from llmgw.server.gateway.routing import Router
from llmgw.server.gateway.serving import ServingCache
from llmgw.server.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "llmgw.db")
    yield s
    s.close()


class Fleet:
    """A Membership on a real store and CA, with one node joined and connected."""

    def __init__(self, tmp: Path, store: Store) -> None:
        self.ca = pki.init_ca(tmp / "ca")
        self.store = store
        identity = pki.issue_node_cert(self.ca, "gpu-1", tmp / "gpu-1")
        self.cert = pki.load_cert(identity.cert)
        self.sessions: dict[str, NodeSession] = {}
        self.membership = Membership(
            store,
            cast(Any, SimpleNamespace(kick=lambda: None)),
            Router(),
            sessions=self.sessions,
            ca=self.ca,
            cert_lifetime=3600.0,
        )
        self.membership.admit("gpu-1", self.cert)
        self.session = NodeSession(
            node_id="gpu-1",
            dataplane_addr="127.0.0.1:1",
            epoch=1,
            engines=frozenset(),
            serial=pki.serial_hex(self.cert),
        )
        self.sessions["gpu-1"] = self.session

    def approve(self) -> None:
        fp = self.store.get_node("gpu-1").fingerprint or ""
        self.membership.approve("gpu-1", fp, actor="operator")

    def renew(self) -> pb.RenewCertificate:
        key = pki.new_private_key()
        csr = pki.make_csr(key, "gpu-1").public_bytes(serialization.Encoding.PEM).decode()
        self.membership.renew(self.session, csr)
        while True:
            msg = self.session.queue.get_nowait()
            assert msg is not None
            if msg.WhichOneof("msg") == "renew_certificate":
                return msg.renew_certificate


def der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def test_renewal_is_refused_while_the_node_is_pending(tmp_path: Path, store: Store) -> None:
    fleet = Fleet(tmp_path, store)
    answer = fleet.renew()
    assert not answer.certificate_pem
    assert "node gpu-1 is pending" in answer.error
    assert "certificates are renewed only for approved nodes" in answer.error
    assert "llmgw ctl approve gpu-1 --fingerprint sha256:" in answer.error
    assert [c.serial for c in store.list_certificates("gpu-1")] == [pki.serial_hex(fleet.cert)]
    assert fleet.membership.revoked == set()


def test_a_renewal_puts_the_replaced_serial_on_the_deny_list(tmp_path: Path, store: Store) -> None:
    fleet = Fleet(tmp_path, store)
    fleet.approve()
    old = pki.serial_hex(fleet.cert)
    answer = fleet.renew()
    assert not answer.error
    renewed = x509.load_pem_x509_certificate(answer.certificate_pem.encode())
    new = pki.serial_hex(renewed)
    # The old serial is denied at once, in memory and in the store; the new one is not.
    assert fleet.membership.revoked == {old}
    assert store.revoked_serials() == {old}
    # The stream refuses the old certificate, saying it was replaced and what to do.
    refusal = fleet.membership.refusal("gpu-1", fleet.cert)
    assert refusal is not None
    assert f"certificate {old} of node gpu-1 was replaced by a renewal" in refusal
    assert "llmgw ctl join-command --rekey gpu-1" in refusal
    assert fleet.membership.refusal("gpu-1", renewed) is None
    # The gateway refuses a data plane presenting the old certificate, takes the new one.
    gateway = Gateway(
        Router(),
        Metrics(),
        ServingCache(store, max_request_body=1024),
        BodyBudget(1024),
        GatewaySettings.of(load_server_config(None)),
        revoked=lambda: fleet.membership.revoked,
        client_ssl=lambda: None,
        nodes_connected=lambda: 1,
        epoch=1,
        started_at=0.0,
    )
    assert gateway.forwarder.agent_certificate_problem(der(fleet.cert), "gpu-1") is not None
    assert gateway.forwarder.agent_certificate_problem(der(renewed), "gpu-1") is None
    # A second renewal replaces the first renewed certificate too.
    again = fleet.renew()
    newer = pki.serial_hex(x509.load_pem_x509_certificate(again.certificate_pem.encode()))
    assert fleet.membership.revoked == {old, new}
    assert store.latest_certificate("gpu-1").serial == newer  # type: ignore[union-attr]


def test_approval_stores_the_inventory_held_while_pending(tmp_path: Path, store: Store) -> None:
    fleet = Fleet(tmp_path, store)
    held = pb.Inventory(hostname="gpu-1", cpus=96, engines=["sim"])
    fleet.session.held_inventory = held
    fleet.approve()
    assert store.get_node("gpu-1").inventory["cpus"] == 96
    assert fleet.session.engines == frozenset({"sim"})
    assert store.list_events()[0].kind == "inventory_changed"
    assert fleet.session.approved and fleet.session.held_inventory is None


def _degraded_inventory(*reasons: pb.DegradedReason) -> pb.Inventory:
    return pb.Inventory(hostname="gpu-1", engines=["sim"], degraded=list(reasons))


BROKEN_VLLM = pb.DegradedReason(
    code="engine", engine="vllm", message="engine vllm (/opt/vllm) will not run: libcudart"
)
NO_DOCKER = pb.DegradedReason(code="docker", message="runtime is docker but dockerd is gone")


def _events(store: Store, kind: str) -> list[str]:
    return [e.message for e in reversed(store.list_events(subject="gpu-1")) if e.kind == kind]


def test_a_node_approved_degraded_says_so_in_an_event(tmp_path: Path, store: Store) -> None:
    fleet = Fleet(tmp_path, store)
    fleet.session.held_inventory = _degraded_inventory(BROKEN_VLLM)
    fleet.approve()
    assert _events(store, "node_degraded") == [BROKEN_VLLM.message]
    assert store.get_node("gpu-1").inventory["degraded"][0]["engine"] == "vllm"


def test_events_follow_the_reasons_not_every_inventory(tmp_path: Path, store: Store) -> None:
    from llmgw.server.fleet.reports import store_inventory

    fleet = Fleet(tmp_path, store)
    fleet.approve()
    assert _events(store, "node_degraded") == []
    store_inventory(store, fleet.session, _degraded_inventory(BROKEN_VLLM))
    store_inventory(store, fleet.session, _degraded_inventory(BROKEN_VLLM))  # no news
    store_inventory(store, fleet.session, _degraded_inventory(BROKEN_VLLM, NO_DOCKER))
    store_inventory(store, fleet.session, _degraded_inventory())
    assert _events(store, "node_degraded") == [
        BROKEN_VLLM.message,
        f"{BROKEN_VLLM.message}; {NO_DOCKER.message}",
    ]
    assert _events(store, "node_healthy") == [
        f"no longer degraded (was: {BROKEN_VLLM.message}; {NO_DOCKER.message})"
    ]


def test_a_node_whose_name_an_instance_took_since_it_joined_is_not_approved(
    tmp_path: Path, store: Store
) -> None:
    """gpu-1 enrolled, then a control-plane instance answering to gpu-1 was registered: the
    pending node's approval is refused with the way out, and nothing changes."""
    fleet = Fleet(tmp_path, store)
    store.register_instance("cp2", "host/1", stale_after=30, version="0.1.0")
    store.set_instance_addresses(
        "cp2",
        stream="gpu-1:7443",
        http="https://gpu-1:8080",
        enroll="gpu-1:8443",
        ca_hash="",
        client_serial="",
        server_serial="",
        names=["gpu-1", "gpu-1.example"],
    )
    with pytest.raises(Conflict) as info:
        fleet.approve()
    assert str(info.value) == (
        "invalid node id 'gpu-1': control-plane instance cp2 answers to that name (it is in "
        "that instance's TLS certificate), and a node under it could pose as that instance; "
        "give this machine another node id (node_id in its agent.yaml, 'llmgw ctl join-command "
        "--node OTHER-ID'); do not approve it: reject it ('llmgw ctl reject gpu-1') and join "
        "the machine under another id"
    )
    assert store.get_node("gpu-1").state == "pending"
