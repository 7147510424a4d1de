"""Tests for the node_updates table on both engines: a node's update counter only grows,
and its order's bytes come back as they went in."""

from __future__ import annotations

import pytest

from llmgw.errors import Conflict
from llmgw.server.store import Store

ORDER = b'{"counter":2}\x00\xff'


def test_the_counter_grows_by_one_per_reservation_and_outlives_the_order(store: Store) -> None:
    assert [store.next_update_counter("gpu1") for _ in range(3)] == [1, 2, 3]
    assert store.next_update_counter("gpu2") == 1
    assert store.get_update("gpu1") is None  # reserved counters, no order yet
    stored = store.put_update(
        "gpu1",
        counter=3,
        version="0.9.1",
        state="sent",
        message="",
        op_id="op-1",
        order=ORDER,
        signature=b"\x00sig",
        expires=2000.0,
    )
    assert (stored.counter, stored.order, stored.signature) == (3, ORDER, b"\x00sig")
    assert store.next_update_counter("gpu1") == 4


def test_an_order_with_a_counter_no_longer_the_latest_is_refused(store: Store) -> None:
    old = store.next_update_counter("gpu1")
    store.next_update_counter("gpu1")
    with pytest.raises(Conflict) as info:
        store.put_update(
            "gpu1",
            counter=old,
            version="0.9.1",
            state="sent",
            message="",
            op_id="op-1",
            order=ORDER,
            signature=b"s",
            expires=2000.0,
        )
    assert str(info.value) == (
        "update counter 1 of node gpu1 is no longer the latest; order the update again"
    )
    assert store.get_update("gpu1") is None
