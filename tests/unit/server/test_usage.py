"""The usage book: added up in memory, flushed as additions in one write, kept when the
store refuses, and the budgets' totals read back at each flush."""

from __future__ import annotations

import calendar

import pytest

from llmgw.contracts.keypolicy import Budget, KeyPolicy, UsageRow
from llmgw.errors import StoreUnavailable
from llmgw.server.gateway.limits import Grant, KeyLimits
from llmgw.server.gateway.usage import UsageBook
from llmgw.server.store.rows import ApiKey
from tests.unit.clock import Clock
from tests.unit.server.fakes import FakeStore

NOON = calendar.timegm((2026, 12, 2, 12, 0, 0))


def test_requests_add_up_per_key_model_and_day_and_flush_in_one_write() -> None:
    store, wall = FakeStore(), Clock(NOON)
    book = UsageBook(store, wall=wall)
    book.record("k1", "alice", "m", prompt=10, completion=5, cached=4)
    book.record("k1", "alice", "m", prompt=1, completion=1, error=True)
    book.record("k2", "bob", "m", prompt=7)
    wall.t += 86400  # the next UTC day: a row of its own
    book.record("k1", "alice", "m", prompt=3)
    assert {(r.day, r.key_id, r.requests) for r in book.pending()} == {
        ("2026-12-02", "k1", 2),
        ("2026-12-02", "k2", 1),
        ("2026-12-03", "k1", 1),
    }
    assert book.flush() == 3 and store.writes == 1
    row = store.rows[("2026-12-02", "k1", "m")]
    assert (row.requests, row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (
        2,
        11,
        6,
        4,
    )
    assert row.errors == 1
    assert book.pending() == []
    book.record("k1", "alice", "m", prompt=1)
    book.flush()
    assert store.rows[("2026-12-03", "k1", "m")].requests == 2  # added to, not replaced


def test_a_refused_flush_keeps_the_counts_for_the_next() -> None:
    store = FakeStore()
    book = UsageBook(store, wall=Clock(NOON))
    book.record("k1", "alice", "m", prompt=10)
    store.fail = True
    with pytest.raises(StoreUnavailable):
        book.flush()
    book.record("k1", "alice", "m", prompt=5)
    store.fail = False
    book.flush()
    row = store.rows[("2026-12-02", "k1", "m")]
    assert (row.requests, row.prompt_tokens) == (2, 15)


def test_each_flush_refreshes_the_budgets_from_every_instances_counts() -> None:
    store, wall = FakeStore(), Clock(NOON)
    limits = KeyLimits(wall=wall, budget_spent=lambda k, since: store.tokens_since(since).get(k, 0))
    book = UsageBook(store, limits, wall=wall)
    key = ApiKey(
        id="k1",
        name="alice",
        prefix="p",
        hash="h",
        created_at=0.0,
        revoked_at=None,
        policy=KeyPolicy(budget=Budget(100, "day")),
    )
    grant = limits.admit(key, 1)
    assert isinstance(grant, Grant)
    grant.settle(30, 0.0)
    book.record("k1", "alice", "m", prompt=20, completion=10)
    # Another instance stored 50 of the same key's tokens meanwhile.
    store.add_usage([UsageRow("2026-12-02", "k1", "m", requests=1, prompt_tokens=50)])
    book.flush()
    state = limits.states["k1"]
    assert (state.budget_base, state.unconfirmed) == (80, 0)
    grant = limits.admit(key, 1)
    assert isinstance(grant, Grant)
    grant.settle(20, 0.0)
    assert not isinstance(limits.admit(key, 1), Grant)  # 80 + 20 = 100: spent
