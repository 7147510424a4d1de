"""Tests for the stored credentials: API keys, join tokens (minted, listed, revoked, spent once) and the certificates issued to nodes."""

from __future__ import annotations

import hashlib
import sqlite3
import threading

import pytest

from llmgw.contracts.keypolicy import Budget, KeyPolicy
from llmgw.errors import Conflict, NotFound, StoreError, TokenError
from llmgw.server.store import (
    ApiKey,
    Certificate,
    JoinToken,
    Store,
    hash_api_key,
)
from llmgw.server.store.location import Location
from tests.unit.clock import Clock
from tests.unit.server.store.conftest import stored_bytes


def _consume(store: Store, secret: str, node_id: str = "gpu-1", **kw: object) -> JoinToken:
    kind = str(kw.pop("kind", "join"))
    node_uid = kw.pop("node_uid", None)
    assert node_uid is None or isinstance(node_uid, str)
    return store.consume_join_token(secret, node_id=node_id, kind=kind, node_uid=node_uid)


def _refusal(store: Store, secret: str, node_id: str = "gpu-1", **kw: object) -> TokenError:
    with pytest.raises(TokenError) as info:
        _consume(store, secret, node_id, **kw)
    assert info.value.status == 403
    return info.value


def test_api_key_lifecycle(store: Store, clock: Clock) -> None:
    key, secret = store.create_api_key("ci")
    assert isinstance(key, ApiKey)
    assert secret.startswith("sk-llmgw-") and len(secret) > 40
    assert key.name == "ci"
    assert key.prefix == secret[:12]
    assert key.hash == hash_api_key(secret)
    assert key.revoked_at is None and not key.revoked
    assert store.verify_api_key(secret) == key
    assert store.verify_api_key(secret + "x") is None
    assert store.active_key_hashes() == {key.hash}

    clock.advance(1)
    key2, secret2 = store.create_api_key("laptop")
    assert secret2 != secret and key2.id != key.id
    assert [k.id for k in store.list_api_keys()] == [key.id, key2.id]

    clock.advance(60)
    revoked = store.revoke_api_key(key.id)
    assert revoked.revoked and revoked.revoked_at == 1061.0
    assert store.verify_api_key(secret) is None
    assert store.active_key_hashes() == {key2.hash}
    assert [k.id for k in store.list_api_keys()] == [key2.id]
    assert [k.id for k in store.list_api_keys(include_revoked=True)] == [key.id, key2.id]

    # Revoke by prefix.
    store.revoke_api_key(key2.prefix)
    assert store.active_key_hashes() == set()


def test_api_key_secret_never_stored(store: Store, db_location: Location) -> None:
    secrets_made = [store.create_api_key(f"k{i}")[1] for i in range(5)]
    blob = stored_bytes(store, db_location)
    for secret in secrets_made:
        assert secret.encode() not in blob
        assert secret[12:].encode() not in blob  # not even the part after the prefix
        assert hash_api_key(secret).encode() in blob


def test_revoke_twice_conflict(store: Store) -> None:
    key, _ = store.create_api_key("ci")
    store.revoke_api_key(key.id)
    with pytest.raises(Conflict, match="already revoked") as info:
        store.revoke_api_key(key.id)
    assert "'llmgw ctl keys list'" in str(info.value)


def test_revoke_unknown_key(store: Store) -> None:
    with pytest.raises(NotFound, match="no API key with id, prefix or name nope"):
        store.revoke_api_key("nope")


def test_revoke_ambiguous_prefix(store: Store) -> None:
    k1, _ = store.create_api_key("a")
    k2, _ = store.create_api_key("b")
    k3, _ = store.create_api_key("c")
    # Force a prefix collision (3 random characters are in a prefix; collisions happen).
    store._db.execute("UPDATE api_keys SET prefix = ? WHERE id = ?", (k1.prefix, k2.id))
    with pytest.raises(
        Conflict, match=f"2 API keys have prefix {k1.prefix} \\({k1.id}, {k2.id}\\)"
    ):
        store.revoke_api_key(k1.prefix)
    with pytest.raises(Conflict, match="2 API keys have prefix"):
        store.get_api_key(k1.prefix)
    # Once one of them is revoked, the prefix names the other for revocation.
    store.revoke_api_key(k2.id)
    assert store.revoke_api_key(k1.prefix).id == k1.id
    with pytest.raises(Conflict, match="already revoked"):
        store.revoke_api_key(k1.id)
    assert store.get_api_key(k3.prefix).id == k3.id


