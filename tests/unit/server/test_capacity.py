"""Requests waiting for a model to have a ready replica at all: counted as demand, the
planner told at once, answered when one is ready, refused at once with why when none can be
placed, and gone from the count when they leave."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from llmgw.server.gateway.capacity import Capacity, Demand, NoRoom, fleet_demand
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.store import Store


def _run(test: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], None]:
    """The test on a loop of its own (the suite's async tests run their loop themselves)."""

    @functools.wraps(test)
    def run() -> None:
        asyncio.run(test())

    return run


def _capacity(queued: dict[str, int] | None = None) -> tuple[Router, Capacity, list[str]]:
    router = Router()
    capacity = Capacity(router, RequestHistory(), queued=lambda m: (queued or {}).get(m, 0))
    told: list[str] = []
    capacity.on_waiting(told.append)
    return router, capacity, told


def _ready(router: Router, model: str, shard: str = "s1") -> Endpoint:
    ep = Endpoint(model=model, replica_id=f"r-{shard}", shard_id=shard, node_id="n1", addr="a:1")
    router.set_ready(ep)
    return ep


@_run
async def test_a_waiting_request_is_demand_and_is_answered_when_a_replica_is_ready() -> None:
    router, capacity, told = _capacity()
    waiter = asyncio.create_task(capacity.wait("cold", 30))
    await asyncio.sleep(0)
    assert told == ["cold"]
    assert capacity.demand()["cold"] == Demand(waiting=1)
    _ready(router, "cold")
    assert await waiter is True
    assert capacity.waiting("cold") == 0
    assert "cold" not in capacity.demand()


@_run
async def test_no_room_answers_the_waiting_then_and_a_later_request_waits_again() -> None:
    router, capacity, told = _capacity()
    waiter = asyncio.create_task(capacity.wait("big", 300))
    await asyncio.sleep(0)
    capacity.refuse("big", "no node has 8 free GPUs")
    with pytest.raises(NoRoom, match="no node has 8 free GPUs"):
        await asyncio.wait_for(waiter, 1)
    assert capacity.waiting("big") == 0
    # Room may have come free since: a later request waits for the next pass's verdict.
    late = asyncio.create_task(capacity.wait("big", 300))
    await asyncio.sleep(0)
    assert capacity.waiting("big") == 1 and told == ["big", "big"]
    _ready(router, "big")
    assert await late is True


@_run
async def test_the_timeout_and_a_client_that_leaves_take_it_out_of_the_count() -> None:
    _, capacity, _ = _capacity()
    assert await capacity.wait("m", 0.01) is False
    gone = asyncio.create_task(capacity.wait("m", 30))
    await asyncio.sleep(0)
    assert capacity.waiting("m") == 1
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert capacity.waiting("m") == 0


@_run
async def test_a_ready_replica_needs_no_wait() -> None:
    router, capacity, told = _capacity()
    _ready(router, "warm")
    assert await capacity.wait("warm", 30) is True
    assert told == []


@_run
async def test_demand_sums_in_flight_queued_and_waiting() -> None:
    router, capacity, _ = _capacity(queued={"m": 4})
    a, b = _ready(router, "m", "s1"), _ready(router, "m", "s2")
    a.inflight, b.inflight = 3, 5
    assert capacity.demand()["m"] == Demand(inflight=8, queued=4)
    assert capacity.demand()["m"].total == 12
    both = Demand(1, 2, 3, 0.5) + Demand(4, 5, 6, 2.0)
    assert both == Demand(5, 7, 9, 2.0)
    assert both.describe() == "5 in flight + 7 queued + 9 waiting for a replica"


def test_the_ttft_p90_of_the_last_minute() -> None:
    now = [10_000.0]
    history = RequestHistory(clock=lambda: now[0])
    capacity = Capacity(Router(), history)
    for _ in range(9):
        history.record("m", ttft=0.1)
    history.record("m", ttft=5.0)
    history.record("m", ttft=5.0)
    p90 = capacity.demand()["m"].ttft_p90
    assert p90 is not None and 4.0 < p90 < 6.0
    now[0] += 120  # two minutes later: out of the window
    assert "m" not in capacity.demand()


def test_the_other_instances_demand_counts_while_fresh(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "state.db")
    try:
        store.put_demand("b", {"m": (2, 1, 0, 0.5), "n": (0, 0, 1, None)}, at=1000.0)
        store.put_demand("c", {"m": (3, 0, 0, 2.0)}, at=990.0)  # silent for 10 s: gone
        store.put_demand("a", {"m": (50, 0, 0, None)}, at=1000.0)  # this instance's own row
        own = {"m": Demand(inflight=1)}
        total = fleet_demand(own, store, "a", now=1001.0)
        assert total == {"m": Demand(3, 1, 0, 0.5), "n": Demand(0, 0, 1, None)}
        # Each write replaces what the instance said before.
        store.put_demand("b", {}, at=1001.0)
        assert fleet_demand({}, store, "a", now=1001.5) == {}
    finally:
        store.close()


# ------------------------------------------- tokens: a pool's prompts or outputs, per name


def test_tokens_per_pool_from_the_replicas_places_and_the_queue() -> None:
    """A prefill pool's tokens are its requests' prompts on its replicas and in its queue;
    a decode pool's their outputs; each name counted apart, taken back with the place."""
    from llmgw.server.common.metrics import Metrics
    from llmgw.server.gateway.queueing import Admission

    async def body() -> None:
        router = Router()
        prefill = _ready(router, "m#prefill", "p1")
        decode = _ready(router, "m#decode", "d1")
        admission = Admission(router, lambda _m: 1, Metrics())
        capacity = Capacity(
            router,
            RequestHistory(),
            queued=admission.depth,
            queued_tokens=admission.queued_tokens,
        )
        assert capacity.demand() == {}
        held = admission.try_acquire("m#prefill", tokens=8000)
        assert held is prefill and prefill.tokens == 8000
        # The pool's one place is taken: two prompts wait for it.
        waiting = [
            asyncio.create_task(
                admission.acquire("m#prefill", key, 1, frozenset(), 5, tokens=tokens)
            )
            for key, tokens in (("a", 6000), ("b", 100))
        ]
        await asyncio.sleep(0.01)
        on_decode = admission.try_acquire("m#decode", tokens=512)
        assert on_decode is decode
        demand = capacity.demand()
        assert demand["m#prefill"] == Demand(inflight=1, queued=2, tokens=14_100)
        assert demand["m#decode"] == Demand(inflight=1, tokens=512)
        # A waiter that leaves (its client gone) no longer counts.
        waiting[1].cancel()
        await asyncio.sleep(0.01)
        assert capacity.demand()["m#prefill"].tokens == 14_000
        # The place goes on to the next waiter with its tokens; the released ones are gone.
        admission.release(prefill, tokens=8000)
        assert await asyncio.wait_for(waiting[0], 1) is prefill
        assert prefill.tokens == 6000
        assert capacity.demand()["m#prefill"] == Demand(inflight=1, tokens=6000)
        admission.release(prefill, tokens=6000)
        admission.release(decode, tokens=512)
        assert capacity.demand() == {}

    asyncio.run(body())


def test_tokens_add_up_over_instances_and_in_the_fleets_demand(tmp_path: Path) -> None:
    assert Demand(1, 0, 0, None, 300) + Demand(2, 1, 0, None, 700) == Demand(3, 1, 0, None, 1000)
    store = Store.open(tmp_path / "state.db")
    try:
        store.put_demand("b", {"m#prefill": (1, 2, 0, None, 9000)}, at=1000.0)
        own = {"m#prefill": Demand(inflight=1, tokens=1000)}
        total = fleet_demand(own, store, "a", now=1001.0)
        assert total == {"m#prefill": Demand(2, 2, 0, None, 10_000)}
    finally:
        store.close()


def test_a_standby_publishes_its_tokens_for_the_leader(tmp_path: Path) -> None:
    async def body() -> None:
        router, capacity, _ = _capacity({"m#decode": 1})
        ep = _ready(router, "m#decode")
        ep.inflight, ep.tokens = 2, 700
        store = Store.open(tmp_path / "state.db")
        task = asyncio.create_task(capacity.publish(store, "standby"))
        try:
            await asyncio.sleep(0.05)  # its first write is at once
            (row,) = store.list_demand(since=0)
            assert (row.instance, row.model, row.inflight, row.queued, row.tokens) == (
                "standby",
                "m#decode",
                2,
                1,
                700,
            )
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            store.close()

    asyncio.run(body())
