"""The login tables (llmgw.server.store.logins), on both engines: sessions by their token's
hash with their account as it is now, failure counters that lock at their limit within
their window, what the pruning deletes, and a lock seen by another instance's store."""

from __future__ import annotations

import pytest

from llmgw.errors import StoreError
from llmgw.server.store import Store, hash_session_token
from llmgw.server.store.location import Location
from tests.unit.clock import Clock


def _session(store: Store, token: str, operator_id: int, kind: str = "console", **kw: float) -> str:
    token_hash = hash_session_token(token)
    store.add_login_session(
        token_hash,
        operator_id,
        kind,
        csrf="c" if kind == "console" else "",
        now=kw.get("now", 1000.0),
        expires_at=kw.get("expires_at", 5000.0),
        addr="192.0.2.1",
        agent="x" * 500,
    )
    return token_hash


def test_a_session_is_found_by_its_hash_with_its_account(store: Store) -> None:
    bob = store.add_operator("bob", "viewer", "h", "token")
    token_hash = _session(store, "the-token", bob.id)
    assert token_hash == hash_session_token("the-token") != "the-token" and len(token_hash) == 64
    found = store.find_login_session(token_hash)
    assert found is not None
    assert (found.operator, found.role, found.active, found.kind) == (
        "bob",
        "viewer",
        True,
        "console",
    )
    assert (found.created_at, found.seen_at, found.expires_at) == (1000.0, 1000.0, 5000.0)
    assert len(found.agent) == 200 and token_hash not in repr(found)
    store.add_operator("carol", "admin", "h", "token")
    store.set_operator_role("bob", "admin")
    store.remove_operator("bob")
    gone = store.find_login_session(token_hash)
    assert gone is not None and (gone.role, gone.active) == ("admin", False)
    assert store.find_login_session(hash_session_token("another")) is None


def test_refusals(store: Store) -> None:
    bob = store.add_operator("bob", "viewer", "h", "token")
    with pytest.raises(ValueError, match="unknown login kind 'web'; use one of console, cli"):
        _session(store, "t", bob.id, kind="web")
    with pytest.raises(StoreError):  # no such account: the foreign key
        _session(store, "t", bob.id + 100)
    _session(store, "t", bob.id)
    with pytest.raises(StoreError):  # one token, one session
        _session(store, "t", bob.id)
    assert len(store.list_login_sessions()) == 1


def test_sessions_of_an_account_end_but_one(store: Store) -> None:
    bob = store.add_operator("bob", "viewer", "h", "token")
    carol = store.add_operator("carol", "admin", "h", "token")
    keep = _session(store, "b1", bob.id)
    _session(store, "b2", bob.id, kind="cli")
    _session(store, "c1", carol.id)
    assert store.delete_login_sessions_of(bob.id, keep=keep) == 1
    assert [s.token_hash for s in store.list_login_sessions(bob.id)] == [keep]
    assert store.delete_login_sessions_of(bob.id) == 1
    assert store.list_login_sessions(bob.id) == []
    assert [s.operator for s in store.list_login_sessions()] == ["carol"]
    assert store.delete_login_session(hash_session_token("c1"))
    assert not store.delete_login_session(hash_session_token("c1"))


def test_touch_and_prune_sessions(store: Store) -> None:
    bob = store.add_operator("bob", "viewer", "h", "token")
    _session(store, "idle", bob.id, now=1000.0, expires_at=9000.0)
    used = _session(store, "used", bob.id, now=1000.0, expires_at=9000.0)
    _session(store, "old", bob.id, now=1000.0, expires_at=2000.0)
    cli = _session(store, "cli", bob.id, kind="cli", now=1000.0, expires_at=9000.0)
    store.touch_login_session(used, 1500.0)
    found = store.find_login_session(used)
    assert found is not None and found.seen_at == 1500.0
    # At 2000: old's lifetime is over, idle's 1000 s unused (console idle), cli's not (3000).
    assert store.prune_login_sessions(2000.0, idle={"console": 1000.0, "cli": 3000.0}) == 2
    assert {s.token_hash for s in store.list_login_sessions()} == {used, cli}
    assert store.prune_login_sessions(2499.0, idle={"console": 1000.0, "cli": 3000.0}) == 0
    assert store.prune_login_sessions(4000.0, idle={"console": 1000.0, "cli": 3000.0}) == 2


