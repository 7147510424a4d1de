"""The enrolment endpoint: a node trades a one-time token and a CSR for its certificate.

HTTPS (the control plane's server certificate, no client certificate) on ``enroll_listen``:

``GET /enroll/ca``
    the cluster CA certificate (PEM), which the agent checks against its ``--ca-hash`` pin.
``POST /enroll``
    JSON ``{"token", "node_id", "csr", "rekey"?, "node_uid"?, "re_pair"?}`` (at most
    64 KiB; ``re_pair``, old name ``lost_state``: a rekey by a node whose state directory is
    gone, which names its uid itself and needs a re-pair token) ->
    ``{"certificate", "ca", "node_id", "node_uid", "fingerprint", "state", "expires_at",
    "servers"}``; refusals are ``{"error": {"code", "message"}}`` with the error's HTTP status.

A request either succeeds completely (token used, node recorded, certificate issued and
recorded, event added) or leaves the store exactly as it was.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import netaddr, pki
from llmgw.contracts.joining import REPAIR_FLAG
from llmgw.contracts.rekeyproof import proof_message, verify_proof
from llmgw.errors import CertificateError, ConfigError, EnrolmentError, LlmgwError, NotFound
from llmgw.listener import GuardedSite, ListenerLimits
from llmgw.log import kv
from llmgw.netaddr import format_hostport
from llmgw.server.joining.enrolrequest import MAX_BODY, EnrolRequest, parse_enrol_request, too_large
from llmgw.server.store import Certificate, JoinToken, Node, Store
from llmgw.server.store.states import NodeState

__all__ = [
    "RENEWED",
    "Enroller",
    "EnrolmentServer",
    "record_certificate",
    "server_ssl_context",
]

log = logging.getLogger("llmgw.server.enroll")


def record_certificate(store: Store, node_id: str, cert: x509.Certificate) -> Certificate:
    """Record ``cert``, issued to ``node_id``, among the store's certificates: its serial,
    its key's fingerprint and its validity. The caller holds the transaction."""
    return store.add_certificate(
        pki.serial_hex(cert),
        node_id=node_id,
        fingerprint=pki.fingerprint(cert.public_key()),
        not_before=cert.not_valid_before_utc.timestamp(),
        not_after=cert.not_valid_after_utc.timestamp(),
    )


RENEWED = "replaced by a renewal"
"""The revocation reason of a certificate a renewal replaced: its key was still the node's
until the node took the renewed one (it may not have, if it stopped in between)."""


READ_TIMEOUT = 30.0
"""Seconds a client may take to send its request body."""


