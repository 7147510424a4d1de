"""Tests for the enrolment endpoint: real TLS on loopback, a real store on a temporary file,
every refusal leaving the store untouched, and a fuzz of the request parser and enroller."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw import pki
from llmgw.contracts.joining import refusal
from llmgw.contracts.rekeyproof import proof_message, sign_proof
from llmgw.errors import EnrolmentError, StoreError
from llmgw.server.joining import enroll
from llmgw.server.joining.enroll import (
    RENEWED,
    Enroller,
    EnrolmentServer,
    record_certificate,
    server_ssl_context,
)
from llmgw.server.joining.enrolrequest import MAX_BODY, EnrolRequest, parse_enrol_request
from llmgw.server.store import Node, Store
from tests.unit.clock import Clock

NODE = "gpu-1"
LIFETIME = 3600.0
SERVERS = ["cp-1.example:7443", "10.0.0.5:7443"]


@dataclass(frozen=True)
class PKI:
    ca: pki.Authority
    server: pki.Identity


@pytest.fixture(scope="module")
def cluster_pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    ca, server, _ = pki.ensure_server_identity(
        tmp_path_factory.mktemp("cp") / "pki", hosts=["127.0.0.1"]
    )
    return PKI(ca=ca, server=server)


@dataclass
class Env:
    store: Store
    clock: Clock
    ca: pki.Authority
    enrolled: list[Node]
    url: str = ""
    client_ssl: ssl.SSLContext = field(default_factory=ssl.create_default_context)

    def mint(self, node_id: str = NODE, **kw: Any) -> str:
        kw.setdefault("ttl", 600)
        return self.store.create_join_token(node_id, **kw)[1]

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self.store)


def snapshot(store: Store) -> dict[str, Any]:
    """Everything an enrolment may change."""
    return {
        "nodes": store.list_nodes(),
        "certificates": store.list_certificates(),
        "events": store.list_events(limit=1_000_000),
        "tokens": store.list_join_tokens(include_inactive=True),
    }


@pytest.fixture
def env(cluster_pki: PKI, tmp_path: Path) -> Any:
    clock = Clock(time.time())
    store = Store.open(tmp_path / "state.db", clock=clock)
    yield Env(store=store, clock=clock, ca=cluster_pki.ca, enrolled=[])
    store.close()


def make_enroller(env: Env) -> Enroller:
    return Enroller(
        env.store,
        env.ca,
        lifetime=LIFETIME,
        servers=lambda: list(SERVERS),
        on_enrolled=env.enrolled.append,
    )


def serve(
    env: Env, cluster_pki: PKI, body: Callable[[Env], Awaitable[None]], *, enroller: Any = None
) -> None:
    """Run ``body`` against a live enrolment server on 127.0.0.1 (port 0, real TLS)."""

    async def main() -> None:
        server = EnrolmentServer(enroller or make_enroller(env))
        port = await server.start("127.0.0.1", 0, server_ssl_context(cluster_pki.server))
        assert port > 0 and server.port == port
        env.url = f"https://127.0.0.1:{port}"
        env.client_ssl = ssl.create_default_context(cafile=str(cluster_pki.server.ca))
        try:
            await body(env)
        finally:
            await server.stop()

    asyncio.run(main())


async def post(env: Env, payload: Any, *, raw: bool = False) -> tuple[int, dict[str, Any]]:
    data = payload if raw else json.dumps(payload).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            env.url + "/enroll",
            data=data,
            ssl=env.client_ssl,
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.content_type == "application/json"
        return resp.status, await resp.json()


def request(secret: str, node_id: str = NODE, **kw: Any) -> dict[str, Any]:
    key = kw.pop("key", None) or pki.new_private_key()
    csr = kw.pop("csr", None) or pki.make_csr(key, kw.pop("cn", node_id))
    body = {
        "token": secret,
        "node_id": node_id,
        "csr": csr.public_bytes(serialization.Encoding.PEM).decode(),
    }
    body.update(kw)
    return body


def proved(secret: str, old: Any, uid: str, node_id: str = NODE, **kw: Any) -> dict[str, Any]:
    """A rekey request whose proof is signed by *old*, the key the node has now."""
    key = kw.pop("key", None) or pki.new_private_key()
    message = proof_message(
        node_id=node_id,
        node_uid=uid,
        new_key_fingerprint=pki.fingerprint(key.public_key()),
        token=secret,
    )
    body = request(secret, node_id, key=key, rekey=True, node_uid=uid, **kw)
    body["proof"] = sign_proof(old, message)
    return body


def check_certificate(
    env: Env, answer: dict[str, Any], key: Any, node_id: str = NODE
) -> x509.Certificate:
    cert = x509.load_pem_x509_certificate(answer["certificate"].encode())
    cert.verify_directly_issued_by(env.ca.cert)
    assert pki.cert_common_name(cert) == node_id
    assert pki.fingerprint(cert.public_key()) == pki.fingerprint(key.public_key())
    assert answer["fingerprint"] == pki.fingerprint(key.public_key())
    assert answer["ca"] == env.ca.cert.public_bytes(serialization.Encoding.PEM).decode()
    assert answer["expires_at"] == cert.not_valid_after_utc.timestamp()
    assert abs(answer["expires_at"] - (time.time() + LIFETIME)) < 30
    assert answer["servers"] == SERVERS
    return cert


# --------------------------------------------------------------------------- success


def test_get_ca(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.get(env.url + "/enroll/ca", ssl=env.client_ssl) as resp,
        ):
            assert resp.status == 200
            assert resp.content_type == "application/x-pem-file"
            pem = await resp.read()
        assert pem == (cluster_pki.ca.directory / "ca.crt").read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
        assert pki.fingerprint(cert.public_key()) == cluster_pki.ca.ca_hash()

    serve(env, cluster_pki, body)


def test_unknown_path_and_method_are_json(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(env.url + "/nope", ssl=env.client_ssl) as resp:
                assert resp.status == 404
                assert (await resp.json())["error"]["code"] == "not_found"
            async with session.get(env.url + "/enroll", ssl=env.client_ssl) as resp:
                assert resp.status == 405
                error = (await resp.json())["error"]
                assert error["code"] == "method_not_allowed"
                assert "POST /enroll" in error["message"]

    serve(env, cluster_pki, body)


def test_join(env: Env, cluster_pki: PKI, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.server.enroll")
    secret = env.mint()
    key = pki.new_private_key()

    async def body(env: Env) -> None:
        status, answer = await post(env, request(secret, key=key))
        assert status == 200, answer
        cert = check_certificate(env, answer, key)
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert abs(lifetime.total_seconds() - (LIFETIME + 300)) < 30  # 5 min backdated
        node = env.store.get_node(NODE)
        assert answer["node_id"] == NODE
        assert answer["node_uid"] == node.uid
        assert answer["state"] == "pending" == node.state
        assert node.fingerprint == answer["fingerprint"]
        [record] = env.store.list_certificates(NODE)
        assert record.serial == pki.serial_hex(cert)
        assert record.not_after == cert.not_valid_after_utc.timestamp()
        assert env.store.latest_certificate(NODE) == record
        [event] = env.store.list_events(subject=NODE)
        assert event.kind == "node_enrolled"
        assert answer["fingerprint"] in event.message
        assert f"llmgw ctl approve {NODE}" in event.message
        [token] = env.store.list_join_tokens(include_inactive=True)
        assert token.used
        assert env.enrolled == [node]

    serve(env, cluster_pki, body)
    assert any(r.getMessage() == "node enrolled" for r in caplog.records)
    assert_secret_not_logged(caplog, secret)


def test_fresh_join_of_a_revoked_node(env: Env, cluster_pki: PKI) -> None:
    first = env.mint()
    second = env.mint()

    async def body(env: Env) -> None:
        status, a = await post(env, request(first))
        assert status == 200
        env.store.set_node_state(NODE, "revoked")
        status, b = await post(env, request(second))
        assert status == 200, b
        assert b["node_uid"] != a["node_uid"] and b["state"] == "pending"
        old, new = env.store.list_certificates(NODE)
        assert old.revoked and old.reason == "replaced by a fresh join"
        assert not new.revoked

    serve(env, cluster_pki, body)


def test_rekey(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        first = pki.new_private_key()
        status, joined = await post(env, request(env.mint(), key=first))
        assert status == 200
        env.store.set_node_state(NODE, "approved")
        uid = joined["node_uid"]
        key = pki.new_private_key()
        secret = env.mint(kind="rekey", node_uid=uid)
        status, answer = await post(env, proved(secret, first, uid, key=key))
        assert status == 200, answer
        check_certificate(env, answer, key)
        assert (answer["node_uid"], answer["state"]) == (uid, "approved")
        old, new = env.store.list_certificates(NODE)
        assert old.revoked and old.reason == "rekeyed"
        assert not new.revoked and new.fingerprint == answer["fingerprint"]
        assert env.store.revoked_serials() == {old.serial}
        assert env.store.list_events(limit=1)[0].kind == "node_rekeyed"
        # with require_approval the node goes back to pending
        secret = env.mint(kind="rekey", node_uid=uid, require_approval=True)
        status, answer = await post(env, proved(secret, key, uid))
        assert status == 200 and answer["state"] == "pending"


def test_a_plain_rekey_must_prove_a_live_key_of_the_node(env: Env, cluster_pki: PKI) -> None:
    """The uid is no secret: a rekey token and the uid, without the node's key, get nothing."""

    async def body(env: Env) -> None:
        first = pki.new_private_key()
        status, joined = await post(env, request(env.mint(), key=first))
        assert status == 200
        env.store.set_node_state(NODE, "approved")
        uid = joined["node_uid"]
        secret = env.mint(kind="rekey", node_uid=uid)

        async def refused(payload: dict[str, Any], code: str) -> str:
            before = env.snapshot()
            status, answer = await post(env, payload)
            assert (status, answer["error"]["code"]) == (403, code), answer
            assert env.snapshot() == before  # the token is not spent either
            return str(answer["error"]["message"])

        message = await refused(request(secret, rekey=True, node_uid=uid), "old_key_unproven")
        assert "carries no proof" in message and "upgrade the agent first" in message
        assert f"'llmgw agent join --node-uid {uid}'" in message
        # Another key's signature (someone else's key): not one issued to the node.
        message = await refused(proved(secret, pki.new_private_key(), uid), "old_key_unknown")
        assert f"no live certificate of {NODE} is for it" in message
        # The right key, but signed for another new key, token or uid: does not verify.
        stolen = proved(secret, first, uid)
        stolen["csr"] = request(secret)["csr"]
        assert "does not verify" in await refused(stolen, "old_key_unproven")
        other_token = proved(env.mint(kind="rekey", node_uid=uid), first, uid)
        other_token["token"] = secret
        await refused(other_token, "old_key_unproven")
        for junk in ({"key": "x", "signature": "y"}, {"key": 1}, {"signature": "!!"}):
            await refused(dict(proved(secret, first, uid), proof=junk), "old_key_unproven")
        status, answer = await post(env, proved(secret, first, uid))
        assert status == 200, answer
        # A lost-state token needs no proof: the node goes to approval instead.
        lost = env.mint(kind="rekey", node_uid=uid, lost_state=True, require_approval=True)
        status, answer = await post(env, request(lost, rekey=True, node_uid=uid))
        assert (status, answer["state"]) == (200, "pending")

    serve(env, cluster_pki, body)


