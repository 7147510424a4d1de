"""The routing policies' table: one entry per Routing, the hint each makes, the choice each
makes and charges, and the charge given back once, with the replica's place."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.contracts.catalog import ROUTINGS, Routing
from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.kvblocks import block_keys
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.policies import (
    AFFINITY_TOKENS,
    POLICIES,
    SESSION_SLACK,
    Prompt,
    RouteHint,
    RoutingPolicies,
    affinity_of,
    rendezvous,
    session_of,
)
from llmgw.server.gateway.queueing import Admission
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel

MODEL = "m"


def served(routing: Routing) -> ServedModel:
    tasks = ("generate",)
    return ServedModel(MODEL, "vllm", tasks, served_paths("vllm", tasks), 8, None, routing=routing)


def router_of(n: int, metrics: Metrics | None = None) -> tuple[Router, list[Endpoint]]:
    router = Router(RoutingPolicies(metrics))
    eps = [Endpoint(MODEL, f"r{i}", f"s{i}", f"n{i}", f"10.0.0.{i}:9443") for i in range(n)]
    for ep in eps:
        router.set_ready(ep)
    return router, eps


def test_every_routing_has_one_entry_and_the_catalog_lists_the_same() -> None:
    assert set(POLICIES) == set(Routing)
    assert ROUTINGS == tuple(r.value for r in Routing)


def test_least_outstanding_makes_no_hint_the_others_carry_the_session() -> None:
    policies = RoutingPolicies()
    assert policies.hint(served(Routing.LEAST_OUTSTANDING), Prompt(), "c") is None
    for routing in (Routing.ROUND_ROBIN, Routing.SESSION, Routing.PREFIX_APPROX):
        hint = policies.hint(served(routing), Prompt(), "c")
        assert hint is not None and (hint.routing, hint.session) == (routing, "c")


def test_kv_events_without_a_tokenizer_says_so_and_carries_no_keys() -> None:
    metrics = Metrics()
    hint = RoutingPolicies(metrics).hint(served(Routing.KV_EVENTS), Prompt(), None)
    assert hint is not None and not hint.keys
    assert metrics.routing.values[(MODEL, "kv-events", "no_tokenizer")] == 1


def test_kv_events_unheard_routes_as_session_would() -> None:
    metrics = Metrics()
    router, eps = router_of(2, metrics)
    ids = list(range(64))
    hint = RouteHint(Routing.KV_EVENTS, block_keys(ids), unit=16, tokens=64, session="u")
    chosen = router.pick_free(MODEL, 8, hint=hint)
    assert chosen is rendezvous("u", eps)[0] and hint.reason == "session"
    again = RouteHint(Routing.KV_EVENTS, block_keys(ids), unit=16, tokens=64, session="u")
    assert router.pick_free(MODEL, 8, hint=again) is chosen and again.reason == "session"
    assert metrics.routing.values[(MODEL, "kv-events", "session")] == 2


def test_a_choice_charges_its_replica_and_the_release_gives_it_back_once() -> None:
    async def body() -> None:
        router, _eps = router_of(1)
        admission = Admission(router, lambda _m: 4, Metrics())
        hint = RouteHint(Routing.SESSION, tokens=100, session="u")
        ep = admission.try_acquire(MODEL, frozenset(), hint)
        assert ep is not None and ep.pending == 100 and hint.charged_to is ep
        hint.settle()  # the first token of a stream: the prefill is done
        assert ep.pending == 0
        admission.release(ep, hint)  # the place: nothing more to give back
        assert (ep.pending, ep.inflight) == (0, 0)
        admission.close()

    asyncio.run(body())


@pytest.mark.parametrize("routing", [Routing.PREFIX_APPROX, Routing.KV_EVENTS])
def test_the_prefix_policies_read_the_prompt_and_the_others_do_not(routing: Routing) -> None:
    policies = RoutingPolicies()
    assert policies.reads_text(routing) is (routing == Routing.PREFIX_APPROX)
    payload = {"messages": [{"role": "user", "content": "x" * 500}]}
    prompt = policies.prompt_of(served(routing), None, "/v1/chat/completions", payload)
    assert bool(prompt.keys) is (routing == Routing.PREFIX_APPROX)  # no tokenizer: no ids
    plain = policies.prompt_of(served(Routing.SESSION), None, "/v1/chat/completions", payload)
    assert not plain.keys and plain.tokens is None


# --------------------------------------------------------------------------- session


def test_session_keeps_a_conversation_on_its_replica_within_the_slack() -> None:
    router, eps = router_of(3)
    hint = RouteHint("session", session="u1")
    home = router.pick_free(MODEL, 16, hint=hint)
    assert home is rendezvous("u1", eps)[0] and hint.reason == "session"
    home.inflight = SESSION_SLACK  # busier, but within the slack
    assert router.pick_free(MODEL, 16, hint=RouteHint("session", session="u1")) is home
    home.inflight = SESSION_SLACK + 1
    moved = RouteHint("session", session="u1")
    other = router.pick_free(MODEL, 16, hint=moved)
    # Moved by load alone, to the next in the session's own order (the same on every
    # instance), and back once its replica is within the slack again: nothing remembered.
    assert other is rendezvous("u1", eps)[1] and moved.reason == "session_moved"
    home.inflight = 0
    assert router.pick_free(MODEL, 16, hint=RouteHint("session", session="u1")) is home


def test_two_routers_with_the_same_replicas_choose_the_same_for_each_session() -> None:
    first, _ = router_of(5)
    second = Router(RoutingPolicies())
    # Learnt in another order (a standby reads them from the database), other objects.
    for i in reversed(range(5)):
        second.set_ready(Endpoint(MODEL, f"r{i}", f"s{i}", f"n{i}", f"10.0.0.{i}:9443"))
    sessions = [f"conv-{i}" for i in range(200)]
    for routing in ("session", "kv-events"):
        a = [first.pick_free(MODEL, 64, hint=RouteHint(routing, session=s)) for s in sessions]
        b = [second.pick_free(MODEL, 64, hint=RouteHint(routing, session=s)) for s in sessions]
        for ep in [*first.endpoints(), *second.endpoints()]:
            ep.inflight = ep.pending = 0  # each instance's own load: none here
        assert [ep.shard_id for ep in a if ep] == [ep.shard_id for ep in b if ep]
    # And they spread: every replica is some sessions' first.
    assert {ep.shard_id for ep in a if ep} == {f"s{i}" for i in range(5)}


def test_removing_a_replica_moves_only_its_sessions() -> None:
    router, eps = router_of(5)
    sessions = [f"user-{i}" for i in range(500)]

    def where() -> dict[str, str]:
        out = {}
        for s in sessions:
            ep = router.pick_free(MODEL, 1000, hint=RouteHint("session", session=s))
            assert ep is not None
            out[s] = ep.shard_id
            ep.inflight = ep.pending = 0
        return out

    before = where()
    router.remove_shard("s3")
    after = where()
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == "s3"} and moved
    # Adding it back takes back exactly those.
    router.set_ready(eps[3])
    assert where() == before


def test_affinity_is_the_session_else_the_prompts_key_at_about_1024_tokens() -> None:
    keys = block_keys(list(range(4096)))  # 256 blocks of 16
    assert affinity_of(RouteHint(Routing.KV_EVENTS, keys, session="c")) == "c"
    at = AFFINITY_TOKENS // 16
    assert affinity_of(RouteHint(Routing.KV_EVENTS, keys)) == f"prefix:{keys[at - 1]:x}"
    # A later turn (the same beginning, more after) keeps it; a short prompt has its last.
    longer = block_keys(list(range(4096)) + list(range(9000, 9500)))
    assert affinity_of(RouteHint(Routing.KV_EVENTS, longer)) == f"prefix:{keys[at - 1]:x}"
    assert affinity_of(RouteHint(Routing.KV_EVENTS, keys[:3])) == f"prefix:{keys[2]:x}"
    assert affinity_of(RouteHint(Routing.SESSION)) is None
    assert affinity_of(RouteHint(Routing.KV_EVENTS, [])) is None


def test_prefix_approx_on_two_instances_sends_an_unseen_conversation_to_one_replica() -> None:
    # Neither instance has seen the conversation: both send its turns where its hash says,
    # so that the instance that served turn 1 and the one that serves turn 2 agree.
    history = "system: be brief. " + "the user asks about x and y. " * 200
    policies = [RoutingPolicies(), RoutingPolicies()]
    routers = [Router(p) for p in policies]
    for router in routers:
        for i in range(4):
            router.set_ready(Endpoint(MODEL, f"r{i}", f"s{i}", f"n{i}", "h:1"))
    chosen = []
    for turn, router in enumerate(routers):
        text = history + " answer. follow-up question." * turn
        payload = {"messages": [{"role": "user", "content": text}]}
        model = served(Routing.PREFIX_APPROX)
        prompt = router.policies.prompt_of(model, None, "/v1/chat/completions", payload)
        hint = router.policies.hint(model, prompt, None)
        assert hint is not None
        ep = router.pick_free(MODEL, 8, hint=hint)
        assert ep is not None and hint.reason == "session"
        chosen.append(ep.shard_id)
    assert chosen[0] == chosen[1]


def test_round_robin_takes_each_in_turn() -> None:
    router, _eps = router_of(3)
    seen = [router.pick_free(MODEL, 8, hint=RouteHint("round-robin")) for _ in range(6)]
    assert [ep.shard_id for ep in seen if ep] == ["s0", "s1", "s2", "s0", "s1", "s2"]


def test_session_of_prefers_the_header_and_bounds_the_length() -> None:
    assert session_of({"user": "alice"}, None) == "alice"
    assert session_of({"user": "alice"}, "conv-9") == "conv-9"
    assert session_of({"user": "a" * 300}, None) is None
    assert session_of({"user": 7}, None) is None