POLICY = KeyPolicy(
    models=("llama", "qwen/7b"),
    rpm=60,
    tpm=200_000,
    max_concurrent=4,
    budget=Budget(10_000_000, "day"),
    priority="high",
    expires_at=5000.5,
)


def test_a_key_keeps_its_policy(store: Store, clock: Clock) -> None:
    plain, _ = store.create_api_key("plain")
    assert (plain.policy, plain.updated_at) == (KeyPolicy(), plain.created_at)
    clock.advance(1)
    key, secret = store.create_api_key("ci", POLICY)
    assert key.policy == POLICY and key.updated_at == key.created_at == clock.t
    assert store.get_api_key(key.id) == key
    assert store.verify_api_key(secret) == key
    assert store.active_api_keys() == [plain, key]
    assert [k.hash for k in store.active_api_keys()] == [plain.hash, key.hash]
    store.revoke_api_key(plain.id)
    assert store.active_api_keys() == [key]


def test_update_gives_a_key_a_new_policy(store: Store, clock: Clock) -> None:
    key, secret = store.create_api_key("ci")
    clock.advance(30)
    updated = store.update_api_key("ci", POLICY)
    assert (updated.id, updated.policy, updated.updated_at) == (key.id, POLICY, clock.t)
    assert updated.created_at == key.created_at and updated.hash == key.hash
    assert store.verify_api_key(secret) == updated
    clock.advance(1)
    cleared = store.update_api_key(key.prefix, KeyPolicy())
    assert cleared.policy == KeyPolicy() and cleared.updated_at == clock.t
    assert store.get_api_key(key.id).policy == KeyPolicy()


def test_update_of_a_revoked_key_is_refused_and_changes_nothing(store: Store) -> None:
    key, _ = store.create_api_key("ci")
    store.revoke_api_key(key.id)
    with pytest.raises(Conflict) as info:
        store.update_api_key(key.id, POLICY)
    assert str(info.value) == (
        f"API key {key.id} (ci) is revoked, and a revoked key stays revoked; create a new "
        "one instead ('llmgw ctl keys create ci')"
    )
    assert store.get_api_key(key.id).policy == KeyPolicy()
    with pytest.raises(NotFound, match="no API key with id, prefix or name nope"):
        store.update_api_key("nope", POLICY)


def test_the_schema_refuses_a_priority_it_does_not_know(store: Store) -> None:
    key, _ = store.create_api_key("ci")
    with pytest.raises(StoreError):
        store.update_api_key(key.id, KeyPolicy(priority="urgent"))
    with pytest.raises(StoreError):
        store.create_api_key("other", KeyPolicy(budget=Budget(10, "week")))
    assert store.get_api_key(key.id).policy == KeyPolicy()
    assert [k.name for k in store.list_api_keys()] == ["ci"]


def test_an_active_keys_name_is_not_given_to_a_new_key(store: Store) -> None:
    key, _ = store.create_api_key("ci")
    with pytest.raises(Conflict) as info:
        store.create_api_key("ci", POLICY)
    assert str(info.value) == (
        f"an active API key is named ci already ({key.id}); choose another name, or revoke "
        f"that key first ('llmgw ctl keys revoke {key.id}') if this one replaces it"
    )
    assert store.list_api_keys() == [key]
    store.revoke_api_key("ci")
    again, _ = store.create_api_key("ci")
    assert again.id != key.id
    assert store.get_api_key("ci") == again  # the active one, the revoked one beside it


def test_a_key_is_found_by_id_then_prefix_then_name(store: Store) -> None:
    ci, _ = store.create_api_key("ci")
    assert store.get_api_key("ci") == ci
    # A name that is another key's id or prefix names that key: ids and prefixes first.
    other, _ = store.create_api_key(ci.id)
    tricky, _ = store.create_api_key(ci.prefix)
    assert store.get_api_key(ci.id) == ci
    assert store.get_api_key(ci.prefix) == ci
    assert store.get_api_key(other.prefix) == other
    assert tricky.name == ci.prefix
    # A revoked key is still found by its name while no active key has it.
    store.revoke_api_key("ci")
    assert store.get_api_key("ci").id == ci.id


