"""Tests for the demand table: each gateway instance's demand per model, its tokens
included, replaced whole at each write and read since a moment (both engines)."""

from __future__ import annotations

import pytest

from llmgw.errors import StoreError
from llmgw.server.store import Store
from llmgw.server.store.demand import DemandRow


def test_the_rows_carry_their_tokens_and_replace_what_was_said(store: Store) -> None:
    store.put_demand(
        "cp2",
        {
            "m#prefill": (2, 3, 0, 0.5, 48_000),
            "m#decode": (4, 0, 0, None, 1024),
            "x": (1, 0, 0, None),
        },
        at=1000.0,
    )
    rows = store.list_demand(since=999.0, excluding="cp1")
    assert rows == [
        DemandRow("cp2", "m#decode", 4, 0, 0, None, 1000.0, 1024),
        DemandRow("cp2", "m#prefill", 2, 3, 0, 0.5, 1000.0, 48_000),
        DemandRow("cp2", "x", 1, 0, 0, None, 1000.0, 0),  # said without tokens: 0
    ]
    store.put_demand("cp2", {"m#prefill": (0, 0, 0, None, -5)}, at=1001.0)  # never below 0
    assert store.list_demand(since=1000.5) == [
        DemandRow("cp2", "m#prefill", 0, 0, 0, None, 1001.0, 0)
    ]
    assert store.list_demand(since=1000.5, excluding="cp2") == []


def test_the_database_refuses_negative_tokens(store: Store) -> None:
    # The writer clamps; the column's CHECK is the last line (PostgreSQL's and SQLite's alike).
    with pytest.raises(StoreError), store.database.unfenced(), store.database.write():
        store.database.execute(
            "INSERT INTO demand(instance, model, inflight, queued, waiting, ttft_p90, at, "
            "tokens) VALUES ('a', 'm', 0, 0, 0, NULL, 1.0, -1)"
        )
