"""llmgw.server.ha.kvrelay: the leader's KV events reach a standby's router (the whole index
first, then each batch), a wrong token is refused, a standby that falls behind is cut off and
sent everything again, and a leader change ends the stream."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.ha import kvrelay
from llmgw.server.ha.kvrelay import RELAY_PATH, KvFollower, KvRelay, frame

TOKEN = "admin-secret"


def _router(*shards: tuple[str, str]) -> Router:
    router = Router()
    for shard_id, node_id in shards:
        router.set_ready(Endpoint("m", f"r-{shard_id}", shard_id, node_id, f"{node_id}:1"))
    return router


def _held(router: Router, shard_id: str) -> set[int]:
    index = router.prefixes.events.get("m")
    return set() if index is None else set(index.held.get(shard_id, ()))


async def _until(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _with_relay(
    test: Callable[[Router, KvRelay, str], Awaitable[None]], *, token: str = TOKEN
) -> None:
    async def go() -> None:
        leader = _router(("s1", "n1"), ("s2", "n2"))
        relay = KvRelay(leader, lambda: token)
        app = web.Application()
        relay.add_routes(app)
        async with TestServer(app) as server:
            await test(leader, relay, str(server.make_url("")))
            relay.close()

    asyncio.run(go())


def _follow(standby: Router, url: Callable[[], str], token: str = TOKEN) -> KvFollower:
    return KvFollower(standby, url, token=lambda: token, retry=0.05)


def test_the_index_then_each_batch_reach_the_standby() -> None:
    async def test(leader: Router, relay: KvRelay, url: str) -> None:
        # What the leader held before the standby came: sent as its snapshot.
        leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[1, 2, 3]))
        # A message from the wrong node is refused by the leader and relayed to no one.
        assert leader.kv_events("n2", pb.KvEvents(shard_id="s1", block_size=16, stored=[9])) is None
        standby = _router(("s1", "n1"))  # s2 not known here yet: indexed all the same
        standby.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[77]))
        follower = _follow(standby, lambda: url)
        task = asyncio.create_task(follower.run())
        await _until(lambda: follower.connections == 1, "the snapshot")
        await _until(lambda: _held(standby, "s1") == {1, 2, 3}, "s1's blocks")  # 77 cleared
        leader.kv_events("n2", pb.KvEvents(shard_id="s2", block_size=16, stored=[5, 6]))
        leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, removed=[2]))
        await _until(lambda: _held(standby, "s2") == {5, 6}, "s2's blocks")
        await _until(lambda: _held(standby, "s1") == {1, 3}, "s1's removal")
        assert relay.relayed == 2
        assert standby.prefixes.has_events("m")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    _with_relay(test)


def test_a_wrong_token_is_refused_and_nothing_is_applied() -> None:
    async def test(leader: Router, relay: KvRelay, url: str) -> None:
        leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[1]))
        standby = _router(("s1", "n1"))
        follower = _follow(standby, lambda: url, token="guess")
        task = asyncio.create_task(follower.run())
        await _until(lambda: "401" in follower._last_problem, "the refusal")
        assert "admin token" in follower._last_problem
        assert follower.connections == 0 and not standby.prefixes.events
        assert not relay.subscribers
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    _with_relay(test)


def test_a_relay_without_a_token_refuses_everyone() -> None:
    async def test(leader: Router, relay: KvRelay, url: str) -> None:
        follower = _follow(_router(), lambda: url, token="")
        task = asyncio.create_task(follower.run())
        await _until(lambda: "401" in follower._last_problem, "the refusal")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    _with_relay(test, token="")


def test_a_standby_behind_is_cut_off_and_sent_everything_again() -> None:
    async def test(leader: Router, relay: KvRelay, url: str) -> None:
        standby = _router()
        follower = _follow(standby, lambda: url)
        task = asyncio.create_task(follower.run())
        await _until(lambda: len(relay.subscribers) == 1, "the subscription")
        await _until(lambda: follower.connections == 1, "the first snapshot")
        # More batches in one step of the loop than a subscriber may queue.
        for key in range(1, kvrelay.MAX_QUEUED + 10):
            leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[key]))
        await _until(lambda: follower.connections == 2, "the second snapshot")
        # Whatever was dropped, the snapshot had it all.
        await _until(lambda: len(_held(standby, "s1")) == kvrelay.MAX_QUEUED + 9, "every block")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    _with_relay(test)


def test_a_leader_change_ends_the_stream_and_the_next_leader_is_dialled() -> None:
    async def test(leader: Router, relay: KvRelay, url: str) -> None:
        where = [url]
        standby = _router()
        follower = _follow(standby, lambda: where[0])
        task = asyncio.create_task(follower.run())
        await _until(lambda: follower.connections == 1, "the first snapshot")
        where[0] = ""  # no instance leads: the stream ends at its next frame
        leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[4]))
        await _until(lambda: follower._last_problem == "another instance leads now", "the end")
        await _until(lambda: not relay.subscribers, "the leader's side closed")
        where[0] = url
        await _until(lambda: follower.connections == 2, "the new leader's snapshot")
        assert _held(standby, "s1") == {4}
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    _with_relay(test)


def test_closing_the_relay_ends_every_stream() -> None:
    async def test(leader: Router, relay: KvRelay, url: str) -> None:
        follower = _follow(_router(), lambda: url)
        task = asyncio.create_task(follower.run())
        await _until(lambda: follower.connections == 1, "the snapshot")
        relay.close()
        await _until(lambda: not relay.subscribers, "the stream's end")
        assert leader.on_kv_events is None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    _with_relay(test)


def test_an_oversized_frame_ends_the_stream() -> None:
    async def go() -> None:
        async def handle(request: web.Request) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": kvrelay.CONTENT_TYPE})
            await out.prepare(request)
            await out.write((kvrelay.MAX_FRAME + 1).to_bytes(4, "big"))
            await asyncio.sleep(5)
            return out

        app = web.Application()
        app.router.add_get(RELAY_PATH, handle)
        async with TestServer(app) as server:
            follower = _follow(_router(), lambda: str(server.make_url("")))
            task = asyncio.create_task(follower.run())
            await _until(lambda: "over" in follower._last_problem, "the refusal")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(go())


def test_a_frame_is_its_length_then_the_message() -> None:
    msg = pb.KvRelayed(node_id="n", model="m", events=pb.KvEvents(shard_id="s", stored=[1]))
    data = frame(msg)
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    assert pb.KvRelayed.FromString(data[4:]) == msg


def _sample(metrics: Metrics, name: str) -> float | None:
    for line in metrics.render().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_metrics_count_frames_standbys_and_cut_offs() -> None:
    """/metrics: frames sent (the leader) and applied (the standby), standbys following now,
    standbys cut off for lagging."""

    async def go() -> None:
        leader = _router(("s1", "n1"))
        leader_metrics, standby_metrics = Metrics(), Metrics()
        relay = KvRelay(leader, lambda: TOKEN, leader_metrics)
        app = web.Application()
        relay.add_routes(app)
        assert _sample(leader_metrics, "llmgw_kv_relay_standbys") == 0
        assert _sample(leader_metrics, "llmgw_kv_relay_cut_off_total") == 0
        async with TestServer(app) as server:
            leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[1]))
            url = str(server.make_url(""))
            follower = KvFollower(
                _router(), lambda: url, token=lambda: TOKEN, retry=0.05, metrics=standby_metrics
            )
            task = asyncio.create_task(follower.run())
            await _until(lambda: follower.connections == 1, "the snapshot")
            assert _sample(leader_metrics, "llmgw_kv_relay_standbys") == 1
            leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[2]))
            await _until(lambda: follower.applied == 2, "snapshot and batch applied")
            sent = 'llmgw_kv_relay_frames_total{side="sent"}'
            applied = 'llmgw_kv_relay_frames_total{side="applied"}'
            assert _sample(leader_metrics, sent) == 2  # the snapshot's one message, one batch
            assert _sample(standby_metrics, applied) == 2
            assert _sample(standby_metrics, sent) is None
            for key in range(3, kvrelay.MAX_QUEUED + 10):
                leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=[key]))
            await _until(lambda: follower.connections == 2, "the second snapshot")
            assert _sample(leader_metrics, "llmgw_kv_relay_cut_off_total") == 1
            assert relay.cut_off == 1
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await _until(lambda: not relay.subscribers, "the stream's end")
            assert _sample(leader_metrics, "llmgw_kv_relay_standbys") == 0
            relay.close()

    asyncio.run(go())


def test_the_standby_lets_other_work_run_between_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot arrives as many frames in one read; applying them all in one step of the
    loop held up every request the standby routes meanwhile."""
    monkeypatch.setattr(kvrelay, "SNAPSHOT_CHUNK", 1)

    async def test(leader: Router, relay: KvRelay, url: str) -> None:
        leader.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=16, stored=range(1, 41)))
        ticks = 0

        async def ticking() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        standby = _router()
        seen: list[int] = []
        apply = standby.kv_relayed

        def recording(msg: pb.KvRelayed) -> None:
            seen.append(ticks)
            apply(msg)

        monkeypatch.setattr(standby, "kv_relayed", recording)
        ticker = asyncio.create_task(ticking())
        follower = _follow(standby, lambda: url)
        task = asyncio.create_task(follower.run())
        try:
            await _until(lambda: len(_held(standby, "s1")) == 40, "the snapshot applied")
        finally:
            for t in (task, ticker):
                t.cancel()
            await asyncio.gather(task, ticker, return_exceptions=True)
            relay.close()
        assert len(seen) == 40
        assert all(b > a for a, b in itertools.pairwise(seen)), seen

    _with_relay(test)