def test_a_name_several_keys_share_is_refused_with_their_ids(store: Store, clock: Clock) -> None:
    # Databases from before names were unique may hold two active keys of one name.
    k1, _ = store.create_api_key("ci")
    clock.advance(1)
    k2, _ = store.create_api_key("ci-2")
    with store.transaction():
        store.database.execute("UPDATE api_keys SET name = 'ci' WHERE id = ?", (k2.id,))
    for call in (
        lambda: store.get_api_key("ci"),
        lambda: store.update_api_key("ci", POLICY),
        lambda: store.revoke_api_key("ci"),
    ):
        with pytest.raises(Conflict) as info:
            call()
        assert str(info.value) == (
            f"2 active API keys are named ci ({k1.id}, {k2.id}); name the key by its id"
        )
    store.revoke_api_key(k1.id)
    assert store.get_api_key("ci").id == k2.id
    store.revoke_api_key(k2.id)
    with pytest.raises(Conflict, match=f"2 revoked API keys are named ci \\({k1.id}, {k2.id}\\)"):
        store.get_api_key("ci")


def test_create_stores_only_the_hash(store: Store, db_location: Location, clock: Clock) -> None:
    tok, secret = store.create_join_token("gpu-1", ttl=600)
    assert secret.startswith("llmgwjt_")
    assert len(secret) > 40
    assert tok.prefix == secret[:14]
    assert tok.hash == hashlib.sha256(secret.encode()).hexdigest()
    assert len(tok.id) == 8 and int(tok.id, 16) >= 0
    assert (tok.kind, tok.node_id, tok.node_uid, tok.require_approval) == (
        "join",
        "gpu-1",
        None,
        False,
    )
    assert tok.created_at == clock.t
    assert tok.expires_at == clock.t + 600
    assert tok.active and not tok.used and not tok.revoked and not tok.expired
    assert secret.encode() not in stored_bytes(store, db_location)


def test_create_validates(store: Store) -> None:
    with pytest.raises(ValueError, match="needs the node's uid"):
        store.create_join_token("gpu-1", kind="rekey", ttl=60)
    with pytest.raises(ValueError, match="rekey tokens only"):
        store.create_join_token("gpu-1", ttl=60, node_uid="abc")
    with pytest.raises(ValueError, match="not a join token kind"):
        store.create_join_token("gpu-1", kind="renew", ttl=60)
    for ttl in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ttl"):
            store.create_join_token("gpu-1", ttl=ttl)
    with pytest.raises(Exception, match="invalid node id"):
        store.create_join_token("Not_A_Node", ttl=60)
    assert store.list_join_tokens(include_inactive=True) == []


def test_rekey_token_fields(store: Store) -> None:
    tok, _ = store.create_join_token(
        "gpu-1", kind="rekey", ttl=60, node_uid="u" * 32, require_approval=True
    )
    assert (tok.kind, tok.node_uid, tok.require_approval) == ("rekey", "u" * 32, True)


def test_list_get_revoke(store: Store, clock: Clock) -> None:
    a, _ = store.create_join_token("gpu-1", ttl=10)
    clock.advance()
    b, b_secret = store.create_join_token("gpu-2", ttl=1000)
    clock.advance()
    c, _ = store.create_join_token("gpu-3", ttl=1000)
    assert [t.id for t in store.list_join_tokens()] == [a.id, b.id, c.id]
    assert store.get_join_token(b.id) == b
    assert store.get_join_token(b.prefix) == b
    with pytest.raises(NotFound, match="join-command"):
        store.get_join_token("nope")

    clock.advance(20)  # a expires
    _consume(store, b_secret, "gpu-2")
    revoked = store.revoke_join_token(c.id)
    assert revoked.revoked_at == clock.t and revoked.revoked and not revoked.active
    assert store.list_join_tokens() == []
    listed = store.list_join_tokens(include_inactive=True)
    assert [t.id for t in listed] == [a.id, b.id, c.id]
    assert [(t.expired, t.used, t.revoked) for t in listed] == [
        (True, False, False),
        (False, True, False),
        (False, False, True),
    ]

    with pytest.raises(Conflict, match="already revoked"):
        store.revoke_join_token(c.prefix)
    with pytest.raises(Conflict, match="already used"):
        store.revoke_join_token(b.id)
    assert store.revoke_join_token(a.id).revoked  # an expired token can still be revoked


def test_consume_marks_used(store: Store, clock: Clock) -> None:
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    clock.advance(5)
    used = _consume(store, secret)
    assert used.id == tok.id
    assert used.used_at == clock.t
    assert store.get_join_token(tok.id).used_at == clock.t


def test_token_unknown(store: Store) -> None:
    store.create_join_token("gpu-1", ttl=60)
    err = _refusal(store, "llmgwjt_not-a-real-token")
    assert err.code == "token_unknown"
    assert str(err) == "no such join token; mint one with 'llmgw ctl join-command --node gpu-1'"
    assert _refusal(store, "\ud800 lone surrogate").code == "token_unknown"


