"""The cluster CA the control plane signs with, and its rotation (``llmgw ctl cert rotate-ca``).

A rotation (:func:`llmgw.pki.rotate_ca`) makes a new CA that the old one cross-signs; this
module moves the running control plane onto it: its own certificates are reissued under the
new CA (each carrying the cross-certificate, so agents that trust only the old CA still
accept them), the shared :class:`~llmgw.pki.Authority` every signing part holds moves to
the new CA (enrolment, renewal and update orders sign with it from then on), the listeners
are told to load the new files, and every agent is sent the new trust bundle
(:class:`pb.TrustBundle`), on which it renews its certificate under the new CA. After the
overlap the old CA is dropped: by :meth:`ClusterAuthority.run` when its time comes (or at the
next start, :func:`llmgw.pki.ensure_server_identity`), or early by :meth:`finish`, which
refuses while nodes still hold certificates of the old CA unless forced.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from llmgw import caexport, pki
from llmgw.errors import Conflict, PKIError
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.store import Store
from llmgw.server.store.states import NodeState

__all__ = ["ClusterAuthority"]

log = logging.getLogger("llmgw.server.authority")


class ClusterAuthority:
    """The control plane's CA: what it is, what agents must trust, and its rotation."""

    def __init__(
        self,
        pki_dir: Path,
        ca: pki.Authority,
        store: Store,
        *,
        sessions: Mapping[str, NodeSession],
        hosts: Sequence[str],
        on_reissued: Callable[[], None] = lambda: None,
    ) -> None:
        self.pki_dir = Path(pki_dir)
        self.ca = ca  # shared with every part that signs: moved in place on a rotation
        self.store = store
        self.sessions = sessions
        self.hosts = list(hosts)
        # The listeners load the reissued certificates and the new trust (the wiring's).
        self.on_reissued = on_reissued
        self._changed = asyncio.Event()

    # -- what it is --------------------------------------------------------------------------

    def rotation(self) -> pki.Rotation | None:
        return pki.read_rotation(self.pki_dir)

    def nodes_on_previous(self, rotation: pki.Rotation | None = None) -> list[str]:
        """Nodes (not revoked) holding a certificate, neither revoked nor expired, that the
        old CA of the rotation under way issued: recorded before the rotation started (every
        certificate recorded since is the new CA's: the shared Authority moved before the
        rotation returned, on the one thread that signs)."""
        rotation = rotation or self.rotation()
        if rotation is None or not rotation.active:
            return []
        now = time.time()
        holders = []
        for node in self.store.list_nodes():
            if node.state == NodeState.REVOKED:
                continue
            for cert in self.store.list_certificates(node.id):
                if not cert.revoked and cert.not_after > now and cert.issued_at < rotation.started:
                    holders.append(node.id)
                    break
        return holders

    def status(self) -> dict[str, Any]:
        """What ``llmgw ctl cert`` shows: the CA, the one being replaced and when it is
        dropped, and the nodes still on it."""
        rotation = self.rotation()
        cert = self.ca.cert
        previous = None
        if rotation is not None and rotation.active:
            previous = {"ca_hash": rotation.previous, "drop_at": rotation.drop_at}
        return {
            "current": {
                "ca_hash": self.ca.ca_hash(),
                "subject": cert.subject.rfc4514_string(),
                "not_after": cert.not_valid_after_utc.timestamp(),
            },
            "previous": previous,
            "rotation": None if rotation is None else rotation.to_json(),
            "nodes_on_previous": self.nodes_on_previous(rotation),
        }

    def bundle_message(self) -> pb.ServerMessage | None:
        """The trust bundle for agents; None when the CA was never rotated (an agent's own
        CA file is then the whole truth, and older agents are spared a message they do not
        know)."""
        rotation = self.rotation()
        if rotation is None:
            return None
        cas = pki.trust_certificates(self.pki_dir)
        return pb.ServerMessage(
            trust_bundle=pb.TrustBundle(
                ca_pems=[pki.cert_pem(c).decode() for c in cas],
                pins=[pki.fingerprint(c.public_key()) for c in cas],
                cross_pems=[pki.cert_pem(c).decode() for c in pki.cross_certificates(self.pki_dir)],
                drop_at=float(rotation.drop_at) if rotation.active else 0.0,
            )
        )

    def export(self, *, cluster_id: str, admin_token: str) -> caexport.CAExport:
        """What another instance needs to sign and verify as this one (:mod:`llmgw.caexport`):
        the CA this instance signs with and its rotation's files. Read on the event loop's
        thread, where a rotation runs too, so never half of one."""
        return caexport.collect(
            self.pki_dir, self.ca, cluster_id=cluster_id, admin_token=admin_token
        )

    def exported(self, export: caexport.CAExport, *, by: str, actor: str) -> None:
        """Record that ``export`` left this instance, sealed, for whoever asked from ``by``."""
        old = ""
        if export.previous_ca_cert is not None:
            old = f" with the old CA {pki.fingerprint(export.previous_ca_cert.public_key())}"
        self.store.add_event(
            "ca_exported",
            "control-plane",
            f"the CA {export.ca_hash}{old} and the admin token were exported, encrypted with a "
            f"passphrase, to {by or 'an unknown address'}",
            actor,
        )
        log.warning(
            "the cluster CA was exported (encrypted) for another control-plane instance",
            extra=kv(ca=export.ca_hash, to=by or "-"),
        )

    def on_connect(self, session: NodeSession) -> None:
        """A node (re)connected: it gets the trust bundle (and renews when it must)."""
        msg = self.bundle_message()
        if msg is not None:
            session.send(msg)

    # -- rotation ------------------------------------------------------------------------------

    def rotate(self, overlap: float, *, actor: str) -> dict[str, Any]:
        """Start a rotation: a new CA, trusted beside the old one for ``overlap`` seconds."""
        try:
            rotation = pki.rotate_ca(self.pki_dir, overlap=overlap)
        except PKIError as exc:
            raise Conflict(exc.message) from exc
        self._reload()
        self.store.add_event(
            "ca_rotated",
            "control-plane",
            f"new CA {rotation.current}; the old CA {rotation.previous} is dropped at "
            f"{_utc(rotation.drop_at)}",
            actor,
        )
        log.warning(
            "the cluster CA was rotated; agents renew their certificates under the new one",
            extra=kv(new=rotation.current, old=rotation.previous, drop_at=_utc(rotation.drop_at)),
        )
        self._broadcast()
        self._changed.set()
        return self.status()

    def finish(self, *, force: bool = False, actor: str) -> dict[str, Any]:
        """Drop the old CA now. Refused (Conflict) while nodes still hold certificates it
        issued, unless ``force``: their streams are then cut, and they come back only
        through a rekey."""
        rotation = self.rotation()
        if rotation is None or not rotation.active:
            raise Conflict("no CA rotation is under way; 'llmgw ctl cert rotate-ca' starts one")
        holders = self.nodes_on_previous(rotation)
        if holders and not force:
            names = ", ".join(holders[:10]) + (
                f" and {len(holders) - 10} more" if len(holders) > 10 else ""
            )
            raise Conflict(
                f"nodes {names} still hold certificates of the old CA; they renew under the new "
                "CA when they connect. Wait for them ('llmgw ctl cert' lists who is left), or "
                "drop the old CA now with --force: those nodes then cannot connect until they "
                "are rekeyed ('llmgw ctl join-command --rekey NODE')"
            )
        self._drop(holders, actor=actor)
        return self.status()

    def _drop(self, holders: list[str], *, actor: str = "") -> None:
        """``actor``: the operator who finished the rotation ('' when its time ran out)."""
        try:
            done = pki.finish_rotation(self.pki_dir)
        except PKIError as exc:
            raise Conflict(exc.message) from exc
        self._reload()
        self.store.add_event(
            "ca_dropped",
            "control-plane",
            f"the old CA {done.previous} is no longer trusted"
            + (f"; cut off: {', '.join(holders)}" if holders else ""),
            actor,
        )
        log.warning(
            "dropped the old cluster CA",
            extra=kv(old=done.previous, cut_off=",".join(holders) or "-"),
        )
        self._broadcast()
        for node_id in holders:
            session = self.sessions.get(node_id)
            if session is not None:
                session.close()

    def _reload(self) -> None:
        """The control plane's certificates under the CA now in the directory, the shared
        Authority moved to it, and the listeners told."""
        ca, _server, _client = pki.ensure_server_identity(self.pki_dir, hosts=self.hosts)
        self.ca.move_to(ca)
        self.on_reissued()

    def _broadcast(self) -> None:
        msg = self.bundle_message()
        if msg is None:
            return
        for session in list(self.sessions.values()):
            session.send(msg)

    async def run(self) -> None:
        """Drop the old CA when its overlap ends; returns only when cancelled."""
        while True:
            self._changed.clear()
            rotation = self.rotation()
            if rotation is not None and rotation.active:
                wait = rotation.drop_at - time.time()
                if wait <= 0:
                    holders = self.nodes_on_previous(rotation)
                    log.warning(
                        "the CA rotation's overlap has ended; dropping the old CA",
                        extra=kv(old=rotation.previous, still_on_it=",".join(holders) or "-"),
                    )
                    try:
                        self._drop(holders)  # its time ran out: no operator acted
                    except Conflict as exc:  # finished meanwhile by an operator
                        log.info("the old CA is already dropped", extra=kv(reason=str(exc)))
                    continue
                timeout = min(wait, 3600.0)
            else:
                timeout = None
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except TimeoutError:
                pass


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds))
