"""The gateway's routing table: least outstanding requests first, ties rotate."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.server.gateway.routing import Endpoint, Router


def ep(shard: str, model: str = "m", node: str = "n1", addr: str = "10.0.0.1:9443") -> Endpoint:
    return Endpoint(model=model, replica_id=f"r-{shard}", shard_id=shard, node_id=node, addr=addr)


def test_empty_router() -> None:
    router = Router()
    assert router.pick("m") is None
    assert router.models() == []
    assert router.endpoints() == []
    assert router.endpoints("m") == []


def test_url() -> None:
    assert ep("s1").url("/v1/chat/completions") == "https://10.0.0.1:9443/s/s1/v1/chat/completions"


def test_picks_least_outstanding() -> None:
    router = Router()
    a, b, c = ep("a"), ep("b"), ep("c")
    for e in (a, b, c):
        router.set_ready(e)
    a.inflight, b.inflight, c.inflight = 3, 1, 2
    for _ in range(5):
        assert router.pick("m") is b
    b.inflight = 5
    assert router.pick("m") is c


def test_a_decode_pool_picks_the_fewest_tokens_to_generate_then_the_fewest_requests() -> None:
    router = Router()
    a, b, c = ep("a", "m#decode"), ep("b", "m#decode"), ep("c", "m#decode")
    for e in (a, b, c):
        router.set_ready(e)
    # b has the fewest requests but the most tokens to generate: a long answer's replica.
    a.inflight, b.inflight, c.inflight = 3, 1, 3
    a.decoding, b.decoding, c.decoding = 40, 4000, 40
    picks = Counter(router.pick("m#decode").shard_id for _ in range(10))  # type: ignore[union-attr]
    assert set(picks) == {"a", "c"}  # tied on both: in turn
    c.inflight = 4
    assert router.pick_free("m#decode", 4) is a  # c is full; b has the tokens
    assert router.pick_free("m#decode", 3) is b  # the only one under the limit


def test_ties_rotate() -> None:
    router = Router()
    a, b, c = ep("a"), ep("b"), ep("c")
    for e in (a, b, c):
        router.set_ready(e)
    c.inflight = 1
    picks = Counter(router.pick("m").shard_id for _ in range(10))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b"}
    assert abs(picks["a"] - picks["b"]) <= 1


def test_ties_rotate_per_model_under_interleaved_traffic() -> None:
    router = Router()
    for shard, model in (("x1", "x"), ("x2", "x"), ("y1", "y"), ("y2", "y")):
        router.set_ready(ep(shard, model=model))
    picked: dict[str, set[str]] = {"x": set(), "y": set()}
    for _ in range(8):
        for model in ("x", "y"):
            picked[model].add(router.pick(model).shard_id)  # type: ignore[union-attr]
    assert picked == {"x": {"x1", "x2"}, "y": {"y1", "y2"}}


def test_exclude() -> None:
    router = Router()
    a, b = ep("a"), ep("b")
    router.set_ready(a)
    router.set_ready(b)
    a.inflight = 0
    b.inflight = 7
    assert router.pick("m", exclude=frozenset({"a"})) is b
    assert router.pick("m", exclude=frozenset({"a", "b"})) is None
    # Excluding the busier one leaves the idle one.
    assert router.pick("m", exclude=frozenset({"b"})) is a
    # Ties among the rest still rotate, and never to an excluded one.
    c = ep("c")
    router.set_ready(c)
    c.inflight = 7
    picks = {router.pick("m", exclude=frozenset({"a"})).shard_id for _ in range(6)}  # type: ignore[union-attr]
    assert picks == {"b", "c"}


def test_models_are_separate() -> None:
    router = Router()
    router.set_ready(ep("a", model="x"))
    router.set_ready(ep("b", model="y"))
    assert router.models() == ["x", "y"]
    assert router.pick("x").shard_id == "a"  # type: ignore[union-attr]
    assert router.pick("y").shard_id == "b"  # type: ignore[union-attr]
    assert router.pick("z") is None
    assert {e.shard_id for e in router.endpoints()} == {"a", "b"}
    assert [e.shard_id for e in router.endpoints("x")] == ["a"]


def test_set_ready_again_same_place_keeps_the_endpoint() -> None:
    router = Router()
    a = ep("a")
    router.set_ready(a)
    a.inflight = 4
    router.set_ready(ep("a"))
    assert router.endpoints("m") == [a]
    assert router.pick("m").inflight == 4  # type: ignore[union-attr]


def test_set_ready_moved_shard_replaces_it() -> None:
    router = Router()
    router.set_ready(ep("a", node="n1", addr="10.0.0.1:9443"))
    moved = ep("a", node="n2", addr="10.0.0.2:9443")
    router.set_ready(moved)
    assert router.endpoints("m") == [moved]
    assert router.endpoints() == [moved]


def test_remove_shard() -> None:
    router = Router()
    router.set_ready(ep("a"))
    router.set_ready(ep("b"))
    router.remove_shard("a")
    assert [e.shard_id for e in router.endpoints("m")] == ["b"]
    router.remove_shard("a")  # unknown: nothing happens
    router.remove_shard("b")
    assert router.pick("m") is None
    assert router.models() == []


def test_remove_node() -> None:
    router = Router()
    router.set_ready(ep("a", model="x", node="n1"))
    router.set_ready(ep("b", model="x", node="n2"))
    router.set_ready(ep("c", model="y", node="n1"))
    router.remove_node("n1")
    assert router.models() == ["x"]
    assert [e.shard_id for e in router.endpoints()] == ["b"]
    router.remove_node("n9")
    assert [e.shard_id for e in router.endpoints()] == ["b"]


def test_remove_model() -> None:
    router = Router()
    router.set_ready(ep("a", model="x"))
    router.set_ready(ep("b", model="x", node="n2"))
    router.set_ready(ep("c", model="y"))
    router.remove_model("x")
    assert router.models() == ["y"]
    assert router.pick("x") is None
    assert [e.shard_id for e in router.endpoints()] == ["c"]
    router.remove_model("nope")
    assert router.models() == ["y"]


# --------------------------------------------------------------------------- property

SHARDS = [f"s{i}" for i in range(6)]
NODES = ["n1", "n2", "n3"]
MODELS = ["x", "y"]

ops = st.one_of(
    st.tuples(
        st.just("ready"),
        st.sampled_from(SHARDS),
        st.sampled_from(MODELS),
        st.sampled_from(NODES),
    ),
    st.tuples(st.just("remove_shard"), st.sampled_from(SHARDS)),
    st.tuples(st.just("remove_node"), st.sampled_from(NODES)),
    st.tuples(st.just("remove_model"), st.sampled_from(MODELS)),
    st.tuples(st.just("inflight"), st.sampled_from(SHARDS), st.integers(-2, 3)),
    st.tuples(
        st.just("pick"),
        st.sampled_from(MODELS),
        st.frozensets(st.sampled_from(SHARDS), max_size=3),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=60))
def test_pick_never_returns_removed_and_is_least_loaded(steps: list[tuple]) -> None:  # type: ignore[type-arg]
    router = Router()
    # The model's view: shard -> its live endpoint.
    live: dict[str, Endpoint] = {}
    for step in steps:
        kind = step[0]
        if kind == "ready":
            _, shard, model, node = step
            old = live.get(shard)
            if old is not None and old.model != model:
                # A shard belongs to one model; a different model means it was re-created.
                router.remove_shard(shard)
                del live[shard]
                old = None
            e = Endpoint(model, f"r-{shard}", shard, node, f"{node}:9443")
            router.set_ready(e)
            if old is None or (old.node_id, old.addr) != (node, f"{node}:9443"):
                live[shard] = e
        elif kind == "remove_shard":
            router.remove_shard(step[1])
            live.pop(step[1], None)
        elif kind == "remove_node":
            router.remove_node(step[1])
            for s in [s for s, e in live.items() if e.node_id == step[1]]:
                del live[s]
        elif kind == "remove_model":
            router.remove_model(step[1])
            for s in [s for s, e in live.items() if e.model == step[1]]:
                del live[s]
        elif kind == "inflight":
            _, shard, delta = step
            if shard in live:
                live[shard].inflight = max(0, live[shard].inflight + delta)
        else:
            _, model, exclude = step
            candidates = [
                e for e in live.values() if e.model == model and e.shard_id not in exclude
            ]
            got = router.pick(model, exclude)
            if not candidates:
                assert got is None
                continue
            assert got is not None
            assert any(got is e for e in candidates), "picked a removed or excluded endpoint"
            assert got.inflight == min(e.inflight for e in candidates)

        # The table's contents always match the model's.
        assert sorted(router.models()) == sorted({e.model for e in live.values()})
        assert {id(e) for e in router.endpoints()} == {id(e) for e in live.values()}
        for model in MODELS:
            assert {id(e) for e in router.endpoints(model)} == {
                id(e) for e in live.values() if e.model == model
            }


def test_wait_ready_returns_a_replica_that_becomes_ready_in_time() -> None:
    import asyncio

    from llmgw.server.gateway.routing import Endpoint, Router

    async def main() -> tuple[Endpoint | None, Endpoint | None]:
        router = Router()
        late = Endpoint(
            model="m", replica_id="r1", shard_id="r1-s0", node_id="n1", addr="127.0.0.1:1"
        )
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, router.set_ready, late)
        got = await router.wait_ready("m", timeout=5)
        none = await router.wait_ready("other", timeout=0.05)
        return got, none

    got, none = asyncio.run(main())
    assert got is not None and got.shard_id == "r1-s0"
    assert none is None
