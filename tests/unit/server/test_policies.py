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
    POLICIES,
    SESSION_SLACK,
    Prompt,
    RouteHint,
    RoutingPolicies,
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
    assert chosen in eps and hint.reason == "least_outstanding"
    again = RouteHint(Routing.KV_EVENTS, block_keys(ids), unit=16, tokens=64, session="u")
    assert router.pick_free(MODEL, 8, hint=again) is chosen and again.reason == "session"
    assert metrics.routing.values[(MODEL, "kv-events", "session")] == 1


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
    router, _eps = router_of(2)
    hint = RouteHint("session", session="u1")
    home = router.pick_free(MODEL, 16, hint=hint)
    assert home is not None
    home.inflight = SESSION_SLACK  # busier, but within the slack
    assert router.pick_free(MODEL, 16, hint=RouteHint("session", session="u1")) is home
    home.inflight = SESSION_SLACK + 1
    moved = RouteHint("session", session="u1")
    other = router.pick_free(MODEL, 16, hint=moved)
    assert other is not home and moved.reason == "session_moved"
    assert router.policies.sessions.last["u1"][0] == other.shard_id  # it stays on the new one


def test_sessions_expire() -> None:
    now = [0.0]
    router = Router(RoutingPolicies(clock=lambda: now[0], session_ttl=10))
    eps = [Endpoint(MODEL, f"r{i}", f"s{i}", f"n{i}", "h:1") for i in range(2)]
    for ep in eps:
        router.set_ready(ep)
    home = router.pick_free(MODEL, 16, hint=RouteHint("session", session="u"))
    now[0] = 11
    hint = RouteHint("session", session="u")
    router.pick_free(MODEL, 16, hint=hint)
    assert hint.reason == "least_outstanding"
    assert home is not None


def test_round_robin_takes_each_in_turn() -> None:
    router, _eps = router_of(3)
    seen = [router.pick_free(MODEL, 8, hint=RouteHint("round-robin")) for _ in range(6)]
    assert [ep.shard_id for ep in seen if ep] == ["s0", "s1", "s2", "s0", "s1", "s2"]


def test_session_of_prefers_the_header_and_bounds_the_length() -> None:
    assert session_of({"user": "alice"}, None) == "alice"
    assert session_of({"user": "alice"}, "conv-9") == "conv-9"
    assert session_of({"user": "a" * 300}, None) is None
    assert session_of({"user": 7}, None) is None
