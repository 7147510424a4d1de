"""Who may be part of the fleet: admission, approval, rejection, revocation and renewal.

A node is admitted on its first stream as **pending** (it may stay connected but gets no
orders, and little of what it sends is kept: llmgw.server.fleet.intake) with the fingerprint of
the key in its certificate; an operator who compares that fingerprint approves it.
Revocation puts every certificate serial of the node on the deny list and cuts its stream
at once; only a fresh join brings it back. Certificates of approved nodes are renewed over
the stream with a CSR for a new key; the new certificate replaces the old one, whose serial
goes on the deny list as soon as the new one is issued (the stream it came on stays up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from cryptography import x509

from llmgw.errors import ConfigError, Conflict, LlmgwError, NotFound
from llmgw.log import kv
from llmgw.netaddr import RESERVED_NAMES, check_node_id_free
from llmgw.pki import Authority, check_csr, fingerprint, load_csr, serial_hex, sign_csr
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.reports import store_inventory
from llmgw.server.fleet.scheduler import Scheduler
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.gateway.routing import Router
from llmgw.server.joining.enroll import RENEWED, record_certificate
from llmgw.server.store import Node, Store
from llmgw.server.store.states import NodeState

__all__ = ["Membership"]

log = logging.getLogger("llmgw.server.nodes")


class Membership:
    def __init__(
        self,
        store: Store,
        scheduler: Scheduler,
        router: Router,
        *,
        sessions: Mapping[str, NodeSession],
        ca: Authority,
        cert_lifetime: float,
        forget_node: Callable[[str], None] = lambda node_id: None,
        control_plane_names: Callable[[], Iterable[str]] = lambda: RESERVED_NAMES,
    ) -> None:
        self.store = store
        # The names this control plane answers to; the other instances' are in the store.
        self.control_plane_names = control_plane_names
        self.scheduler = scheduler
        self.router = router
        self.sessions = sessions
        self.ca = ca
        self.cert_lifetime = cert_lifetime
        # Drops the data-plane connections pooled to a node (the gateway's).
        self.forget_node = forget_node
        self.revoked: set[str] = set()

    def load(self) -> None:
        self.revoked = self.store.revoked_serials()

    def enrolled(self, node: Node) -> None:
        """A fresh join or a rekey denied the node's older certificates: drop the stream that
        uses one, so the agent reconnects with its new identity."""
        self.load()
        session = self.sessions.get(node.id)
        if session is not None and session.serial in self.revoked:
            session.close()
        # Pooled data-plane connections may still be to the old identity.
        self.forget_node(node.id)

    # -- streams ---------------------------------------------------------------------------------

    def refusal(self, node_id: str, cert: x509.Certificate | None) -> str | None:
        if cert is None:
            return "the stream presented no client certificate; join the node first"
        serial = serial_hex(cert)
        rejoin = f"the node can come back only through a fresh join ('llmgw ctl join-command --node {node_id}')"
        if serial in self.revoked:
            if self._replaced_by_renewal(node_id, serial):
                return (
                    f"certificate {serial} of node {node_id} was replaced by a renewal and is "
                    "no longer valid; the agent must use the renewed certificate (check "
                    "node.crt in its state directory) or get a new one with 'llmgw ctl "
                    f"join-command --rekey {node_id}'"
                )
            return f"certificate {serial} of node {node_id} was revoked; {rejoin}"
        try:
            node = self.store.get_node(node_id)
        except NotFound:
            return None
        if node.state == NodeState.REVOKED:
            return f"node {node_id} is revoked; {rejoin}"
        return None

    def _replaced_by_renewal(self, node_id: str, serial: str) -> bool:
        try:
            node = self.store.get_node(node_id)
        except NotFound:
            return False
        if node.state != NodeState.APPROVED:
            return False
        return any(
            c.serial == serial and c.reason == RENEWED
            for c in self.store.list_certificates(node_id)
        )

    def admit(self, node_id: str, cert: x509.Certificate) -> None:
        """Record the node (pending when new) and the certificate it connected with."""
        store = self.store
        fp = fingerprint(cert.public_key())
        serial = serial_hex(cert)
        with store.transaction():
            try:
                store.get_node(node_id)
                new = False
            except NotFound:
                new = True
            if new:
                store.upsert_node(
                    node_id, dataplane_addr=None, agent_version=None, inventory={}, connected=True
                )
                store.set_node_state(node_id, NodeState.PENDING)
                store.add_event("node_pending", node_id, f"awaiting approval, key {fp}")
            store.set_node_fingerprint(node_id, fp)
            if serial not in {c.serial for c in store.list_certificates(node_id)}:
                record_certificate(store, node_id, cert)
        if new:
            log.info("a new node is waiting for approval", extra=kv(node=node_id, fingerprint=fp))

    # -- operator decisions ------------------------------------------------------------------------

    def approve(self, node_id: str, fp: str, *, actor: str) -> None:
        """Admit a pending node whose key has fingerprint ``fp``; ``actor``: who approved it
        (recorded in the events with the fingerprint compared)."""
        store = self.store
        node = store.get_node(node_id)
        if node.state == NodeState.APPROVED:
            raise Conflict(f"node {node_id} is already approved")
        if node.state == NodeState.REVOKED:
            raise Conflict(
                f"node {node_id} is revoked; it can come back only through a fresh join "
                f"('llmgw ctl join-command --node {node_id}')"
            )
        if not fp:
            raise Conflict(
                f"approve needs the fingerprint the node printed when it joined: 'llmgw ctl approve "
                f"{node_id} --fingerprint {node.fingerprint}' after comparing it on the node"
            )
        if fp.lower() != (node.fingerprint or "").lower():
            raise Conflict(
                f"fingerprint {fp} does not match node {node_id}'s key {node.fingerprint}; do not "
                "approve: compare with what 'llmgw agent join' printed on the node"
            )
        try:  # an instance registered since the node enrolled may answer to its name
            check_node_id_free(
                node_id, self.control_plane_names(), instances=store.instance_names()
            )
        except ConfigError as exc:
            raise Conflict(
                f"{exc.message.removeprefix('node_id: ')}; do not approve it: reject it "
                f"('llmgw ctl reject {node_id}') and join the machine under another id"
            ) from None
        store.set_node_state(node_id, NodeState.APPROVED)
        store.add_event("node_approved", node_id, f"key {node.fingerprint}", actor)
        log.info("node approved", extra=kv(node=node_id, actor=actor))
        session = self.sessions.get(node_id)
        if session is not None:
            session.approved = True
            held, session.held_inventory = session.held_inventory, None
            if held is not None:
                # What it reported while pending (only a summary was stored).
                store_inventory(store, session, held)
            session.send(
                pb.ServerMessage(
                    node_state=pb.NodeState(
                        state=NodeState.APPROVED, message="approved by an operator"
                    )
                )
            )
        self.scheduler.kick()

    def reject(self, node_id: str, *, actor: str) -> None:
        store = self.store
        node = store.get_node(node_id)
        if node.state != NodeState.PENDING:
            raise Conflict(
                f"node {node_id} is {node.state}, not pending; to throw out an admitted node use "
                f"'llmgw ctl revoke {node_id}'"
            )
        serials = store.revoke_certificates(node_id, reason="rejected")
        self.revoked.update(serials)
        store.delete_node(node_id)
        store.add_event("node_rejected", node_id, f"{len(serials)} certificates denied", actor)
        self._cut(node_id)

    def revoke(self, node_id: str, *, actor: str) -> list[str]:
        store = self.store
        node = store.get_node(node_id)
        serials = store.revoke_certificates(node_id, reason="revoked by an operator")
        self.revoked.update(serials)
        if node.state == NodeState.REVOKED and not serials:
            raise Conflict(f"node {node_id} is already revoked")
        store.set_node_state(node_id, NodeState.REVOKED)
        store.add_event(
            "node_revoked", node_id, f"denied certificates {', '.join(serials) or '-'}", actor
        )
        log.warning("node revoked", extra=kv(node=node_id, serials=",".join(serials), actor=actor))
        # Its replicas are stopped there (the orders go out before the stream is cut) and
        # rebuilt elsewhere.
        replicas = {s.replica_id for s in store.list_shards(node_id=node_id)}
        for replica_id in replicas:
            self.scheduler.remove_replica(replica_id, why=f"node {node_id} revoked")
        self._cut(node_id)
        self.scheduler.kick()
        return serials

    def _cut(self, node_id: str) -> None:
        self.router.remove_node(node_id)
        self.forget_node(node_id)
        session = self.sessions.get(node_id)
        if session is not None:
            session.close()

    # -- renewal -------------------------------------------------------------------------------------

    def renew(self, session: NodeSession, csr_pem: str) -> None:
        store = self.store
        ca = self.ca
        try:
            node = store.get_node(session.node_id)
            if node.state == NodeState.REVOKED:
                raise Conflict(f"node {session.node_id} is revoked")
            if node.state != NodeState.APPROVED or not session.approved:
                raise Conflict(
                    f"node {session.node_id} is {node.state}: certificates are renewed only "
                    "for approved nodes; compare its fingerprint and approve it first ('llmgw "
                    f"ctl approve {session.node_id} --fingerprint {node.fingerprint}')"
                )
            csr = load_csr(csr_pem)
            check_csr(csr, session.node_id)
            cert = sign_csr(ca, csr, node_id=session.node_id, lifetime=self.cert_lifetime)
        except LlmgwError as exc:
            log.warning("refused a renewal", extra=kv(node=session.node_id, error=str(exc)))
            session.send(pb.ServerMessage(renew_certificate=pb.RenewCertificate(error=str(exc))))
            return
        from cryptography.hazmat.primitives.serialization import Encoding

        until = time.strftime("%Y-%m-%d %H:%M", time.gmtime(cert.not_valid_after_utc.timestamp()))
        with store.transaction():
            issued = record_certificate(store, session.node_id, cert)
            fp, serial = issued.fingerprint, issued.serial
            store.set_node_fingerprint(session.node_id, fp)
            # The renewed certificate replaces every other one of the node (the one this
            # stream came on, and any an earlier renewal issued that the node never took).
            replaced = store.revoke_certificates(
                session.node_id, reason=RENEWED, except_serial=serial
            )
            store.add_event(
                "cert_renewed",
                session.node_id,
                f"serial {serial} until {until}Z; replaced {', '.join(replaced) or '-'}",
            )
        self.revoked.update(replaced)
        log.info(
            "renewed a node certificate",
            extra=kv(node=session.node_id, serial=serial, replaced=",".join(replaced)),
        )
        session.send(
            pb.ServerMessage(
                renew_certificate=pb.RenewCertificate(
                    certificate_pem=cert.public_bytes(Encoding.PEM).decode(),
                    ca_pem=ca.cert.public_bytes(Encoding.PEM).decode(),
                )
            )
        )
