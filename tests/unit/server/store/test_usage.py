"""Tests for the stored usage of API keys: counts added up (within a batch and across
flushes), written by any instance (not fenced), read back by key, model and day with the
key's name, the tokens a budget is checked against; a bad row adds nothing. On both engines."""

from __future__ import annotations

import pytest

from llmgw.contracts.keypolicy import UsageRow
from llmgw.errors import Fenced
from llmgw.server.store import Store


def _counts(rows: list[UsageRow]) -> list[tuple[object, ...]]:
    return [
        (
            r.day,
            r.key_name,
            r.model,
            r.requests,
            r.prompt_tokens,
            r.completion_tokens,
            r.cached_tokens,
            r.errors,
        )
        for r in rows
    ]


def test_counts_add_up_across_flushes_and_within_one(store: Store) -> None:
    ci, _ = store.create_api_key("ci")
    store.add_usage([UsageRow("2026-12-01", ci.id, "llama", 2, 100, 40, 10, 1)])
    store.add_usage(
        [
            UsageRow("2026-12-01", ci.id, "llama", 1, 5, 6, 0, 0),
            UsageRow("2026-12-01", ci.id, "llama", 1, 1, 1, 1, 1),  # the same row again
            UsageRow("2026-12-01", ci.id, "qwen", 1, 7, 8),
        ]
    )
    assert _counts(store.list_usage()) == [
        ("2026-12-01", "ci", "llama", 4, 106, 47, 11, 2),
        ("2026-12-01", "ci", "qwen", 1, 7, 8, 0, 0),
    ]
    assert store.list_usage()[0].key_id == ci.id


def test_rows_are_read_by_key_model_and_days_with_the_keys_name(store: Store) -> None:
    ci, _ = store.create_api_key("ci")
    lab, _ = store.create_api_key("lab")
    store.add_usage(
        [
            UsageRow("2026-11-30", lab.id, "llama", 1, 1, 1),
            UsageRow("2026-12-01", ci.id, "llama", 2, 2, 2),
            UsageRow("2026-12-01", lab.id, "llama", 3, 3, 3),
            UsageRow("2026-12-02", ci.id, "qwen", 4, 4, 4),
            UsageRow("2026-12-02", "gone", "qwen", 5, 5, 5),  # a key the table lacks
        ]
    )
    days = [(r.day, r.key_name or r.key_id, r.model) for r in store.list_usage()]
    assert days == [
        ("2026-11-30", "lab", "llama"),
        ("2026-12-01", "ci", "llama"),
        ("2026-12-01", "lab", "llama"),
        ("2026-12-02", "gone", "qwen"),  # no name: sorted first, its id shown
        ("2026-12-02", "ci", "qwen"),
    ]
    assert [r.requests for r in store.list_usage(key_id=ci.id)] == [2, 4]
    assert [r.requests for r in store.list_usage(model="llama")] == [1, 2, 3]
    assert [r.requests for r in store.list_usage(since_day="2026-12-01")] == [2, 3, 5, 4]
    assert [r.requests for r in store.list_usage(until_day="2026-12-01")] == [1, 2, 3]
    assert [
        r.requests
        for r in store.list_usage(
            key_id=lab.id, model="llama", since_day="2026-12-01", until_day="2026-12-01"
        )
    ] == [3]
    assert store.list_usage(key_id="nobody") == []


def test_tokens_since_sums_prompt_and_completion_per_key(store: Store) -> None:
    store.add_usage(
        [
            UsageRow("2026-11-30", "k1", "llama", 1, 1000, 1000, 500),
            UsageRow("2026-12-01", "k1", "llama", 1, 10, 20, 5),
            UsageRow("2026-12-01", "k1", "qwen", 1, 1, 2),
            UsageRow("2026-12-02", "k2", "qwen", 1, 3, 4, errors=1),
        ]
    )
    assert store.tokens_since("2026-12-01") == {"k1": 33, "k2": 7}
    assert store.tokens_since("2026-11-01") == {"k1": 2033, "k2": 7}
    assert store.tokens_since("2027-01-01") == {}
    assert store.tokens_since("2026-11-01", ["k2", "nobody"]) == {"k2": 7}
    assert store.tokens_since("2026-11-01", []) == {}


def test_counts_as_large_as_a_budget_may_be(store: Store) -> None:
    big = 10**15
    store.add_usage([UsageRow("2026-12-01", "k1", "llama", 1, big, big)])
    store.add_usage([UsageRow("2026-12-01", "k1", "llama", 1, big, big)])
    assert store.tokens_since("2026-12-01") == {"k1": 4 * big}
    assert store.list_usage()[0].prompt_tokens == 2 * big


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (UsageRow("2026-12-1", "k1", "m"), "a usage day is YYYY-MM-DD"),
        (UsageRow("2026-12-01", "k1", "m", requests=-1), "0 or more"),
        (UsageRow("2026-12-01", "k1", "m", prompt_tokens=1.5), "whole numbers"),  # type: ignore[arg-type]
        (UsageRow("2026-12-01", "", "m"), "needs its key id and its model"),
        (UsageRow("2026-12-01", "k1", ""), "needs its key id and its model"),
    ],
)
def test_a_bad_row_adds_nothing_of_its_batch(store: Store, row: UsageRow, message: str) -> None:
    good = UsageRow("2026-12-01", "k1", "llama", 1, 1, 1)
    with pytest.raises(ValueError, match=message):
        store.add_usage([good, row])
    assert store.list_usage() == []


def test_a_bad_day_to_read_by_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        store.list_usage(since_day="yesterday")
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        store.tokens_since("2026-12-01'; --")


def test_nothing_to_add_writes_nothing(store: Store) -> None:
    def refuse(_db: object) -> None:
        raise AssertionError("no write expected")

    store.database.fence = refuse
    store.add_usage([])
    store.add_usage(iter(()))
    store.database.fence = None


def test_usage_is_added_by_an_instance_that_does_not_lead(store: Store) -> None:
    # A standby (or a replaced leader) counts what its own gateway served: its flush is
    # not fenced, when its other writes are.
    def deposed(_db: object) -> None:
        raise Fenced("this instance no longer leads")

    store.database.fence = deposed
    with pytest.raises(Fenced):
        store.create_api_key("ci")
    store.add_usage([UsageRow("2026-12-01", "k1", "llama", 1, 2, 3)])
    store.database.fence = None
    assert store.tokens_since("2026-12-01") == {"k1": 5}
    assert store.list_api_keys() == []
