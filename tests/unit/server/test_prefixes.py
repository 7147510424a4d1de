"""Cache-aware routing's choice (llmgw.server.gateway.prefixes): the block index, the events that
fill it, each policy's pick, and how load spreads a hot prefix."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.contracts.kvblocks import block_keys
from llmgw.proto import control_pb2 as pb
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.policies import RouteHint, RoutingPolicies, affinity_of, rendezvous
from llmgw.server.gateway.prefixes import (
    APPROX_CHUNK,
    BlockIndex,
    PrefixRouting,
    text_keys,
    text_of,
)
from llmgw.server.gateway.routing import Endpoint, Router

MODEL = "m"


def router_of(n: int, metrics: Metrics | None = None) -> tuple[Router, list[Endpoint]]:
    router = Router(RoutingPolicies(metrics))
    eps = [Endpoint(MODEL, f"r{i}", f"s{i}", f"n{i}", f"10.0.0.{i}:9443") for i in range(n)]
    for ep in eps:
        router.set_ready(ep)
    return router, eps


def stored(shard: str, keys: list[int], *, cleared: bool = False) -> pb.KvEvents:
    return pb.KvEvents(shard_id=shard, block_size=16, stored=keys, cleared=cleared)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def kv_hint(ids: list[int], session: str | None = None) -> RouteHint:
    return RouteHint("kv-events", block_keys(ids), unit=16, tokens=len(ids), session=session)


# --------------------------------------------------------------------------- the index


def test_depths_are_each_replicas_leading_run() -> None:
    index = BlockIndex()
    keys = [11, 12, 13, 14]
    index.add("a", keys)
    index.add("b", keys[:2])
    index.add("c", [12, 13])  # no first block: holds nothing that leads
    want = index.bit("a") | index.bit("b") | index.bit("c")
    depth = index.depths(keys, want)
    assert depth == {index.bits["a"]: 4, index.bits["b"]: 2, index.bits["c"]: 0}
    index.discard("a", [13])
    assert index.depths(keys, index.bits["a"]) == {index.bits["a"]: 2}


def test_a_dropped_replica_is_forgotten_at_once_and_its_bit_reused_after_the_sweep() -> None:
    index = BlockIndex()
    index.add("a", [1, 2, 3])
    index.add("b", [1, 2])
    bit_a = index.bits["a"]
    index.drop("a")
    assert "a" not in index.bits
    assert index.blocks == {1: index.bits["b"], 2: index.bits["b"]}
    index.add("c", [9])
    assert index.bits["c"] == bit_a  # swept, so reusable


def test_a_big_drop_is_swept_in_chunks_on_the_loop_and_lookups_ignore_it_meanwhile() -> None:
    async def main() -> None:
        index = BlockIndex()
        keys = list(range(1, 60_001))
        index.add("a", keys)
        index.add("b", keys[:10])
        bit_a = index.bits["a"]
        index.drop("a")
        assert index.live & bit_a == 0
        assert len(index.blocks) > 10  # not swept yet: chunks follow on the loop
        index.add("c", [1])
        assert index.bits["c"] != bit_a  # still retiring
        assert index.depths(keys, bit_a | index.bits["b"]) == {index.bits["b"]: 10}
        for _ in range(10):
            await asyncio.sleep(0)
        assert set(index.blocks) == set(keys[:10])

    asyncio.run(main())


def test_the_index_is_bounded_and_forgets_the_oldest_first() -> None:
    index = BlockIndex(max_blocks=1600)
    index.add("a", range(1, 1601))
    index.add("a", [5000])
    assert len(index) <= 1600
    assert 1 not in index.blocks and 5000 in index.blocks
    assert index.evicted > 0
    assert 1 not in index.held["a"]


# --------------------------------------------------------------------------- events


def test_events_fill_the_index_only_from_the_node_that_runs_the_shard() -> None:
    router, _eps = router_of(2)
    prefixes = router.prefixes
    keys = block_keys(tokens(64))
    router.kv_events("n0", stored("s0", keys))
    router.kv_events("n1", stored("s0", keys))  # n1 does not run s0: refused
    assert prefixes.refused == 1
    index = prefixes.events[MODEL]
    assert index.depths(keys, index.live) == {index.bits["s0"]: 4}
    router.kv_events("n0", pb.KvEvents(shard_id="s0", block_size=16, removed=keys[2:]))
    assert index.depths(keys, index.live) == {index.bits["s0"]: 2}
    router.kv_events("n0", pb.KvEvents(shard_id="s0", block_size=16, cleared=True))
    assert index.depths(keys, index.live) == {index.bits["s0"]: 0}
    router.kv_events("nx", stored("nope", keys))
    assert prefixes.refused == 2


def test_a_replica_of_another_block_size_is_not_indexed() -> None:
    router, _ = router_of(2)
    prefixes = router.prefixes
    router.kv_events("n0", stored("s0", [1, 2]))
    router.kv_events("n1", pb.KvEvents(shard_id="s1", block_size=32, stored=[1, 2]))
    assert "s1" not in prefixes.events[MODEL].bits


def test_lost_events_are_counted_per_model() -> None:
    router, _ = router_of(1)
    router.kv_events("n0", pb.KvEvents(shard_id="s0", block_size=16, lost=3))
    assert router.prefixes.lost == {MODEL: 3}


# --------------------------------------------------------------------------- kv-events


def test_kv_events_sends_a_prompt_to_the_replica_holding_its_prefix() -> None:
    metrics = Metrics()
    router, eps = router_of(3, metrics)
    ids = tokens(4096)
    router.kv_events("n1", stored("s1", block_keys(ids)[:200]))
    router.kv_events("n0", stored("s0", block_keys(ids)[:10]))
    hint = kv_hint(ids + tokens(100, 9000))
    assert router.pick_free(MODEL, 8, hint=hint) is eps[1]
    assert hint.reason == "prefix_hit"
    assert hint.matched == 200
    assert eps[1].pending == len(ids) + 100 - 200 * 16  # its uncached tokens, charged
    hint.settle()
    hint.settle()  # once only
    assert eps[1].pending == 0
    assert metrics.routing.values[(MODEL, "kv-events", "prefix_hit")] == 1


def test_a_saturated_holder_is_passed_over_and_the_choice_says_spread() -> None:
    router, eps = router_of(2)
    ids = tokens(1024)
    router.kv_events("n0", stored("s0", block_keys(ids)))
    router.kv_events("n1", stored("s1", []))
    eps[0].inflight = 4  # at its max_concurrency
    hint = kv_hint(ids)
    assert router.pick_free(MODEL, 4, hint=hint) is eps[1]
    assert hint.reason == "spread"
    eps[1].inflight = 4
    assert router.pick_free(MODEL, 4, hint=kv_hint(ids)) is None


def test_a_hot_prefix_spreads_once_the_prefill_queued_on_its_holder_exceeds_a_full_one() -> None:
    router, _eps = router_of(2)
    system = tokens(4096)
    router.kv_events("n0", stored("s0", block_keys(system)))
    router.kv_events("n1", stored("s1", []))
    chosen = []
    for turn in range(40):
        hint = kv_hint(system + tokens(400, 100_000 + 1000 * turn))
        ep = router.pick_free(MODEL, 64, hint=hint)
        assert ep is not None
        ep.inflight += 1
        chosen.append(ep.shard_id)
    # Each request queues 400 uncached tokens on s0; after about 4096 / 400 of them s0's
    # queue costs more than s1's whole prefill.
    first_spread = chosen.index("s1")
    assert 8 <= first_spread <= 12, chosen
    assert chosen.count("s0") > chosen.count("s1")


def test_a_restarted_replica_is_no_longer_preferred() -> None:
    router, eps = router_of(2)
    ids = tokens(512)
    router.kv_events("n0", stored("s0", block_keys(ids)))
    router.kv_events("n1", stored("s1", []))
    assert router.pick_free(MODEL, 8, hint=kv_hint(ids)) is eps[0]
    eps[0].pending = 0
    router.remove_shard("s0")  # failed; it comes back empty
    router.set_ready(eps[0])
    picks = set()
    for _ in range(4):
        hint = kv_hint(ids)
        ep = router.pick_free(MODEL, 8, hint=hint)
        assert ep is not None and hint.reason == "session"
        hint.settle()
        picks.add(ep.shard_id)
    # Neither holds anything: the prompt's rendezvous replica, whichever held it before.
    assert picks == {rendezvous(affinity_of(kv_hint(ids)) or "", eps)[0].shard_id}


def test_kv_events_without_events_heard_routes_by_session() -> None:
    router, _eps = router_of(2)
    hint = kv_hint(tokens(64), session="conv-1")
    first = router.pick_free(MODEL, 8, hint=hint)
    assert hint.reason == "session"  # its rendezvous replica, heard from or not
    again = kv_hint(tokens(64), session="conv-1")
    assert router.pick_free(MODEL, 8, hint=again) is first
    assert again.reason == "session"


def test_the_session_breaks_a_tie_between_equal_holders() -> None:
    router, eps = router_of(3)
    ids = tokens(256)
    for i in range(3):
        router.kv_events(f"n{i}", stored(f"s{i}", block_keys(ids)))
    for session in ("conv", "other", "third"):
        hint = kv_hint(ids, session=session)
        assert router.pick_free(MODEL, 8, hint=hint) is rendezvous(session, eps)[0]
        assert hint.reason == "prefix_hit"
        hint.settle()
        for ep in eps:
            ep.inflight = 0


# --------------------------------------------------------------------------- prefix-approx


def approx_hint(text: str) -> RouteHint:
    data = text.encode()
    return RouteHint(
        "prefix-approx", text_keys(data), unit=APPROX_CHUNK // 4, tokens=len(data) // 4
    )


def test_prefix_approx_sends_a_prefix_back_where_it_went() -> None:
    router, _eps = router_of(2)
    long = "You are a helpful assistant. " * 40
    first = router.pick_free(MODEL, 8, hint=approx_hint(long + "first question"))
    assert first is not None
    first.pending = 0
    hint = approx_hint(long + "second question")
    assert router.pick_free(MODEL, 8, hint=hint) is first
    assert hint.reason == "prefix_hit"


def test_prefix_approx_forgets_after_its_ttl_and_beyond_capacity() -> None:
    now = [0.0]
    router = Router(RoutingPolicies(prefixes=PrefixRouting(clock=lambda: now[0], approx_ttl=60)))
    eps = [Endpoint(MODEL, f"r{i}", f"s{i}", f"n{i}", "h:1") for i in range(2)]
    for ep in eps:
        router.set_ready(ep)
    text = "x" * (APPROX_CHUNK * 8)
    first = router.pick_free(MODEL, 8, hint=approx_hint(text))
    assert first is not None
    approx = router.prefixes.approx[MODEL]
    assert len(approx.lru[first.shard_id]) == 8
    now[0] = 61
    hint = approx_hint(text)
    router.pick_free(MODEL, 8, hint=hint)
    assert hint.reason in ("no_prefix", "session")
    router.prefixes.set_capacity(MODEL, 4)
    router.pick_free(MODEL, 8, hint=approx_hint("y" * (APPROX_CHUNK * 8)))
    assert all(len(lru) <= 4 for lru in approx.lru.values())


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        ("/v1/chat/completions", {"messages": "not a list"}),
        ("/v1/chat/completions", {"messages": ["not an object"]}),
        ("/v1/completions", {"prompt": 5}),
        ("/v1/responses", {}),
        ("/v1/embeddings", {"input": "x"}),
    ],
)
def test_text_of_gives_none_for_shapes_without_a_prompt(path: str, payload: dict) -> None:
    assert text_of(path, payload) is None


def test_text_keys_chain_so_that_a_shared_prefix_shares_keys() -> None:
    a = text_of(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "s" * 300},
                {"role": "user", "content": "one"},
            ]
        },
    )
    b = text_of(
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "s" * 300},
                {"role": "user", "content": "two"},
            ]
        },
    )
    assert a is not None and b is not None
    ka, kb = text_keys(a), text_keys(b)
    assert ka[:4] == kb[:4]
    assert len(ka) == len(a) // APPROX_CHUNK
    assert text_keys(b"z" + a)[:4] != ka[:4]


def test_long_prompts_are_matched_by_bisection_with_the_same_runs() -> None:
    import random

    rng = random.Random(3)
    keys = list(range(1000, 1300))  # 300 blocks: bisected
    for _ in range(50):
        index = BlockIndex()
        runs = {
            f"s{r}": rng.choice([0, 1, 2, 64, 65, 150, 299, 300, rng.randrange(301)])
            for r in range(8)
        }
        for shard, run in runs.items():
            index.add(shard, keys[:run])
            index.add(shard, [rng.getrandbits(40) for _ in range(5)])  # other prompts' blocks
        got = index.depths(keys, index.live)
        assert got == {index.bits[s]: run for s, run in runs.items()}
        short = keys[:40]  # not bisected: the same answer
        assert index.depths(short, index.live) == {
            index.bits[s]: min(run, 40) for s, run in runs.items()
        }


def test_bisection_credits_a_replica_with_a_hole_past_it_as_documented() -> None:
    index = BlockIndex()
    keys = list(range(1, 201))
    index.add("a", keys[:50] + keys[60:])  # a hole at 50..59, which engines do not keep
    assert index.depths(keys[:60], index.live) == {index.bits["a"]: 50}  # linear: exact
    assert index.depths(keys, index.live)[index.bits["a"]] >= 50