def test_attempts_lock_at_the_limit_within_the_window(store: Store) -> None:
    count = store.count_login_attempt
    assert count("account:bob", 100.0, window=60, limit=3, lockout=500) == (100.0, False)
    assert count("account:bob", 110.0, window=60, limit=3, lockout=500) == (100.0, False)
    assert store.login_failures("account:bob") == 2
    # The window counts from the first attempt: at 160 a new count begins.
    assert count("account:bob", 160.0, window=60, limit=3, lockout=500) == (160.0, False)
    assert store.login_failures("account:bob") == 1
    assert not count("account:bob", 170.0, window=60, limit=3, lockout=500)[1]
    assert store.login_locked_until(["account:bob"], 170.0) is None
    assert count("account:bob", 180.0, window=60, limit=3, lockout=500) == (160.0, True)
    assert store.login_locked_until(["account:bob", "addr:x"], 180.0) == ("account:bob", 680.0)
    assert store.login_counter("account:bob") == (3, 160.0, 680.0)  # the count is kept
    assert store.login_locked_until(["account:bob"], 680.0) is None
    assert store.login_locked_until([], 180.0) is None
    # Once the lock has lifted, a new count begins.
    assert count("account:bob", 690.0, window=60, limit=3, lockout=500) == (690.0, False)
    assert store.login_counter("account:bob") == (1, 690.0, 0.0)
    # The longest lock of several is the one that says when to come back.
    count("addr:x", 300.0, window=60, limit=1, lockout=900)
    count("account:carol", 300.0, window=60, limit=1, lockout=500)
    assert store.login_locked_until(["account:carol", "addr:x"], 300.0) == ("addr:x", 1200.0)


def test_a_refund_takes_an_attempt_back_and_lifts_a_lock_failures_did_not_earn(
    store: Store,
) -> None:
    count = store.count_login_attempt
    began, _ = count("account:bob", 100.0, window=60, limit=3, lockout=500)
    count("account:bob", 101.0, window=60, limit=3, lockout=500)
    assert count("account:bob", 102.0, window=60, limit=3, lockout=500) == (100.0, True)
    # One of the three was a right password: two failures do not lock.
    assert store.refund_login_attempt("account:bob", began, limit=3)
    assert store.login_counter("account:bob") == (2, 100.0, 0.0)
    assert store.login_locked_until(["account:bob"], 103.0) is None
    # A refund without a lock takes the attempt back only; the last one deletes the row.
    assert not store.refund_login_attempt("account:bob", began, limit=3)
    assert store.login_failures("account:bob") == 1
    assert not store.refund_login_attempt("account:bob", began, limit=3)
    assert store.login_counter("account:bob") is None
    assert not store.refund_login_attempt("account:bob", began, limit=3)  # nothing left


def test_a_refund_leaves_a_later_count_and_an_earned_lock_alone(store: Store) -> None:
    count = store.count_login_attempt
    old, _ = count("account:bob", 100.0, window=60, limit=2, lockout=500)
    # The window passes while the first attempt's password is checked: a new count.
    assert count("account:bob", 170.0, window=60, limit=2, lockout=500) == (170.0, False)
    assert count("account:bob", 171.0, window=60, limit=2, lockout=500) == (170.0, True)
    assert not store.refund_login_attempt("account:bob", old, limit=2)
    assert store.login_counter("account:bob") == (2, 170.0, 671.0)
    # Three attempts where two lock: a refund of one leaves the two failures' lock.
    for at in (200.0, 201.0, 202.0):
        count("addr:x", at, window=60, limit=2, lockout=500)
    assert not store.refund_login_attempt("addr:x", 200.0, limit=2)
    assert store.login_locked_until(["addr:x"], 203.0) == ("addr:x", 701.0)


def test_prune_failures_keeps_locks_and_open_windows(store: Store) -> None:
    store.count_login_attempt("account:spent", 100.0, window=60, limit=5, lockout=500)
    store.count_login_attempt("account:open", 150.0, window=60, limit=5, lockout=500)
    store.count_login_attempt("account:locked", 100.0, window=60, limit=1, lockout=500)
    assert store.prune_login_failures(200.0, window=60) == 1
    assert store.login_failures("account:open") == 1
    assert store.login_locked_until(["account:locked"], 200.0) is not None
    assert store.prune_login_failures(600.0, window=60) == 2


def test_a_lock_counted_by_one_instance_holds_on_another(
    store: Store, db_location: Location, clock: Clock
) -> None:
    other = Store.open(db_location, clock=clock)
    try:
        for at in (100.0, 101.0):
            store.count_login_attempt("addr:192.0.2.7", at, window=60, limit=3, lockout=500)
        # The third attempt, counted by the other instance, adds to the first two.
        assert other.count_login_attempt(
            "addr:192.0.2.7", 102.0, window=60, limit=3, lockout=500
        ) == (100.0, True)
        assert store.login_locked_until(["addr:192.0.2.7"], 103.0) == ("addr:192.0.2.7", 602.0)
    finally:
        other.close()