class Enroller:
    """Turns a checked :class:`EnrolRequest` into a certificate, in one store transaction."""

    def __init__(
        self,
        store: Store,
        ca: pki.Authority,
        *,
        lifetime: float,
        servers: Callable[[], list[str]],
        on_enrolled: Callable[[Node], None] | None = None,
        control_plane_names: Callable[[], Iterable[str]] = lambda: netaddr.RESERVED_NAMES,
    ) -> None:
        self.store = store
        self._control_plane_names = control_plane_names
        self.ca = ca
        self.lifetime = lifetime
        self._servers = servers
        self._on_enrolled = on_enrolled
        self.ca_pem = ca.cert.public_bytes(serialization.Encoding.PEM).decode("ascii")

    def _check_node_id_free(self, node_id: str) -> None:
        """Refuse a node id the control plane or another registered instance answers to (a
        token minted before such ids were refused, by an older version, or before that
        instance was registered, may still name one); a rekey too."""
        try:
            netaddr.check_node_id_free(
                node_id, self._control_plane_names(), instances=self.store.instance_names()
            )
        except ConfigError as exc:
            raise EnrolmentError(
                exc.message.removeprefix("node_id: ") + "; this token cannot be used",
                code="node_id_reserved",
                status=403,
            ) from exc

    def _check_old_key(self, req: EnrolRequest, new_fp: str) -> None:
        """Refuse a plain rekey that does not prove, by a signature, a key the control plane
        issued a live certificate for (the uid alone is no secret). A node not known, revoked
        or of another uid is left to :meth:`Store.enrol_node`, which refuses it by name."""
        try:
            node = self.store.get_node(req.node_id)
        except NotFound:
            return
        if node.state == NodeState.REVOKED or node.uid != req.node_uid:
            return
        repair = (
            f"if its key is gone, re-pair it: 'llmgw ctl join-command --rekey {node.id} "
            f"{REPAIR_FLAG}', then 'llmgw agent join --node-uid {node.uid}' on the node"
        )
        if req.proof is None:
            raise EnrolmentError(
                f"a rekey of {node.id} proves the node's current key, and this request carries "
                "no proof (an agent older than the control plane sends none): upgrade the "
                f"agent first (install-agent.sh upgrade), then rekey; {repair}",
                code="old_key_unproven",
                status=403,
            )
        message = proof_message(
            node_id=node.id, node_uid=node.uid, new_key_fingerprint=new_fp, token=req.token
        )
        try:
            proved = verify_proof(req.proof, message)
        except ValueError as exc:
            raise EnrolmentError(
                f"the proof of {node.id}'s current key is refused: {exc}; rekey with 'llmgw "
                f"agent join --rekey' on the node itself; {repair}",
                code="old_key_unproven",
                status=403,
            ) from None
        if proved not in self._current_keys(node.id) | {node.fingerprint}:
            raise EnrolmentError(
                f"the key this node proved ({proved}) is not {node.id}'s: no live certificate "
                f"of {node.id} is for it; rekey on the node itself, or {repair}",
                code="old_key_unknown",
                status=403,
            )

    def _current_keys(self, node_id: str) -> set[str]:
        """The fingerprints of the keys of the node's current identity: its certificates
        since the last one a join, rekey, rejection or revocation ended, live or replaced by
        a renewal (a node that stopped before it took its renewed certificate still has the
        key of the one before)."""
        keys: set[str] = set()
        for cert in self.store.list_certificates(node_id):  # oldest first
            if cert.revoked and cert.reason != RENEWED:
                keys.clear()  # an identity ended here; what came before is not the node's
            else:
                keys.add(cert.fingerprint)
        return keys

    def _auto_approve(self, token: JoinToken, node: Node, fp: str, serial: str) -> Node:
        """A fresh join with an auto-approve token: the node is approved on this first use
        (the operator chose trust on first use for this token when minting it), in the
        enrolment's transaction; the events and the token keep the key that was trusted."""
        store = self.store
        store.add_event(
            "node_enrolled",
            node.id,
            f"joined with key {fp}, certificate {serial}, by auto-approve token {token.id}",
        )
        store.set_node_state(node.id, NodeState.APPROVED)
        store.record_auto_approval(token.id, fp)
        store.add_event(
            "node_approved",
            node.id,
            f"key {fp}, trusted on first use of auto-approve token {token.id}",
            f"auto-approve:{token.id}",
        )
        return store.get_node(node.id)

    def enrol(self, req: EnrolRequest, *, peer: str = "") -> dict[str, Any]:
        """Use the token, check the CSR, record the node and its certificate, and return the
        response body. Any refusal (an :class:`EnrolmentError`) leaves the store untouched."""
        servers = list(self._servers())  # before anything is written: it cannot undo a join
        try:
            with self.store.transaction():
                done = self._enrol(req)
        except EnrolmentError as exc:
            log.warning(
                "enrolment refused",
                extra=kv(
                    code=exc.code, node=req.node_id, kind=req.kind, peer=peer, reason=exc.message
                ),
            )
            raise
        node = done.node
        log.info(
            "node enrolled"
            if not req.rekey
            else ("node re-paired" if done.token.lost_state else "node rekeyed"),
            extra=kv(
                node=node.id,
                uid=node.uid,
                state=node.state,
                fingerprint=done.fingerprint,
                serial=done.serial,
                token=done.token.id,
                peer=peer,
            ),
        )
        if self._on_enrolled is not None:
            try:
                self._on_enrolled(node)
            except Exception:  # the node is enrolled; a listener's bug must not undo that
                log.exception("on_enrolled failed", extra=kv(node=node.id))
        return {
            "certificate": done.cert.public_bytes(serialization.Encoding.PEM).decode("ascii"),
            "ca": self.ca_pem,
            "node_id": node.id,
            "node_uid": node.uid,
            "fingerprint": done.fingerprint,
            "state": node.state,
            "expires_at": done.cert.not_valid_after_utc.timestamp(),
            "servers": servers,
        }

    def _enrol(self, req: EnrolRequest) -> _Enrolled:
        """The enrolment's writes, in the caller's transaction: the token spent, the node
        recorded, its certificate issued and recorded."""
        store = self.store
        # The token first: an unknown one is refused before any parsing work.
        token = store.consume_join_token(
            req.token,
            node_id=req.node_id,
            kind=req.kind,
            node_uid=req.node_uid,
            lost_state=req.re_pair,
        )
        self._check_node_id_free(token.node_id)
        csr = pki.load_csr(req.csr)
        pki.check_csr(csr, token.node_id)
        fp = pki.fingerprint(csr.public_key())
        if req.rekey and not token.lost_state:
            self._check_old_key(req, fp)
        node = store.enrol_node(
            token.node_id,
            fingerprint=fp,
            rekey=req.rekey,
            node_uid=req.node_uid,
            # A node without its old key proves nothing but the token: the operator
            # approves the new key by its fingerprint.
            require_approval=token.require_approval or token.lost_state,
        )
        cert = pki.sign_csr(self.ca, csr, node_id=node.id, lifetime=self.lifetime)
        serial = record_certificate(store, node.id, cert).serial
        node = self._record_kind(req, token, node, fp, serial)
        return _Enrolled(token=token, node=node, fingerprint=fp, serial=serial, cert=cert)

    def _record_kind(
        self, req: EnrolRequest, token: JoinToken, node: Node, fp: str, serial: str
    ) -> Node:
        """What this kind of enrolment does after the certificate: a rekey or re-pair revokes
        the node's older certificates, an auto-approve join approves the node; each says so
        in the events."""
        store = self.store
        if req.rekey and token.lost_state:
            store.revoke_certificates(node.id, reason="re-paired", except_serial=serial)
            store.add_event(
                "node_repaired",
                node.id,
                f"re-paired {'without' if req.re_pair else 'with'} its old state "
                f"(uid {node.uid} kept): new key {fp}, certificate {serial}; older "
                "certificates revoked; compare the fingerprint and approve it with "
                f"'llmgw ctl approve {node.id}'",
            )
        elif req.rekey:
            store.revoke_certificates(node.id, reason="rekeyed", except_serial=serial)
            store.add_event(
                "node_rekeyed",
                node.id,
                f"new key {fp}, certificate {serial}; older certificates revoked",
            )
        elif token.auto_approve:
            return self._auto_approve(token, node, fp, serial)
        else:
            store.add_event(
                "node_enrolled",
                node.id,
                f"joined with key {fp}, certificate {serial}; compare the fingerprint "
                f"and approve it with 'llmgw ctl approve {node.id}'",
            )
        return node


