"""Cache-aware routing end to end: three sim replicas of a profile with ``routing: kv-events``
behind a real control plane and agent. The sims publish their KV cache events over ZeroMQ as
vLLM does, the agent re-keys and forwards them on its stream, and the gateway routes each turn
of a conversation by what the replicas hold, through the official openai client."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    Server,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "conv"
SYSTEM = "You are a careful assistant. " + " ".join(
    ("the of and to in is was for that on with as by at from it be this are or an".split()) * 24
)


def metrics(server: Server) -> str:
    return server.metrics()


def served_by(server: Server) -> dict[str, int]:
    """Requests answered 200 per replica of the model."""
    pattern = re.compile(
        r'^llmgw_requests_total\{model="' + MODEL + r'",replica="([^"]+)",code="200"\} (\d+)$',
        re.M,
    )
    return {replica: int(n) for replica, n in pattern.findall(metrics(server))}


def indexed(server: Server) -> int:
    found = re.search(
        r'^llmgw_prefix_index_blocks\{model="' + MODEL + r'",index="events"\} (\d+)$',
        metrics(server),
        re.M,
    )
    return int(found.group(1)) if found else 0


def went_to(server: Server, before: dict[str, int]) -> str:
    after = served_by(server)
    moved = [r for r in after if after[r] != before.get(r, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, openai.OpenAI]]:
    tmp = tmp_path_factory.mktemp("kv")
    server = start_server(tmp)
    agent = start_agent(make_agent(tmp, server, "node-a"))
    try:
        wait_for(lambda: any(n["connected"] for n in server.nodes()), what="the agent")
        server.approve_pending(1)
        server.api(
            "PUT",
            "/api/catalog",
            {
                "models": {
                    MODEL: {
                        "profiles": {
                            "default": {
                                "engine": "sim",
                                "routing": "kv-events",
                                "max_concurrency": 2,
                                "params": {"tps": "50", "kv_blocks": "4096"},
                            }
                        }
                    }
                }
            },
        )
        server.api("POST", "/api/models", {"name": MODEL, "profile": "default", "replicas": 3})
        wait_for(
            lambda: sum(1 for r in server.replicas(MODEL) if r["routable"]) == 3,
            timeout=90,
            what="three ready replicas",
        )
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key(), max_retries=0)
        yield server, client
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def ask(client: openai.OpenAI, history: list[Any], words: str, max_tokens: int = 4) -> int:
    """One turn of ``history`` (appended to: the question, then the answer); its cached
    prompt tokens."""
    history.append({"role": "user", "content": words})
    reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=max_tokens)
    history.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_a_conversation_follows_its_cache_spreads_when_full_and_forgets_a_restarted_replica(
    cluster: tuple[Server, openai.OpenAI],
) -> None:
    server, client = cluster
    history: list[Any] = [{"role": "system", "content": SYSTEM}]

    # Turn 1: nobody holds the prefix; its replica publishes what it stored.
    before = served_by(server)
    assert ask(client, history, "first question about the river") == 0
    home = went_to(server, before)
    wait_for(lambda: indexed(server) >= 20, timeout=20, what="the replica's blocks indexed")

    # Turns 2-4 land on the replica holding the conversation, which reports its prefix cached.
    for n in range(3):
        before = served_by(server)
        cached = ask(client, history, f"follow-up number {n} about the mountain")
        assert went_to(server, before) == home
        assert cached >= 300, cached

    # Saturate it: two slow turns of the same conversation hold its two places...
    slow: list[int] = []

    def slow_turn() -> None:
        slow.append(ask(client, list(history), "tell me a long story", max_tokens=64))

    before = served_by(server)
    threads = [threading.Thread(target=slow_turn) for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(
        lambda: re.search(
            r'^llmgw_requests_in_flight\{model="' + MODEL + '",replica="' + home + r'"\} 2$',
            metrics(server),
            re.M,
        ),
        timeout=10,
        what="both slow turns on the home replica",
    )
    # ...so the next turn goes to another replica, which has to compute the prefix.
    during = served_by(server)
    assert ask(client, history, "meanwhile, a quick one") < 300
    second = went_to(server, during)
    assert second != home
    for t in threads:
        t.join()
    assert served_by(server)[home] == before[home] + 2

    # The home replica's engine dies: its entries go, and it is rebuilt empty; the turn after
    # goes to the replica that now holds the prefix.
    pid = next(r["pid"] for r in server.replicas(MODEL) if r["replica"] == home)
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: any(
            r["replica"] == home and r["routable"] and r["pid"] != pid
            for r in server.replicas(MODEL)
        ),
        timeout=60,
        what="the home replica restarted",
    )
    before = served_by(server)
    assert ask(client, history, "after the restart") >= 300
    assert went_to(server, before) == second

    models = {m["name"]: m for m in server.api("GET", "/api/models")}
    assert models[MODEL]["routing"] == "kv-events"
    assert models[MODEL]["cache_hit_rate"] > 0.3
    text = metrics(server)
    assert re.search(
        r'llmgw_routing_decisions_total\{model="conv",policy="kv-events",reason="prefix_hit"\} [1-9]',
        text,
    )
    assert re.search(
        r'llmgw_routing_decisions_total\{model="conv",policy="kv-events",reason="spread"\} [1-9]',
        text,
    )
