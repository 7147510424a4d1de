"""Signed self-updates from the control plane's side (DESIGN §7): the admin password that
guards them, signing orders with the cluster CA, sending them to nodes and keeping each
node's update status.

An order is the canonical JSON of ``{node_id, version, counter, sha256, url, arch,
expires}`` signed with the CA's key (ECDSA P-256, SHA-256, DER); a node's root helper
verifies it with nothing but the CA certificate. ``counter`` grows by one per order and per
node and is kept in the store, so a node's helper, which refuses any counter not above the
last it accepted, can never be replayed an old order. An order for a node that is not
connected is kept and sent when it reconnects, unless it expired by then.

The admin password is made at the first start into ``admin.password`` next to
``admin.token`` (0600) and kept in the store only as a scrypt hash; the admin token alone
cannot update nodes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.contracts.update_order import (
    FINAL_STATES,
    canonical_order,
    check_order_fields,
    verify_order,
)
from llmgw.errors import ConfigError, Conflict, NotFound, PasswordError
from llmgw.fsutil import write_private
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb
from llmgw.server.bundles import RIDS, Bundle
from llmgw.server.store import NodeUpdate

if TYPE_CHECKING:
    from llmgw.server.app import ControlPlane
    from llmgw.server.stream import NodeSession

__all__ = [
    "DEFAULT_ORDER_TTL",
    "MIN_PASSWORD",
    "PASSWORD_FILE",
    "Updates",
    "check_password",
    "hash_password",
    "sign_order",
    "verify_order",
]

log = logging.getLogger("llmgw.server.updates")

PASSWORD_FILE = "admin.password"
PASSWORD_META = "admin_password_hash"
MIN_PASSWORD = 12
DEFAULT_ORDER_TTL = 3600
# scrypt: 16 MiB and about 50 ms per check: cheap for an operator, dear for a guesser.
_SCRYPT_N, _SCRYPT_R, _SCRYPT_P = 2**14, 8, 1


def sign_order(ca_key: ec.EllipticCurvePrivateKey, order: dict[str, Any]) -> tuple[bytes, bytes]:
    """The canonical bytes of ``order`` and the CA's DER ECDSA-SHA256 signature of them.

    Only the field names and types are checked, not whether the order makes sense, so a
    test can sign an expired or downgrading order on purpose."""
    check_order_fields(order)
    data = canonical_order(order)
    return data, ca_key.sign(data, ec.ECDSA(hashes.SHA256()))


# -- the admin password ------------------------------------------------------------------------------


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """``scrypt$N$r$p$salt$hash`` (base64) of ``password``."""
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(
        password.encode(), salt=salt, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P, dklen=32
    )
    b64 = base64.b64encode
    return f"scrypt${_SCRYPT_N}${_SCRYPT_R}${_SCRYPT_P}${b64(salt).decode()}${b64(digest).decode()}"


def check_password(stored: str, password: str) -> bool:
    """Whether ``password`` matches the ``stored`` hash (constant time)."""
    try:
        scheme, n, r, p, salt, digest = stored.split("$")
        if scheme != "scrypt":
            return False
        expected = base64.b64decode(digest)
        got = hashlib.scrypt(
            password.encode(),
            salt=base64.b64decode(salt),
            n=int(n),
            r=int(r),
            p=int(p),
            dklen=len(expected),
        )
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, expected)


def _new_password() -> str:
    return "llmgw-pw-" + secrets.token_urlsafe(18)


class Updates:
    """The control plane's update orders and each node's update status."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp

    @property
    def password_file(self) -> Path:
        return self.cp.cfg.admin_token_file.parent / PASSWORD_FILE

    def start(self) -> None:
        """Make the admin password at the first start: into admin.password (0600) and, as a
        hash, into the store. A password file left without a hash (a new store) is kept."""
        store = self.cp.store
        if store.get_meta(PASSWORD_META):
            return
        path = self.password_file
        try:
            password = path.read_text().strip()
        except FileNotFoundError:
            password = ""
        except OSError as exc:
            raise ConfigError(
                f"cannot read the admin password: {exc.strerror}; it must be readable by the "
                "control plane's user",
                file=str(path),
            ) from exc
        if not password:
            password = _new_password()
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(path, (password + "\n").encode())
        store.set_meta(PASSWORD_META, hash_password(password))
        log.info("admin password created", extra=kv(file=str(path)))

    async def check(self, password: object) -> None:
        """PasswordError unless ``password`` is the admin password."""
        stored = self.cp.store.get_meta(PASSWORD_META) or ""
        ok = isinstance(password, str) and bool(password)
        if ok:
            ok = await asyncio.to_thread(check_password, stored, str(password))
        if not ok:
            raise PasswordError(
                "wrong admin password; nothing was signed. It was made at the control plane's "
                f"first start in {self.password_file} (unless changed since with 'llmgw ctl "
                "admin password'); give it at the prompt or in LLMGW_ADMIN_PASSWORD"
            )

    async def change_password(self, old: object, new: object) -> None:
        await self.check(old)
        if not isinstance(new, str) or len(new) < MIN_PASSWORD:
            raise PasswordError(
                f"the new admin password must have at least {MIN_PASSWORD} characters; "
                "nothing was changed"
            )
        if new == old:
            raise PasswordError("the new admin password is the old one; nothing was changed")
        stored = await asyncio.to_thread(hash_password, new)
        self.cp.store.set_meta(PASSWORD_META, stored)
        # The first password's file would now mislead (and leak nothing but an old secret).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.password_file)
        self.cp.store.add_event("admin_password_changed", "control-plane", "admin password changed")

    # -- ordering --------------------------------------------------------------------------------

    def bundle_url(self, bundle: Bundle) -> str:
        """Where a node downloads ``bundle``: the HTTP listener (https when server.yaml has
        tls), at the host the nodes dial for the stream (the order's SHA-256, signed, is what
        makes a plain download safe)."""
        host = self.cp.stream_addresses()[0].rsplit(":", 1)[0]
        return f"{self.cp.cfg.http_scheme}://{host}:{self.cp.http_port}{bundle.url_path}"

    async def order(
        self,
        node_ids: list[str] | None,
        *,
        version: str,
        password: object,
        ttl: int = DEFAULT_ORDER_TTL,
    ) -> list[dict[str, Any]]:
        """Sign and send (or keep for the reconnect) an update to ``version`` for each node
        (None: every approved node). All is checked before anything is signed: the password,
        the nodes, and that this control plane serves ``version`` for each node's
        architecture."""
        await self.check(password)
        store = self.cp.store
        if node_ids is None:
            nodes = [n for n in store.list_nodes() if n.state == "approved"]
            if not nodes:
                raise NotFound("there is no approved node to update; 'llmgw ctl nodes' lists them")
        else:
            nodes = [store.get_node(n) for n in node_ids]
            for node in nodes:
                if node.state != "approved":
                    raise Conflict(
                        f"node {node.id} is {node.state}; only approved nodes are updated "
                        f"('llmgw ctl approve {node.id} --fingerprint ...' first)"
                    )
        served = await self.cp.bundles.bundles() if self.cp.bundles is not None else []
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
                    f"{self.cp.cfg.bundle_dir} (the newest of each architecture is served)"
                )
            plan.append((node, arch, bundle))
        assert self.cp.ca is not None
        expires = int(time.time()) + ttl
        out = []
        for node, arch, bundle in plan:
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
                }
                data, signature = sign_order(self.cp.ca.key, order)
                op_id = uuid.uuid4().hex
                store.put_update(
                    node.id,
                    counter=counter,
                    version=version,
                    state="queued",
                    message="waiting for the node to connect",
                    op_id=op_id,
                    order=data,
                    signature=signature,
                    expires=expires,
                )
            store.add_event(
                "update_ordered", node.id, f"version {version}, counter {counter} ({bundle.rid})"
            )
            session = self.cp.sessions.get(node.id)
            if session is not None:
                self._send(session, store.get_update(node.id))
            update = store.get_update(node.id)
            assert update is not None
            out.append(update_json(update))
        return out

    def _send(self, session: NodeSession, update: NodeUpdate | None) -> None:
        if update is None or update.order is None or update.signature is None:
            return
        meta = pb.OrderMeta(epoch=self.cp.epoch, op_id=update.op_id)
        session.send(
            pb.ServerMessage(
                update_order=pb.UpdateOrder(
                    meta=meta, order=update.order, signature=update.signature
                )
            )
        )
        self.cp.store.set_update_state(
            update.node_id, update.counter, "sent", "sent to the node; waiting for its download"
        )
        log.info(
            "update order sent",
            extra=kv(node=update.node_id, version=update.version, counter=update.counter),
        )

    def on_connect(self, session: NodeSession) -> None:
        """A node (re)connected: send the order it has not had yet, unless it expired."""
        update = self.cp.store.get_update(session.node_id)
        if update is None or update.state != "queued":
            return
        if update.expires is not None and update.expires <= time.time():
            self.cp.store.set_update_state(
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
        update = self.cp.store.get_update(node_id)
        if update is None or status.counter != update.counter:
            log.info(
                "update status for another order",
                extra=kv(node=node_id, counter=status.counter, state=state),
            )
            return
        if update.state == state and update.message == status.message:
            return
        self.cp.store.set_update_state(node_id, update.counter, state, status.message)
        if state in FINAL_STATES:
            self.cp.store.add_event(
                f"update_{state.replace('-', '_')}",
                node_id,
                f"version {update.version}, counter {update.counter}: {status.message}",
            )
        log.info(
            "update status",
            extra=kv(node=node_id, counter=status.counter, state=state, message=status.message),
        )

    def status_of(self, node_id: str) -> dict[str, Any] | None:
        update = self.cp.store.get_update(node_id)
        return None if update is None else update_json(update)

    def all_status(self) -> dict[str, dict[str, Any]]:
        return {u.node_id: update_json(u) for u in self.cp.store.list_updates()}


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