@dataclass(frozen=True)
class _Enrolled:
    """What one enrolment wrote: the token it spent, the node, its new certificate."""

    token: JoinToken
    node: Node
    fingerprint: str
    serial: str
    cert: x509.Certificate


def server_ssl_context(identity: pki.Identity) -> ssl.SSLContext:
    """TLS for the enrolment port: the control plane's server certificate, no client auth
    (a joining node has no certificate yet)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(identity.cert, identity.key)
    except (OSError, ssl.SSLError) as exc:
        raise CertificateError(
            f"cannot load the server certificate {identity.cert} with {identity.key} ({exc}); "
            "restart 'llmgw server' to reissue it"
        ) from exc
    return ctx


def _error_response(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own refusals (404, 405, ...) as our JSON error body."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status, "bad_request")
        return _error_response(
            exc.status,
            code,
            f"{request.method} {request.path[:100]}: {exc.reason}; the enrolment endpoint "
            "serves GET /enroll/ca and POST /enroll",
        )


class EnrolmentServer:
    """The HTTPS listener for ``GET /enroll/ca`` and ``POST /enroll``."""

    def __init__(self, enroller: Enroller) -> None:
        self.enroller = enroller
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(
        self,
        host: str,
        port: int,
        ssl_ctx: ssl.SSLContext,
        *,
        limits: ListenerLimits | None = None,
    ) -> int:
        """Listen on ``host:port`` (0: any free port) with TLS; return the bound port."""
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_json_errors])
        app.router.add_get("/enroll/ca", self._get_ca)
        app.router.add_post("/enroll", self._post_enroll)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        site = GuardedSite(
            runner,
            host,
            port,
            label="enroll",
            limits=limits or ListenerLimits(),
            ssl_context=ssl_ctx,
            hint="listeners.enroll_connections_per_source and listeners.header_timeout in "
            "server.yaml",
        )
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(
                f"cannot listen on {format_hostport(host, port)}: {exc.strerror or exc}; free "
                "the port or change enroll_listen",
                key="enroll_listen",
            ) from exc
        self._runner = runner
        self.port = site.bound_port
        log.info("enrolment listening", extra=kv(addr=format_hostport(host, self.port)))
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _get_ca(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.enroller.ca_pem.encode("ascii"), content_type="application/x-pem-file"
        )

    async def _post_enroll(self, request: web.Request) -> web.Response:
        peer = request.remote or ""
        try:
            body = await _read_body(request)
            req = parse_enrol_request(body)
        except EnrolmentError as exc:
            log.warning("enrolment refused", extra=kv(code=exc.code, peer=peer, reason=exc.message))
            return _error_response(exc.status, exc.code, exc.message)
        try:
            # Synchronous on purpose: the store is used from this event loop's thread only,
            # and the transaction must not interleave with other coroutines' writes.
            result = self.enroller.enrol(req, peer=peer)
        except EnrolmentError as exc:  # logged by the enroller
            return _error_response(exc.status, exc.code, exc.message)
        except LlmgwError as exc:
            log.error("enrolment failed", extra=kv(node=req.node_id, peer=peer, error=str(exc)))
            return _error_response(
                503,
                "unavailable",
                f"the control plane cannot enrol nodes right now ({exc}); retry in a minute",
            )
        except Exception:
            log.exception("enrolment failed", extra=kv(node=req.node_id, peer=peer))
            return _error_response(
                500,
                "internal",
                "the control plane failed while enrolling this node; see its log "
                "(journalctl -u llmgw-server) and retry",
            )
        return web.json_response(result)


async def _read_body(request: web.Request) -> bytes:
    """The body, refused as soon as it is known to exceed MAX_BODY (header or bytes read)."""
    declared = request.content_length
    if declared is not None and declared > MAX_BODY:
        raise too_large(declared)
    buf = bytearray()
    try:
        async with asyncio.timeout(READ_TIMEOUT):
            async for chunk in request.content.iter_chunked(16 * 1024):
                buf += chunk
                if len(buf) > MAX_BODY:
                    raise too_large()
    except TimeoutError as exc:
        raise EnrolmentError(
            f"the request body did not arrive within {READ_TIMEOUT:g} s; check the network "
            "and retry",
            code="request_timeout",
            status=408,
        ) from exc
    return bytes(buf)
