"""Tests for the store's join tokens, certificate records and node enrolment (migration 2)."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from pathlib import Path

import pytest

from llmgw.errors import Conflict, NotFound, TokenError
from llmgw.server.store import MIGRATIONS, Certificate, JoinToken, Store
from tests.unit.clock import Clock


@pytest.fixture
def clock() -> Clock:
    # A 2023 date: messages name the expiry's date.
    return Clock(1_700_000_000.0)


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


# --------------------------------------------------------------------------- schema


def test_migration_2_tables(db_path: Path) -> None:
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS) >= 2
    conn = sqlite3.connect(db_path)
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    conn.close()
    assert {"join_tokens", "certificates"} <= tables
    assert "certificates_by_node" in indexes


def test_migration_2_upgrades_a_version_1_database(db_path: Path) -> None:
    conn = sqlite3.connect(db_path)
    conn.executescript(MIGRATIONS[0])
    conn.execute("INSERT INTO nodes(id, uid, created_at) VALUES ('old', 'u1', 1.0)")
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    with Store.open(db_path) as s:
        assert s.schema_version() == len(MIGRATIONS)
        assert s.get_node("old").uid == "u1"
        s.create_join_token("old", ttl=60)
        assert len(s.list_join_tokens()) == 1


def test_kind_is_checked_by_the_schema(store: Store) -> None:
    tok, _ = store.create_join_token("gpu-1", ttl=60)
    with pytest.raises(sqlite3.IntegrityError):
        store._db.execute("UPDATE join_tokens SET kind = 'other' WHERE id = ?", (tok.id,))


# --------------------------------------------------------------------------- tokens


def test_create_stores_only_the_hash(store: Store, db_path: Path, clock: Clock) -> None:
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
    raw = db_path.read_bytes() + (db_path.parent / "state.db-wal").read_bytes()
    assert secret.encode() not in raw


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


def test_racing_consumers_exactly_one_wins(db_path: Path) -> None:
    """Two connections to one file, each consuming in its own transaction, released together."""
    for _round in range(5):
        stores = [Store.open(db_path), Store.open(db_path)]
        try:
            fresh, secret = stores[0].create_join_token("gpu-1", ttl=60)
            assert _race(stores, secret) == ["token_used", "won"]
            assert stores[1].get_join_token(fresh.id).used
        finally:
            for s in stores:
                s.close()


def test_conditional_update_decides_even_after_a_stale_read(store: Store) -> None:
    """If the token is used between the read and the write, the UPDATE's rowcount refuses."""
    tok, secret = store.create_join_token("gpu-1", ttl=60)
    original = store._db

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

    store._conn = Sneaky()  # type: ignore[assignment]
    try:
        err = _refusal(store, secret)
    finally:
        store._conn = original
    assert err.code == "token_used"


# --------------------------------------------------------------------------- certificates


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


# --------------------------------------------------------------------------- enrol_node


def test_enrol_new_node_is_pending(store: Store, clock: Clock) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:aa", rekey=False, node_uid=None, require_approval=False
    )
    assert (node.id, node.state, node.fingerprint) == ("gpu-1", "pending", "sha256:aa")
    assert len(node.uid) == 32 and int(node.uid, 16) >= 0
    assert node.created_at == clock.t
    assert not node.connected


@pytest.mark.parametrize("old_state", ["approved", "revoked", "pending"])
def test_fresh_join_of_known_node_replaces_identity(store: Store, old_state: str) -> None:
    old = store.enrol_node(
        "gpu-1", fingerprint="sha256:old", rekey=False, node_uid=None, require_approval=False
    )
    store.set_node_state("gpu-1", old_state)
    store.add_certificate(
        "aa", node_id="gpu-1", fingerprint="sha256:old", not_before=1.0, not_after=2.0
    )
    new = store.enrol_node(
        "gpu-1", fingerprint="sha256:new", rekey=False, node_uid=None, require_approval=False
    )
    assert new.uid != old.uid
    assert (new.state, new.fingerprint, new.created_at) == ("pending", "sha256:new", old.created_at)
    assert store.is_revoked("aa")
    assert store.list_certificates("gpu-1")[0].reason == "replaced by a fresh join"


def test_rekey_keeps_uid_and_state(store: Store) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
    )
    store.set_node_state("gpu-1", "approved")
    again = store.enrol_node(
        "gpu-1", fingerprint="sha256:b", rekey=True, node_uid=node.uid, require_approval=False
    )
    assert (again.uid, again.state, again.fingerprint) == (node.uid, "approved", "sha256:b")
    pending = store.enrol_node(
        "gpu-1", fingerprint="sha256:c", rekey=True, node_uid=node.uid, require_approval=True
    )
    assert (pending.uid, pending.state, pending.fingerprint) == (node.uid, "pending", "sha256:c")


def test_rekey_refusals(store: Store) -> None:
    node = store.enrol_node(
        "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
    )
    with pytest.raises(TokenError) as info:
        store.enrol_node(
            "gpu-1", fingerprint="sha256:b", rekey=True, node_uid="other", require_approval=False
        )
    assert info.value.code == "node_uid_mismatch"
    assert f"node gpu-1 has uid {node.uid}, not other" in str(info.value)

    with pytest.raises(TokenError) as info:
        store.enrol_node(
            "gpu-9", fingerprint="sha256:b", rekey=True, node_uid="x", require_approval=False
        )
    assert info.value.code == "node_unknown"
    assert "join-command --node gpu-9" in str(info.value)

    store.set_node_state("gpu-1", "revoked")
    with pytest.raises(TokenError) as info:
        store.enrol_node(
            "gpu-1", fingerprint="sha256:b", rekey=True, node_uid=node.uid, require_approval=False
        )
    assert info.value.code == "node_revoked"
    assert "a revoked node can come back only through a fresh join" in str(info.value)
    assert store.get_node("gpu-1").fingerprint == "sha256:a"


def test_enrol_node_inside_a_failed_transaction_leaves_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError), store.transaction():
        store.enrol_node(
            "gpu-1", fingerprint="sha256:a", rekey=False, node_uid=None, require_approval=False
        )
        raise RuntimeError("signing failed")
    assert store.list_nodes() == []