def test_token_expired(store: Store, clock: Clock) -> None:
    clock.t = 1_700_000_000.0
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    clock.advance(60)  # expiry is exclusive
    err = _refusal(store, secret)
    assert err.code == "token_expired"
    assert "expired at 2023-11-14 22:14:20 UTC (0s ago)" in str(err)
    assert "llmgw ctl join-command --node gpu-1" in str(err)
    clock.advance(3600)
    assert "(1h ago)" in str(_refusal(store, secret))
    assert store.get_join_token(tok.id).used_at is None


def test_token_used(store: Store) -> None:
    _, secret = store.create_join_token("gpu-1", ttl=60)
    _consume(store, secret)
    err = _refusal(store, secret)
    assert err.code == "token_used"
    assert "already used at" in str(err) and "works once" in str(err)
    assert "llmgw ctl join-command --node gpu-1" in str(err)


def test_token_revoked(store: Store) -> None:
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    store.revoke_join_token(tok.id)
    err = _refusal(store, secret)
    assert err.code == "token_revoked"
    assert f"join token {tok.id} for gpu-1 was revoked at" in str(err)
    assert "mint a new one" in str(err)


def test_token_wrong_node(store: Store) -> None:
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    err = _refusal(store, secret, "gpu-2")
    assert err.code == "token_wrong_node"
    assert "is for node gpu-1, not gpu-2" in str(err)
    assert "--node-id gpu-1" in str(err) and "join-command --node gpu-2" in str(err)
    assert store.get_join_token(tok.id).used_at is None


def test_token_wrong_kind_both_ways(store: Store) -> None:
    _, rekey = store.create_join_token("gpu-1", kind="rekey", ttl=60, node_uid="u1")
    err = _refusal(store, rekey, kind="join")
    assert err.code == "token_wrong_kind"
    assert str(err) == "this is a rekey token for gpu-1; run 'llmgw agent join --rekey'"

    _, join = store.create_join_token("gpu-1", ttl=60)
    err = _refusal(store, join, kind="rekey", node_uid="u1")
    assert err.code == "token_wrong_kind"
    assert str(err) == (
        "this is a join token for gpu-1, not a rekey token; run 'llmgw agent join' without --rekey"
    )


def test_node_uid_mismatch(store: Store) -> None:
    tok, secret = store.create_join_token("gpu-1", kind="rekey", ttl=60, node_uid="u1")
    err = _refusal(store, secret, kind="rekey", node_uid="u2")
    assert err.code == "node_uid_mismatch"
    assert "bound to gpu-1 with uid u1, but this node has uid u2" in str(err)
    assert "mint a new rekey token for gpu-1" in str(err)
    assert store.get_join_token(tok.id).used_at is None
    assert _consume(store, secret, kind="rekey", node_uid="u1").used


def test_consume_rolls_back_with_the_transaction(store: Store) -> None:
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    with pytest.raises(RuntimeError), store.transaction():
        _consume(store, secret)
        assert store.get_join_token(tok.id).used  # visible inside
        raise RuntimeError("a later step failed")
    assert store.get_join_token(tok.id).active
    assert _consume(store, secret).used


def test_consume_in_nested_savepoint_rolls_back(store: Store) -> None:
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    with store.transaction():
        with pytest.raises(RuntimeError), store.transaction():
            _consume(store, secret)
            raise RuntimeError("inner failure")
        assert store.get_join_token(tok.id).active
    assert store.get_join_token(tok.id).active


def _race(stores: list[Store], secret: str) -> list[str]:
    barrier = threading.Barrier(len(stores))
    results: list[str] = []
    lock = threading.Lock()

    def racer(s: Store) -> None:
        barrier.wait()
        try:
            with s.transaction():
                _consume(s, secret)
                outcome = "won"
        except TokenError as exc:
            outcome = exc.code
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=racer, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return sorted(results)


def test_racing_consumers_exactly_one_wins(db_location: Location) -> None:
    """Two connections to one database (two control planes), each consuming in its own
    transaction, released together."""
    for _round in range(5):
        stores = [Store.open(db_location), Store.open(db_location)]
        try:
            fresh, secret = stores[0].create_join_token("gpu-1", ttl=60)
            assert _race(stores, secret) == ["token_used", "won"]
            assert stores[1].get_join_token(fresh.id).used
        finally:
            for s in stores:
                s.close()