def test_a_node_that_lost_its_state_re_pairs_by_its_uid(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        status, joined = await post(env, request(env.mint()))
        assert status == 200
        env.store.set_node_state(NODE, "approved")
        uid = joined["node_uid"]
        created = env.store.get_node(NODE).created_at
        key = pki.new_private_key()
        secret = env.mint(kind="rekey", node_uid=uid, lost_state=True, require_approval=True)
        status, answer = await post(
            env, request(secret, key=key, rekey=True, node_uid=uid, re_pair=True)
        )
        assert status == 200, answer
        check_certificate(env, answer, key)
        # The same record (uid, age), a new key, pending until approved by fingerprint again.
        assert (answer["node_uid"], answer["state"]) == (uid, "pending")
        node = env.store.get_node(NODE)
        assert (node.uid, node.created_at, node.state) == (uid, created, "pending")
        assert node.fingerprint == answer["fingerprint"]
        old, new = env.store.list_certificates(NODE)
        assert old.revoked and old.reason == "re-paired" and not new.revoked
        event = env.store.list_events(limit=1)[0]
        assert (event.kind, event.subject) == ("node_repaired", NODE)
        assert f"re-paired without its old state (uid {uid} kept)" in event.message
        assert f"'llmgw ctl approve {NODE}'" in event.message

    serve(env, cluster_pki, body)


def test_re_pair_refusals_store_nothing(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        status, joined = await post(env, request(env.mint()))
        assert status == 200
        uid = joined["node_uid"]
        env.store.set_node_state(NODE, "approved")
        plain = env.mint(kind="rekey", node_uid=uid)
        lost = env.mint(kind="rekey", node_uid=uid, lost_state=True, require_approval=True)
        other = env.mint("gpu-2", kind="join")

        async def refused(secret: str, code: str, node_id: str = NODE, **kw: Any) -> str:
            before = env.snapshot()
            kw.setdefault("node_uid", uid)
            status, answer = await post(
                env, request(secret, node_id, rekey=True, re_pair=True, **kw)
            )
            assert (status, answer["error"]["code"]) == (403, code), answer
            assert env.snapshot() == before
            return str(answer["error"]["message"])

        # A plain rekey token without the old state: it needs a re-pair one.
        message = await refused(plain, "token_needs_old_key")
        assert f"'llmgw ctl join-command --rekey {NODE} --re-pair'" in message
        assert "give --node-uid" in await refused(lost, "node_uid_mismatch", node_uid="f" * 32)
        await refused(lost, "token_wrong_node", "gpu-2")
        await refused(other, "token_wrong_kind", "gpu-2")
        status, _ = await post(env, request(lost, rekey=True, node_uid=uid, re_pair=True))
        assert status == 200
        await refused(lost, "token_used")
        expiring = env.mint(
            kind="rekey", node_uid=uid, lost_state=True, require_approval=True, ttl=60
        )
        env.clock.advance(61)
        await refused(expiring, "token_expired")
        revoked_node = env.mint(kind="rekey", node_uid=uid, lost_state=True, require_approval=True)
        env.store.set_node_state(NODE, "revoked")
        assert "only through a fresh join" in await refused(revoked_node, "node_revoked")

    serve(env, cluster_pki, body)


def test_re_pair_without_rekey_is_refused_in_the_contracts_words() -> None:
    base = {"token": "t", "node_id": NODE, "csr": "x", "node_uid": "ab"}
    for name in ("re_pair", "lost_state"):  # the old name is read too
        body = json.dumps({**base, name: True}).encode()
        with pytest.raises(EnrolmentError) as caught:
            parse_enrol_request(body)
        assert str(caught.value) == refusal("repair_without_rekey", node=NODE)
        assert caught.value.code == "bad_request"
        assert parse_enrol_request(json.dumps({**base, "rekey": True, name: True}).encode()).re_pair


@pytest.mark.parametrize("name", ["rekey", "re_pair", "lost_state"])
def test_a_string_false_is_refused_not_read_as_true(name: str) -> None:
    """Python's truth of "false" would make a join a rekey (or a rekey a re-pair): the
    enroller reads its flags through the join contract, as the admin API does."""
    body = json.dumps({"token": "t", "node_id": NODE, "csr": "x", name: "false"}).encode()
    with pytest.raises(EnrolmentError) as caught:
        parse_enrol_request(body)
    assert str(caught.value) == refusal("not_a_flag", name=name, value='"false"')


def test_a_node_that_missed_its_renewal_proves_the_key_before_it(
    env: Env, cluster_pki: PKI
) -> None:
    """A renewal recorded but never taken (the agent stopped in between) leaves the node with
    the key of the certificate it replaced: that key still proves the node. A key from before
    a rekey does not."""

    async def body(env: Env) -> None:
        first = pki.new_private_key()
        status, joined = await post(env, request(env.mint(), key=first))
        assert status == 200
        env.store.set_node_state(NODE, "approved")
        uid = joined["node_uid"]
        renewed = pki.new_private_key()
        cert = pki.sign_csr(env.ca, pki.make_csr(renewed, NODE), node_id=NODE, lifetime=LIFETIME)
        serial = record_certificate(env.store, NODE, cert).serial
        env.store.set_node_fingerprint(NODE, pki.fingerprint(renewed.public_key()))
        env.store.revoke_certificates(NODE, reason=RENEWED, except_serial=serial)
        second = pki.new_private_key()
        status, answer = await post(
            env, proved(env.mint(kind="rekey", node_uid=uid), first, uid, key=second)
        )
        assert status == 200, answer
        # The rekey ended that identity: the first key proves nothing any more.
        secret = env.mint(kind="rekey", node_uid=uid)
        status, answer = await post(env, proved(secret, first, uid))
        assert (status, answer["error"]["code"]) == (403, "old_key_unknown")
        status, answer = await post(env, proved(secret, second, uid))
        assert status == 200, answer

    serve(env, cluster_pki, body)


# --------------------------------------------------------------------------- refusals


def assert_secret_not_logged(caplog: pytest.LogCaptureFixture, secret: str) -> None:
    for record in caplog.records:
        assert secret not in record.getMessage()
        assert secret not in repr(getattr(record, "fields", ""))


def refusal_cases(env: Env) -> dict[str, tuple[Any, int, str, str]]:
    """name -> (body, status, code, a piece of the message), tokens minted on the way."""
    expired = env.mint(ttl=1)
    env.clock.t += 10
    used = env.mint()
    env.store.consume_join_token(used, node_id=NODE, kind="join", node_uid=None)
    revoked = env.mint()
    env.store.revoke_join_token(env.store.list_join_tokens()[-1].id)
    rekey = env.mint(kind="rekey", node_uid="u1")
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    good = env.mint()
    pem = request(good)["csr"]
    return {
        "expired": (request(expired), 403, "token_expired", "expired at"),
        "used": (request(used), 403, "token_used", "already used"),
        "revoked": (request(revoked), 403, "token_revoked", "was revoked"),
        "unknown": (request("llmgwjt_nope"), 403, "token_unknown", "join-command --node gpu-1"),
        "other node": (
            request(good, "gpu-2"),
            403,
            "token_wrong_node",
            "for node gpu-1, not gpu-2",
        ),
        "rekey for join": (request(rekey), 403, "token_wrong_kind", "agent join --rekey"),
        "join for rekey": (
            request(good, rekey=True, node_uid="u1"),
            403,
            "token_wrong_kind",
            "without --rekey",
        ),
        "malformed csr": (
            {**request(good), "csr": "-----BEGIN CERTIFICATE REQUEST-----\nAAAA"},
            400,
            "csr_malformed",
            "not a PEM CSR",
        ),
        "csr for another cn": (
            request(good, cn="gpu-9"),
            400,
            "csr_cn_mismatch",
            "common name 'gpu-9', but it is joining as node gpu-1",
        ),
        "weak key": (request(good, key=weak), 400, "csr_weak_key", "RSA of 1024 bits"),
        "bad json": (b'{"token": ', 400, "bad_json", "not JSON"),
        "not utf-8": (b"\xff\xfe{}", 400, "bad_json", "not JSON"),
        "not an object": ([1, 2], 400, "bad_request", "not a JSON object"),
        "missing csr": (
            {"token": good, "node_id": NODE},
            400,
            "bad_request",
            "field 'csr' is missing",
        ),
        "csr wrong type": (
            {"token": good, "node_id": NODE, "csr": 5},
            400,
            "bad_request",
            "field 'csr' is a number, not a string",
        ),
        "extra field": (
            {**request(good), "admin": True},
            400,
            "bad_request",
            "unknown field(s) 'admin'",
        ),
        "bad node id": (
            request(good, "Bad_Node", csr=pki.load_csr(pem)),
            400,
            "bad_request",
            "field 'node_id': invalid node id 'Bad_Node'",
        ),
        "rekey without uid": (
            request(good, rekey=True),
            400,
            "bad_request",
            "field 'node_uid' is missing",
        ),
        "oversized": (
            {**request(good), "csr": "x" * MAX_BODY},
            413,
            "body_too_large",
            f"larger than {MAX_BODY} bytes",
        ),
    }


def test_every_refusal_stores_nothing(
    env: Env, cluster_pki: PKI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.server.enroll")
    cases = refusal_cases(env)
    secrets_used = {str(c[0]["token"]) for c in cases.values() if isinstance(c[0], dict)}

    async def body(env: Env) -> None:
        for name, (payload, status, code, piece) in cases.items():
            before = env.snapshot()
            got_status, answer = await post(env, payload, raw=isinstance(payload, bytes))
            assert (got_status, answer["error"]["code"]) == (status, code), name
            message = answer["error"]["message"]
            assert piece in message, (name, message)
            assert ";" in message, (name, message)  # the problem, then what to do
            assert env.snapshot() == before, name
        assert env.enrolled == []

    serve(env, cluster_pki, body)
    refusals = [r for r in caplog.records if r.getMessage() == "enrolment refused"]
    assert len(refusals) == len(cases)
    for secret in secrets_used:
        if secret.startswith("llmgwjt_") and len(secret) > 20:
            assert_secret_not_logged(caplog, secret)


def test_uid_mismatch_and_revoked_rekey(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        status, joined = await post(env, request(env.mint()))
        assert status == 200
        uid = joined["node_uid"]
        wrong = env.mint(kind="rekey", node_uid=uid)
        before = env.snapshot()
        status, answer = await post(env, request(wrong, rekey=True, node_uid="f" * 32))
        assert (status, answer["error"]["code"]) == (403, "node_uid_mismatch")
        assert env.snapshot() == before
        env.store.set_node_state(NODE, "revoked")
        before = env.snapshot()
        status, answer = await post(env, request(wrong, rekey=True, node_uid=uid))
        assert (status, answer["error"]["code"]) == (403, "node_revoked")
        assert "only through a fresh join" in answer["error"]["message"]
        assert env.snapshot() == before

    serve(env, cluster_pki, body)


def test_token_used_twice(env: Env, cluster_pki: PKI) -> None:
    secret = env.mint()

    async def body(env: Env) -> None:
        status, _ = await post(env, request(secret))
        assert status == 200
        before = env.snapshot()
        status, answer = await post(env, request(secret))
        assert (status, answer["error"]["code"]) == (403, "token_used")
        assert env.snapshot() == before

    serve(env, cluster_pki, body)


def test_a_refused_csr_leaves_the_token_usable(env: Env, cluster_pki: PKI) -> None:
    secret = env.mint()

    async def body(env: Env) -> None:
        status, answer = await post(env, request(secret, cn="gpu-9"))
        assert (status, answer["error"]["code"]) == (400, "csr_cn_mismatch")
        status, answer = await post(env, request(secret))
        assert status == 200, answer

    serve(env, cluster_pki, body)


async def _chunks(total: int) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        yield b"x" * 8192
        sent += 8192


def test_oversized_chunked_body(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        before = env.snapshot()
        status, answer = await post(env, _chunks(4 * MAX_BODY), raw=True)
        assert (status, answer["error"]["code"]) == (413, "body_too_large")
        assert env.snapshot() == before
        status, answer = await post(env, request(env.mint()))
        assert status == 200

    serve(env, cluster_pki, body)


def test_store_failure_is_503_and_rolls_back(
    env: Env, cluster_pki: PKI, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = env.mint()

    def broken(*args: Any, **kw: Any) -> Any:
        raise StoreError("state database is full; free disk space")

    async def body(env: Env) -> None:
        before = env.snapshot()
        monkeypatch.setattr(env.store, "add_certificate", broken)
        status, answer = await post(env, request(secret))
        assert (status, answer["error"]["code"]) == (503, "unavailable")
        assert "retry" in answer["error"]["message"]
        assert env.snapshot() == before
        monkeypatch.undo()
        status, answer = await post(env, request(secret))
        assert status == 200

    serve(env, cluster_pki, body)


def test_bug_is_500_and_rolls_back(
    env: Env, cluster_pki: PKI, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = env.mint()

    def broken(*args: Any, **kw: Any) -> Any:
        raise RuntimeError("boom")

    async def body(env: Env) -> None:
        before = env.snapshot()
        monkeypatch.setattr(enroll.pki, "sign_csr", broken)
        status, answer = await post(env, request(secret))
        assert (status, answer["error"]["code"]) == (500, "internal")
        assert env.snapshot() == before
        monkeypatch.undo()
        assert (await post(env, request(secret)))[0] == 200

    serve(env, cluster_pki, body)


def test_on_enrolled_failure_does_not_undo_the_join(env: Env, cluster_pki: PKI) -> None:
    def listener(node: Node) -> None:
        raise RuntimeError("listener bug")

    enroller = Enroller(
        env.store, env.ca, lifetime=LIFETIME, servers=lambda: SERVERS, on_enrolled=listener
    )

    async def body(env: Env) -> None:
        status, _ = await post(env, request(env.mint()))
        assert status == 200
        assert env.store.get_node(NODE).state == "pending"

    serve(env, cluster_pki, body, enroller=enroller)


# --------------------------------------------------------------------------- robustness


async def _junk_connection(env: Env, payload: bytes) -> None:
    port = int(env.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        async with asyncio.timeout(10):
            while await reader.read(4096):
                pass  # whatever comes back (a TLS alert), until the server closes
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def test_plain_http_and_garbage_do_not_wedge_the_server(env: Env, cluster_pki: PKI) -> None:
    async def body(env: Env) -> None:
        await _junk_connection(env, b"GET /enroll/ca HTTP/1.1\r\nHost: x\r\n\r\n")
        await _junk_connection(env, bytes(range(256)) * 64)
        await _junk_connection(env, b"\x16\x03\x01\x02\x00" + b"\x00" * 600)  # a broken hello
        # an idle connection that never sends a byte must not hold up anyone else
        port = int(env.url.rsplit(":", 1)[1])
        _idle_reader, idle = await asyncio.open_connection("127.0.0.1", port)
        try:
            status, answer = await post(env, request(env.mint()))
            assert status == 200, answer
        finally:
            idle.close()

    serve(env, cluster_pki, body)


def test_two_concurrent_joins_with_one_token(env: Env, cluster_pki: PKI) -> None:
    secret = env.mint()

    async def body(env: Env) -> None:
        results = await asyncio.gather(post(env, request(secret)), post(env, request(secret)))
        statuses = sorted(status for status, _ in results)
        assert statuses == [200, 403]
        [refused] = [answer for status, answer in results if status == 403]
        assert refused["error"]["code"] == "token_used"
        assert len(env.store.list_certificates()) == 1
        assert len(env.store.list_nodes()) == 1

    serve(env, cluster_pki, body)


def test_start_on_a_busy_port_is_a_config_error(env: Env, cluster_pki: PKI) -> None:
    from llmgw.errors import ConfigError

    async def body(env: Env) -> None:
        port = int(env.url.rsplit(":", 1)[1])
        other = EnrolmentServer(make_enroller(env))
        with pytest.raises(ConfigError, match="enroll_listen"):
            await other.start("127.0.0.1", port, server_ssl_context(cluster_pki.server))
        await other.stop()

    serve(env, cluster_pki, body)


def test_server_ssl_context_bad_files(tmp_path: Path) -> None:
    from llmgw.errors import CertificateError

    missing = pki.Identity(cert=tmp_path / "a.crt", key=tmp_path / "a.key", ca=tmp_path / "ca")
    with pytest.raises(CertificateError, match=r"a\.crt"):
        server_ssl_context(missing)


# --------------------------------------------------------------------------- parser


def test_parse_valid_request() -> None:
    body = json.dumps({"token": "t", "node_id": NODE, "csr": "pem", "node_uid": None}).encode()
    req = parse_enrol_request(body)
    assert req == EnrolRequest(token="t", node_id=NODE, csr="pem", rekey=False, node_uid=None)
    assert req.kind == "join"
    body = json.dumps(
        {"token": "t", "node_id": NODE, "csr": "pem", "rekey": True, "node_uid": "ab"}
    ).encode()
    req = parse_enrol_request(body)
    assert (req.kind, req.node_uid) == ("rekey", "ab")


def test_parse_never_shows_the_token() -> None:
    secret = "llmgwjt_supersecretvalue"
    req = EnrolRequest(token=secret, node_id=NODE, csr="x")
    assert secret not in repr(req)


@pytest.mark.parametrize(
    ("payload", "piece"),
    [
        ({"token": "", "node_id": NODE, "csr": "x"}, "field 'token' is empty"),
        ({"token": "t", "node_id": NODE, "csr": ""}, "field 'csr' is empty"),
        ({"token": "t", "node_id": NODE, "csr": "x", "rekey": 1}, "'rekey' must be true or false"),
        ({"token": "t", "node_id": 7, "csr": "x"}, "field 'node_id' is a number"),
        ({"token": None, "node_id": NODE, "csr": "x"}, "field 'token' is null"),
        (
            {"token": "t", "node_id": NODE, "csr": "x", "rekey": True, "node_uid": "a b"},
            "field 'node_uid' is not a node uid",
        ),
        ({"node_id": NODE, "csr": "x"}, "field 'token' is missing"),
    ],
)
def test_parse_refusals(payload: dict[str, Any], piece: str) -> None:
    with pytest.raises(EnrolmentError) as info:
        parse_enrol_request(json.dumps(payload).encode())
    assert info.value.code == "bad_request" and info.value.status == 400
    assert piece in str(info.value)


def test_parse_deep_nesting_is_bad_json() -> None:
    with pytest.raises(EnrolmentError) as info:
        parse_enrol_request(b"[" * 60000)
    assert info.value.code == "bad_json"


# --------------------------------------------------------------------------- fuzz

FUZZ_NODE = "fuzz-node"
_KEYS = ["token", "node_id", "csr", "rekey", "node_uid"]
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=50),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=15,
)
_mutation = st.one_of(
    st.tuples(st.just("drop"), st.sampled_from(_KEYS), st.none()),
    st.tuples(st.just("set"), st.sampled_from(_KEYS), _json),
    st.tuples(st.just("set"), st.text(max_size=12), _json),
    st.tuples(st.just("set"), st.sampled_from(["csr", "token", "node_id"]), st.text()),
    st.tuples(st.just("huge"), st.sampled_from(_KEYS), st.integers(1_000, 80_000)),
    st.tuples(st.just("tamper"), st.just("csr"), st.integers(0, 10_000)),
    st.tuples(st.just("cn"), st.just("csr"), st.sampled_from(["gpu-2", "fuzz-nodf", "a"])),
    st.tuples(st.just("rekey"), st.just("rekey"), st.sampled_from([None, "0" * 32, "x"])),
    st.tuples(st.just("token"), st.just("token"), st.sampled_from(["other", "rekey", "prefix"])),
)
_cases = st.one_of(
    st.tuples(st.just("bytes"), st.binary(max_size=4096)),
    st.tuples(st.just("json"), _json),
    st.tuples(st.just("structured"), st.lists(_mutation, max_size=3)),
    st.tuples(st.just("structured"), st.lists(_mutation, max_size=1)),
)


def test_fuzz_parse_and_enrol(cluster_pki: PKI, tmp_path: Path) -> None:
    clock = Clock(time.time())
    store = Store.open(tmp_path / "fuzz.db", clock=clock)
    enroller = Enroller(store, cluster_pki.ca, lifetime=LIFETIME, servers=lambda: SERVERS)
    keys = [pki.new_private_key() for _ in range(3)]
    csrs = {
        cn: pki.make_csr(keys[0], cn).public_bytes(serialization.Encoding.PEM).decode()
        for cn in (FUZZ_NODE, "gpu-2", "fuzz-nodf", "a")
    }
    other_token = store.create_join_token("gpu-2", ttl=1e9)[1]
    rekey_token = store.create_join_token(FUZZ_NODE, kind="rekey", ttl=1e9, node_uid="0" * 32)[1]
    current: dict[str, str] = {}
    outcomes: dict[str, int] = {"refused": 0, "enrolled": 0}
    codes: dict[str, int] = {}

    def valid_token() -> str:
        secret = current.get("secret")
        if secret is None or not store.get_join_token(current["id"]).active:
            token, secret = store.create_join_token(FUZZ_NODE, ttl=1e9)
            current.update(secret=secret, id=token.id)
        return secret

    def build(ops: list[tuple[str, str, Any]]) -> bytes:
        body: dict[str, Any] = {
            "token": valid_token(),
            "node_id": FUZZ_NODE,
            "csr": csrs[FUZZ_NODE],
        }
        for op, key, value in ops:
            if op == "drop":
                body.pop(key, None)
            elif op == "set":
                body[key] = value
            elif op == "huge":
                body[key] = "A" * value
            elif op == "tamper":
                text = str(body.get("csr", csrs[FUZZ_NODE]))
                if text:
                    i = value % len(text)
                    body["csr"] = text[:i] + ("B" if text[i] != "B" else "C") + text[i + 1 :]
            elif op == "cn":
                body["csr"] = csrs[value]
            elif op == "rekey":
                body["rekey"] = True
                body["node_uid"] = value
            elif op == "token":
                token = current["secret"]
                body["token"] = {"other": other_token, "rekey": rekey_token, "prefix": token[:14]}[
                    value
                ]
        return json.dumps(body).encode()

    @settings(
        max_examples=1000,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(case=_cases)
    def check(case: tuple[str, Any]) -> None:
        kind, value = case
        if kind == "bytes":
            body = value
        elif kind == "json":
            body = json.dumps(value).encode()
        else:
            body = build(value)
        valid_token()
        before = snapshot(store)
        try:
            answer = enroller.enrol(parse_enrol_request(body))
        except EnrolmentError as exc:
            assert exc.code and exc.message and 400 <= exc.status < 500
            assert snapshot(store) == before
            assert store.get_join_token(current["id"]).active
            outcomes["refused"] += 1
            codes[exc.code] = codes.get(exc.code, 0) + 1
            return
        # Only a genuinely valid request gets here.
        assert kind == "structured"
        cert = x509.load_pem_x509_certificate(answer["certificate"].encode())
        cert.verify_directly_issued_by(cluster_pki.ca.cert)
        assert pki.cert_common_name(cert) == answer["node_id"] == FUZZ_NODE
        assert store.latest_certificate(FUZZ_NODE) is not None
        assert not store.get_join_token(current["id"]).active
        outcomes["enrolled"] += 1

    try:
        check()
    finally:
        store.close()
    assert outcomes["refused"] + outcomes["enrolled"] >= 1000
    assert outcomes["refused"] > 0
    assert outcomes["enrolled"] > 0
    # the fuzz reached every layer: parsing, the token, the CSR
    assert {"bad_json", "bad_request"} <= set(codes)
    assert any(code.startswith("token_") for code in codes)
    assert any(code.startswith("csr_") for code in codes)


# --------------------------------------------------------------------------- only the control plane


def test_a_node_id_the_control_plane_answers_to_is_refused(
    env: Env, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A token for the control plane's own host name (minted before such ids were refused, or by
    an older version) gets no certificate: it would be a certificate for the control plane's
    name. Nothing is stored, the token stays unspent, the refusal is one log line."""
    _, server, _ = pki.ensure_server_identity(tmp_path / "cp", hosts=["cp-1.example"])
    names = pki.control_plane_names(pki.load_cert(server.cert))
    enroller = Enroller(
        env.store,
        env.ca,
        lifetime=LIFETIME,
        servers=lambda: list(SERVERS),
        control_plane_names=lambda: names,
    )
    secret = env.mint("cp-1.example")
    before = env.snapshot()
    with caplog.at_level(logging.WARNING, logger="llmgw.server.enroll"):
        with pytest.raises(EnrolmentError) as info:
            enroller.enrol(
                parse_enrol_request(json.dumps(request(secret, "cp-1.example")).encode())
            )
    assert (info.value.code, info.value.status) == ("node_id_reserved", 403)
    assert str(info.value) == (
        "invalid node id 'cp-1.example': the control plane answers to that name (it is in the "
        "control plane's TLS certificate), and a node under it could pose as the control plane; "
        "give this machine another node id (node_id in its agent.yaml, 'llmgw ctl join-command "
        "--node OTHER-ID'); this token cannot be used"
    )
    assert env.snapshot() == before
    (line,) = [r for r in caplog.records if r.getMessage() == "enrolment refused"]
    assert line.fields["code"] == "node_id_reserved"  # type: ignore[attr-defined]
    # the same enroller still enrols other nodes
    assert enroller.enrol(parse_enrol_request(json.dumps(request(env.mint())).encode()))


def register_instance(store: Store, instance_id: str, names: list[str]) -> None:
    """Another control-plane instance on the same database, answering to ``names``."""
    store.register_instance(instance_id, f"host/{instance_id}", stale_after=30, version="0.1.0")
    store.set_instance_addresses(
        instance_id,
        stream=f"{names[0]}:7443",
        http=f"https://{names[0]}:8080",
        enroll=f"{names[0]}:8443",
        ca_hash="sha256:" + "0" * 64,
        client_serial="",
        server_serial="",
        names=names,
    )


@pytest.mark.parametrize("rekey", [False, True], ids=["join", "rekey"])
def test_a_node_id_another_instance_answers_to_is_refused(env: Env, rekey: bool) -> None:
    """cp-2.example is the name of another instance on the database (registered after the
    token was minted): this instance's own names do not hold it, the registry does. A rekey
    of a node that took the name before the instance existed is refused as well."""
    old_key = pki.new_private_key()
    uid = None
    if rekey:
        first = env.mint("cp-2.example")
        joined = make_enroller(env).enrol(
            parse_enrol_request(json.dumps(request(first, "cp-2.example", key=old_key)).encode())
        )
        uid = joined["node_uid"]
    secret = (
        env.mint("cp-2.example", kind="rekey", node_uid=uid) if rekey else env.mint("cp-2.example")
    )
    register_instance(env.store, "cp2", ["cp-2", "cp-2.example"])
    body = (
        proved(secret, old_key, str(uid), "cp-2.example")
        if rekey
        else request(secret, "cp-2.example")
    )
    before = env.snapshot()
    with pytest.raises(EnrolmentError) as info:
        make_enroller(env).enrol(parse_enrol_request(json.dumps(body).encode()))
    assert (info.value.code, info.value.status) == ("node_id_reserved", 403)
    assert str(info.value) == (
        "invalid node id 'cp-2.example': control-plane instance cp2 answers to that name (it "
        "is in that instance's TLS certificate), and a node under it could pose as that "
        "instance; give this machine another node id (node_id in its agent.yaml, 'llmgw ctl "
        "join-command --node OTHER-ID'); this token cannot be used"
    )
    assert env.snapshot() == before
    # Once that instance is retired, its names are free again (its machine may become a node).
    with env.store.database.unfenced():
        env.store.database.execute("UPDATE instances SET retired_at = 1 WHERE id = 'cp2'")
    assert make_enroller(env).enrol(parse_enrol_request(json.dumps(body).encode()))


def test_a_csr_asking_for_the_control_plane_identity_is_refused(env: Env, cluster_pki: PKI) -> None:
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    key = pki.new_private_key()
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NODE)]))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(NODE)]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([pki.CONTROL_PLANE_OID]), critical=False)
        .sign(key, hashes.SHA256())
    )
    secret = env.mint()

    async def body(env: Env) -> None:
        before = env.snapshot()
        status, answer = await post(env, request(secret, key=key, csr=csr))
        assert (status, answer["error"]["code"]) == (400, "csr_forbidden_usage"), answer
        assert env.snapshot() == before

    serve(env, cluster_pki, body)


def test_record_certificate_keeps_serial_key_and_validity(env: Env, cluster_pki: PKI) -> None:
    key = pki.new_private_key()
    cert = pki.sign_csr(cluster_pki.ca, pki.make_csr(key, NODE), node_id=NODE, lifetime=LIFETIME)
    with env.store.transaction():
        env.store.upsert_node(
            NODE, dataplane_addr=None, agent_version=None, inventory={}, connected=False
        )
        row = record_certificate(env.store, NODE, cert)
    assert row.serial == format(cert.serial_number, "x")
    assert row.node_id == NODE
    assert row.fingerprint == pki.fingerprint(key.public_key())
    assert row.not_before == cert.not_valid_before_utc.timestamp()
    assert row.not_after == cert.not_valid_after_utc.timestamp()
    assert row.revoked_at is None
    assert env.store.list_certificates(NODE) == [row]


# --------------------------------------------------------------------------- auto-approve


def test_an_auto_approve_token_approves_the_node_on_first_use(env: Env, cluster_pki: PKI) -> None:
    secret = env.mint(auto_approve=True)
    key = pki.new_private_key()

    async def body(env: Env) -> None:
        status, answer = await post(env, request(secret, key=key))
        assert status == 200, answer
        fp = pki.fingerprint(key.public_key())
        assert answer["state"] == "approved" == env.store.get_node(NODE).state
        [token] = env.store.list_join_tokens(include_inactive=True)
        assert token.used and token.auto_approve and token.approved_fingerprint == fp
        approved, enrolled = env.store.list_events(subject=NODE)  # newest first
        assert enrolled.kind == "node_enrolled" and token.id in enrolled.message
        assert approved.kind == "node_approved"
        assert approved.actor == f"auto-approve:{token.id}"
        assert fp in approved.message and "trusted on first use" in approved.message
        assert env.enrolled[0].state == "approved"

    serve(env, cluster_pki, body)


def test_a_plain_join_token_still_leaves_the_node_pending(env: Env, cluster_pki: PKI) -> None:
    secret = env.mint()

    async def body(env: Env) -> None:
        status, answer = await post(env, request(secret))
        assert status == 200 and answer["state"] == "pending"
        [token] = env.store.list_join_tokens(include_inactive=True)
        assert not token.auto_approve and token.approved_fingerprint is None
        assert [e.kind for e in env.store.list_events(subject=NODE)] == ["node_enrolled"]

    serve(env, cluster_pki, body)


def test_a_refused_auto_approve_join_approves_nothing(env: Env, cluster_pki: PKI) -> None:
    """A CSR for another node id is refused: the token stays unspent, the node unmade."""
    secret = env.mint(auto_approve=True)
    before = env.snapshot()

    async def body(env: Env) -> None:
        status, answer = await post(env, request(secret, cn="other-node"))
        assert status == 400, answer
        assert env.snapshot() == before
        [token] = env.store.list_join_tokens()
        assert token.active and token.approved_fingerprint is None

    serve(env, cluster_pki, body)
