"""Places on replicas and the fair queues: max_concurrency per replica, waiting when all are
full, per-key weighted turns (and FIFO for comparison), timeouts, a client gone, new replicas."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.queueing import Admission, QueueTimeout
from llmgw.server.gateway.routing import Endpoint, Router

pytestmark = pytest.mark.timeout(30)


def rig(replicas: int = 1, limit: int = 2, fair: bool = True) -> tuple[Router, Admission, Metrics]:
    router = Router()
    for i in range(replicas):
        router.set_ready(Endpoint("m", f"r{i}", f"s{i}", f"n{i}", f"127.0.0.1:{9000 + i}"))
    metrics = Metrics()
    return router, Admission(router, lambda _m: limit, metrics, fair=fair), metrics


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(body())


def test_places_are_taken_least_busy_first_up_to_the_limit() -> None:
    async def body() -> None:
        router, adm, _ = rig(replicas=2, limit=2)
        eps = [adm.try_acquire("m") for _ in range(4)]
        assert all(ep is not None for ep in eps)
        assert sorted(ep.shard_id for ep in eps if ep) == ["s0", "s0", "s1", "s1"]
        assert adm.try_acquire("m") is None
        assert [ep.inflight for ep in router.endpoints("m")] == [2, 2]
        adm.release(eps[0])  # type: ignore[arg-type]
        again = adm.try_acquire("m")
        assert again is eps[0]

    run(body)


def test_a_full_model_queues_and_a_release_hands_the_place_on() -> None:
    async def body() -> None:
        _router, adm, metrics = rig(limit=1)
        first = await adm.acquire("m", "a", 2, frozenset(), 5)
        waiting = asyncio.create_task(adm.acquire("m", "b", 2, frozenset(), 5))
        await asyncio.sleep(0.01)
        assert adm.depth("m") == 1 and metrics.queued.values[("m",)] == 1
        assert not waiting.done()
        adm.release(first)
        ep = await asyncio.wait_for(waiting, 1)
        assert ep is first and ep.inflight == 1
        assert adm.depth("m") == 0 and metrics.queued.values[("m",)] == 0
        assert sum(metrics.queue_wait.counts[("m",)]) == 1

    run(body)


async def _drain_order(
    adm: Admission,
    ep: Endpoint,
    waiters: list[asyncio.Task[Endpoint]],
    names: dict[asyncio.Task[Endpoint], str],
) -> list[str]:
    order: list[str] = []
    pending = set(waiters)
    while pending:
        adm.release(ep)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        done = [t for t in pending if t.done()]
        assert len(done) == 1, "one release lets exactly one waiting request in"
        order.append(names[done[0]])
        pending -= set(done)
    return order


def test_fair_turns_serve_a_lone_request_behind_a_long_queue_within_a_few() -> None:
    async def body() -> None:
        _, adm, _ = rig(limit=1)
        ep = await adm.acquire("m", "a", 2, frozenset(), 5)
        names: dict[asyncio.Task[Endpoint], str] = {}
        tasks = []
        for i in range(10):
            t = asyncio.create_task(adm.acquire("m", "a", 2, frozenset(), 5))
            names[t] = f"a{i}"
            tasks.append(t)
            await asyncio.sleep(0)
        t = asyncio.create_task(adm.acquire("m", "b", 2, frozenset(), 5))
        names[t] = "b"
        tasks.append(t)
        await asyncio.sleep(0)
        order = await _drain_order(adm, ep, tasks, names)
        assert order[0] == "b", order  # a key with nothing waiting goes first
        assert [n for n in order if n != "b"] == [f"a{i}" for i in range(10)]  # a's own order

    run(body)


def test_fifo_serves_in_arrival_order() -> None:
    async def body() -> None:
        _, adm, _ = rig(limit=1, fair=False)
        ep = await adm.acquire("m", "a", 2, frozenset(), 5)
        names: dict[asyncio.Task[Endpoint], str] = {}
        tasks = []
        for name in [*(f"a{i}" for i in range(10)), "b"]:
            t = asyncio.create_task(adm.acquire("m", name[0], 2, frozenset(), 5))
            names[t] = name
            tasks.append(t)
            await asyncio.sleep(0)
        order = await _drain_order(adm, ep, tasks, names)
        assert order == [*(f"a{i}" for i in range(10)), "b"]

    run(body)


def test_priority_weights_share_the_places() -> None:
    async def body() -> None:
        _, adm, _ = rig(limit=1)
        ep = await adm.acquire("m", "x", 2, frozenset(), 5)
        names: dict[asyncio.Task[Endpoint], str] = {}
        tasks = []
        for _i in range(12):
            for key, weight in (("hi", 4), ("lo", 1)):
                t = asyncio.create_task(adm.acquire("m", key, weight, frozenset(), 5))
                names[t] = key
                tasks.append(t)
        await asyncio.sleep(0)
        order = await _drain_order(adm, ep, tasks, names)
        first = order[:10]
        assert first.count("hi") == 8 and first.count("lo") == 2, order

    run(body)


def test_a_request_that_waits_its_timeout_leaves_the_queue() -> None:
    async def body() -> None:
        _, adm, metrics = rig(limit=1)
        ep = await adm.acquire("m", "a", 2, frozenset(), 5)
        with pytest.raises(QueueTimeout) as caught:
            await adm.acquire("m", "b", 2, frozenset(), 0.05)
        assert caught.value.waited >= 0.05
        assert adm.depth("m") == 0 and metrics.queued.values[("m",)] == 0
        adm.release(ep)
        assert ep.inflight == 0

    run(body)


def test_a_cancelled_waiter_leaves_at_once_and_takes_no_place() -> None:
    async def body() -> None:
        _, adm, _ = rig(limit=1)
        ep = await adm.acquire("m", "a", 2, frozenset(), 5)
        gone = asyncio.create_task(adm.acquire("m", "b", 2, frozenset(), 5))
        later = asyncio.create_task(adm.acquire("m", "c", 2, frozenset(), 5))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0)
        assert adm.depth("m") == 1
        adm.release(ep)
        assert await asyncio.wait_for(later, 1) is ep
        assert ep.inflight == 1

    run(body)


def test_a_place_granted_as_the_waiter_is_cancelled_is_given_back() -> None:
    async def body() -> None:
        _, adm, _ = rig(limit=1)
        ep = await adm.acquire("m", "a", 2, frozenset(), 5)
        waiter = asyncio.create_task(adm.acquire("m", "b", 2, frozenset(), 5))
        await asyncio.sleep(0.01)
        adm.release(ep)  # granted to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert ep.inflight == 0

    run(body)


def test_a_new_replica_takes_waiting_requests() -> None:
    async def body() -> None:
        router, adm, _ = rig(limit=1)
        await adm.acquire("m", "a", 2, frozenset(), 5)
        waiting = asyncio.create_task(adm.acquire("m", "b", 2, frozenset(), 5))
        await asyncio.sleep(0.01)
        router.set_ready(Endpoint("m", "r9", "s9", "n9", "127.0.0.1:9009"))
        ep = await asyncio.wait_for(waiting, 1)
        assert ep.shard_id == "s9"

    run(body)


def test_a_retiring_admission_still_hears_of_new_replicas_until_it_closes() -> None:
    """After a role change the new gateway's admission shares the router; the requests still
    queued in the retiring one must still get the replicas that become ready."""

    async def body() -> None:
        router, old, _ = rig(limit=1)
        await old.acquire("m", "a", 2, frozenset(), 5)
        waiting = asyncio.create_task(old.acquire("m", "b", 2, frozenset(), 5))
        await asyncio.sleep(0.01)
        new = Admission(router, lambda _m: 1, Metrics())
        router.set_ready(Endpoint("m", "r9", "s9", "n9", "127.0.0.1:9009"))
        ep = await asyncio.wait_for(waiting, 1)
        assert ep.shard_id == "s9"
        # Closed: the old one hears no more; the new one still does.
        old.close()
        queued_old = asyncio.create_task(old.acquire("m", "c", 2, frozenset(), 0.2))
        queued_new = asyncio.create_task(new.acquire("m", "e", 2, frozenset(), 5))
        await asyncio.sleep(0.01)
        router.set_ready(Endpoint("m", "r8", "s8", "n8", "127.0.0.1:9008"))
        assert (await asyncio.wait_for(queued_new, 1)).shard_id == "s8"
        with pytest.raises(QueueTimeout):
            await queued_old

    run(body)


def test_an_excluded_replica_is_not_given() -> None:
    async def body() -> None:
        _, adm, _ = rig(replicas=2, limit=1)
        assert adm.try_acquire("m", frozenset({"s0"})).shard_id == "s1"  # type: ignore[union-attr]
        assert adm.try_acquire("m", frozenset({"s0"})) is None

    run(body)


def test_a_zero_queue_timeout_refuses_at_once_when_full() -> None:
    async def body() -> None:
        _, adm, _ = rig(limit=1)
        await adm.acquire("m", "a", 2, frozenset(), 5)
        with pytest.raises(QueueTimeout):
            await adm.acquire("m", "b", 2, frozenset(), 0)
        assert adm.depth("m") == 0

    run(body)
