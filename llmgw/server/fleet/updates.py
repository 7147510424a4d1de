"""Signed self-updates from the control plane's side (DESIGN §7): signing orders with the
cluster CA (behind the admin password, llmgw.server.accounts.passwords), sending them to nodes and
keeping each node's update status.

An order is the canonical JSON of ``{node_id, version, counter, sha256, url, arch,
expires}`` signed with the CA's key (ECDSA P-256, SHA-256, DER); a node's root helper
verifies it with nothing but the CA certificate. ``counter`` grows by one per order and per
node and is kept in the store, so a node's helper, which refuses any counter not above the
last it accepted, can never be replayed an old order. An order for a node that is not
connected is kept and sent when it reconnects, unless it expired by then. Orders are signed
with the CA the control plane has now; across a CA rotation they also carry what lets a
helper that still trusts the old CA verify them (:func:`rotation_fields`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw import __version__
from llmgw.contracts.update_order import (
    FINAL_STATES,
    canonical_order,
    check_order_fields,
)
from llmgw.errors import Conflict, NotFound
from llmgw.log import kv
from llmgw.pki import Authority, cert_pem, cross_certificates
from llmgw.proto import control_pb2 as pb
from llmgw.server.accounts.operators import OperatorAccounts
from llmgw.server.fleet.stream import NodeSession
from llmgw.server.joining.bundles import BUNDLES_PACKAGE, RIDS, Bundle
from llmgw.server.store import Node, NodeUpdate, Store
from llmgw.server.store.states import NodeState
from llmgw.versions import newer_release

__all__ = [
    "DEFAULT_ORDER_TTL",
    "Updates",
    "rotation_fields",
    "sign_order",
    "version_problem",
]

log = logging.getLogger("llmgw.server.updates")

DEFAULT_ORDER_TTL = 3600


def sign_order(ca_key: ec.EllipticCurvePrivateKey, order: dict[str, Any]) -> tuple[bytes, bytes]:
    """The canonical bytes of ``order`` and the CA's DER ECDSA-SHA256 signature of them.

    Only the field names and types are checked, not whether the order makes sense, so a
    test can sign an expired or downgrading order on purpose."""
    check_order_fields(order)
    data = canonical_order(order)
    return data, ca_key.sign(data, ec.ECDSA(hashes.SHA256()))


def version_problem(version: str, server_version: str) -> str | None:
    """Why a control plane at ``server_version`` refuses to order agents to ``version``, or
    None: an agent of a newer release would have its stream refused (llmgw.server.fleet.stream),
    so the control plane is upgraded first."""
    if not newer_release(version, server_version):
        return None
    return (
        f"version {version} is newer than this control plane (llmgw {server_version}), which "
        f"would refuse agents at {version}; upgrade the control plane to {version} or later "
        "first, then update the agents"
    )


def rotation_fields(ca: Authority) -> dict[str, Any]:
    """What an order carries while a CA rotation's overlap lasts, so that a node's root helper
    that still trusts the old CA verifies an order signed by the new one and then moves its
    trust to it (llmgw.contracts.update_order): the new CA's pin, its certificate and the old
    CA's cross-certificate for it. Nothing outside a rotation (older helpers refuse fields
    they do not know)."""
    cross = cross_certificates(ca.directory)
    if not cross:
        return {}
    return {
        "ca_pin": ca.ca_hash(),
        "ca_certs": [cert_pem(c).decode() for c in (ca.cert, *cross)],
    }


class Updates:
    """The control plane's update orders and each node's update status."""

    def __init__(
        self,
        store: Store,
        *,
        accounts: OperatorAccounts,
        ca: Authority,
        epoch: int,
        sessions: Mapping[str, NodeSession],
        served: Callable[[], Awaitable[list[Bundle]]],
        download_base: Callable[[], str],
        bundle_dir: Path,
        server_version: str = __version__,
    ) -> None:
        self.store = store
        # Whose password signs: the caller's account (admin's, the admin password, for the
        # admin token).
        self.accounts = accounts
        self.ca = ca
        self.epoch = epoch
        self.sessions = sessions
        # The bundles this control plane serves, and the base URL nodes download them from
        # (both known only once the HTTP listener is up).
        self.served = served
        self.download_base = download_base
        self.bundle_dir = bundle_dir
        self.server_version = server_version

    # -- ordering --------------------------------------------------------------------------------

    def bundle_url(self, bundle: Bundle) -> str:
        """Where a node downloads ``bundle``: the HTTP listener (https when server.yaml has
        tls), at the host the nodes dial for the stream (the order's SHA-256, signed, is what
        makes a plain download safe)."""
        return self.download_base() + bundle.url_path

    async def order(
        self,
        node_ids: list[str] | None,
        *,
        version: str,
        password: object,
        account: str,
        actor: str,
        ttl: int = DEFAULT_ORDER_TTL,
        source: str = "",
    ) -> list[dict[str, Any]]:
        """Sign and send (or keep for the reconnect) an update to ``version`` for each node
        (None: every approved node). All is checked before anything is signed: ``password``
        (``account``'s, who orders; ``admin``, the admin password, for the admin token), the
        nodes, that ``version`` is not of a newer release than this control plane, and that
        it serves ``version`` for each node's architecture. ``actor`` is recorded; the
        password's check counts against ``account`` and *source* (the client's address)."""
        await self.accounts.confirm(account, password, refused="nothing was signed", source=source)
        too_new = version_problem(version, self.server_version)
        if too_new is not None:
            raise Conflict(too_new)
        nodes = self._nodes_to_update(node_ids)
        plan = await self._bundles_for(nodes, version)
        expires = int(time.time()) + ttl
        return [
            self._order_one(node, arch, bundle, version, expires, actor)
            for node, arch, bundle in plan
        ]

    def _nodes_to_update(self, node_ids: list[str] | None) -> list[Node]:
        """The nodes named (each approved), or every approved node (at least one)."""
        if node_ids is None:
            nodes = [n for n in self.store.list_nodes() if n.state == NodeState.APPROVED]
            if not nodes:
                raise NotFound("there is no approved node to update; 'llmgw ctl nodes' lists them")
            return nodes
        nodes = [self.store.get_node(n) for n in node_ids]
        for node in nodes:
            if node.state != NodeState.APPROVED:
                raise Conflict(
                    f"node {node.id} is {node.state}; only approved nodes are updated "
                    f"('llmgw ctl approve {node.id} --fingerprint ...' first)"
                )
        return nodes

    async def _bundles_for(self, nodes: list[Node], version: str) -> list[tuple[Node, str, Bundle]]:
        """Each node with its architecture and the bundle of ``version`` served for it;
        Conflict, before anything is signed, for a node without one."""
        served = await self.served()
        by_arch = {b.rid.removeprefix("linux-"): b for b in served}
        have = ", ".join(f"{b.version} ({b.rid})" for b in served) or "no bundle at all"
        plan = []
        for node in nodes:
            arch = _node_arch(node.inventory.get("arch"))
            if arch is None:
                raise Conflict(
                    f"the architecture of node {node.id} is not known "
                    f"({node.inventory.get('arch') or 'it never connected'}); connect it once "
                    "before updating it"
                )
            bundle = by_arch.get(arch)
            if bundle is None or bundle.version != version:
                raise Conflict(
                    f"this control plane does not serve version {version} for linux-{arch} "
                    f"(node {node.id}); it serves {have}. Copy "
                    f"llmgw-agent-{version}-linux-{arch}.tar.gz into "
                    f"{self.bundle_dir}, or install the {BUNDLES_PACKAGE} package of "
                    f"{version} (the newest of each architecture is served)"
                )
            plan.append((node, arch, bundle))
        return plan

    def _order_one(
        self,
        node: Node,
        arch: str,
        bundle: Bundle,
        version: str,
        expires: int,
        actor: str,
    ) -> dict[str, Any]:
        """Sign ``node``'s order with its next counter, keep it, and send it if the node is
        connected; the update as the admin API shows it."""
        store = self.store
        with store.transaction():
            counter = store.next_update_counter(node.id)
            order = {
                "node_id": node.id,
                "version": version,
                "counter": counter,
                "sha256": bundle.sha256,
                "url": self.bundle_url(bundle),
                "arch": arch,
                "expires": expires,
                **rotation_fields(self.ca),
            }
            data, signature = sign_order(self.ca.key, order)
            store.put_update(
                node.id,
                counter=counter,
                version=version,
                state="queued",
                message="waiting for the node to connect",
                op_id=uuid.uuid4().hex,
                order=data,
                signature=signature,
                expires=expires,
            )
        store.add_event(
            "update_ordered",
            node.id,
            f"version {version}, counter {counter} ({bundle.rid})",
            actor,
        )
        session = self.sessions.get(node.id)
        if session is not None:
            self._send(session, store.get_update(node.id))
        update = store.get_update(node.id)
        assert update is not None
        return update_json(update)

    def _send(self, session: NodeSession, update: NodeUpdate | None) -> None:
        if update is None or update.order is None or update.signature is None:
            return
        meta = pb.OrderMeta(epoch=self.epoch, op_id=update.op_id)
        session.send(
            pb.ServerMessage(
                update_order=pb.UpdateOrder(
                    meta=meta, order=update.order, signature=update.signature
                )
            )
        )
        self.store.set_update_state(
            update.node_id, update.counter, "sent", "sent to the node; waiting for its download"
        )
        log.info(
            "update order sent",
            extra=kv(node=update.node_id, version=update.version, counter=update.counter),
        )

    def on_connect(self, session: NodeSession) -> None:
        """A node (re)connected: send the order it has not had yet, unless it expired."""
        update = self.store.get_update(session.node_id)
        if update is None or update.state != "queued":
            return
        if update.expires is not None and update.expires <= time.time():
            self.store.set_update_state(
                update.node_id,
                update.counter,
                "expired",
                "the node did not connect before the order expired; order it again",
            )
            return
        self._send(session, update)

    def on_status(self, session: NodeSession, status: pb.UpdateStatus) -> None:
        """Progress reported by the node: kept when it is about the node's latest order."""
        node_id = session.node_id
        state = status.state or "unknown"
        update = self.store.get_update(node_id)
        if update is None or status.counter != update.counter:
            log.info(
                "update status for another order",
                extra=kv(node=node_id, counter=status.counter, state=state),
            )
            return
        if update.state == state and update.message == status.message:
            return
        self.store.set_update_state(node_id, update.counter, state, status.message)
        if state in FINAL_STATES:
            self.store.add_event(
                f"update_{state.replace('-', '_')}",
                node_id,
                f"version {update.version}, counter {update.counter}: {status.message}",
            )
        log.info(
            "update status",
            extra=kv(node=node_id, counter=status.counter, state=state, message=status.message),
        )

    def status_of(self, node_id: str) -> dict[str, Any] | None:
        update = self.store.get_update(node_id)
        return None if update is None else update_json(update)

    def all_status(self) -> dict[str, dict[str, Any]]:
        return {u.node_id: update_json(u) for u in self.store.list_updates()}


def update_json(update: NodeUpdate) -> dict[str, Any]:
    return {
        "node": update.node_id,
        "counter": update.counter,
        "version": update.version,
        "state": update.state,
        "message": update.message,
        "op_id": update.op_id,
        "expires_at": update.expires,
        "ordered_at": update.ordered_at,
        "updated_at": update.updated_at,
        "final": update.state in FINAL_STATES,
    }


def _node_arch(machine: object) -> str | None:
    if not isinstance(machine, str):
        return None
    name = machine.lower()
    return next((rid.removeprefix("linux-") for rid, names in RIDS.items() if name in names), None)