def test_conditional_update_decides_even_after_a_stale_read(sqlite_store: Store) -> None:
    """If the token is used between the read and the write, the UPDATE's rowcount refuses."""
    store = sqlite_store
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    original = store._db.conn  # type: ignore[attr-defined]

    class Sneaky:
        """A connection proxy that uses the token behind the consumer's back, once."""

        def __init__(self) -> None:
            self.done = False

        def execute(self, sql: str, params: tuple[object, ...] = ()) -> sqlite3.Cursor:
            if sql.startswith("UPDATE join_tokens SET used_at") and not self.done:
                self.done = True
                original.execute("UPDATE join_tokens SET used_at = 1 WHERE id = ?", (tok.id,))
            return original.execute(sql, params)

        def __getattr__(self, name: str) -> object:
            return getattr(original, name)

    store._db._conn = Sneaky()  # type: ignore[assignment]
    try:
        err = _refusal(store, secret)
    finally:
        store._db._conn = original
    assert err.code == "token_used"


def test_certificates_and_deny_list(store: Store, clock: Clock) -> None:
    a = store.add_certificate(
        "0ABC", node_id="gpu-1", fingerprint="sha256:aa", not_before=1.0, not_after=2.0
    )
    assert a == Certificate(
        serial="abc",
        node_id="gpu-1",
        fingerprint="sha256:aa",
        not_before=1.0,
        not_after=2.0,
        issued_at=clock.t,
        revoked_at=None,
        reason="",
    )
    clock.advance()
    b = store.add_certificate(
        "def", node_id="gpu-1", fingerprint="sha256:bb", not_before=1.0, not_after=3.0
    )
    clock.advance()
    c = store.add_certificate(
        "123", node_id="gpu-2", fingerprint="sha256:cc", not_before=1.0, not_after=3.0
    )
    assert store.latest_certificate("gpu-1") == b
    assert store.latest_certificate("gpu-9") is None
    assert [x.serial for x in store.list_certificates()] == ["abc", "def", "123"]
    assert store.list_certificates("gpu-2") == [c]
    with pytest.raises(Conflict, match="certificate with this serial already exists"):
        store.add_certificate(
            "abc", node_id="gpu-3", fingerprint="sha256:dd", not_before=1.0, not_after=2.0
        )
    with pytest.raises(ValueError, match="not a hex number"):
        store.add_certificate(
            "xyz", node_id="gpu-3", fingerprint="sha256:dd", not_before=1.0, not_after=2.0
        )

    assert store.revoked_serials() == set()
    clock.advance()
    assert store.revoke_certificates("gpu-1", reason="rekeyed", except_serial="DEF") == ["abc"]
    assert store.is_revoked("abc") and store.is_revoked("0abc")
    assert not store.is_revoked("def") and not store.is_revoked("ffff")
    assert store.latest_certificate("gpu-1") == b
    assert store.revoke_certificates("gpu-1", reason="revoked by operator") == ["def"]
    assert store.latest_certificate("gpu-1") is None
    assert store.revoke_certificates("gpu-1", reason="again") == []
    assert store.revoked_serials() == {"abc", "def"}
    revoked = store.list_certificates("gpu-1")
    assert [(x.revoked_at, x.reason) for x in revoked] == [
        (clock.t, "rekeyed"),
        (clock.t, "revoked by operator"),
    ]
    assert all(x.revoked for x in revoked)


def test_deleted_node_serials_stay_denied(store: Store) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:aa", rekey=False, node_uid=None, require_approval=False
    )
    store.add_certificate(
        "a1", node_id=node.id, fingerprint="sha256:aa", not_before=1.0, not_after=2.0
    )
    store.revoke_certificates(node.id, reason="revoked")
    store.delete_node(node.id)
    assert store.is_revoked("a1")
    assert store.revoked_serials() == {"a1"}


def test_an_auto_approve_token_keeps_the_key_it_approved_once(store: Store) -> None:
    token, secret = store.create_join_token("n1", ttl=60, auto_approve=True)
    assert token.auto_approve and token.approved_fingerprint is None
    store.consume_join_token(secret, node_id="n1", kind="join", node_uid=None)
    store.record_auto_approval(token.id, "sha256:aa")
    assert store.get_join_token(token.id).approved_fingerprint == "sha256:aa"
    with pytest.raises(Conflict, match="not an unspent auto-approve token"):
        store.record_auto_approval(token.id, "sha256:bb")  # never a second key
    assert store.get_join_token(token.id).approved_fingerprint == "sha256:aa"
    plain, _ = store.create_join_token("n2", ttl=60)
    with pytest.raises(Conflict, match="not an unspent auto-approve token"):
        store.record_auto_approval(plain.id, "sha256:aa")
    assert store.get_join_token(plain.id).approved_fingerprint is None
    with pytest.raises(ValueError, match="fresh join only"):
        store.create_join_token("n1", kind="rekey", node_uid="u", ttl=60, auto_approve=True)
