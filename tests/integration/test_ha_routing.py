"""Every instance routes as well as the leader (issue 40, point 3), on PostgreSQL: three
instances, one agent with three sim replicas of a ``kv-events`` profile. The leader relays its
agent's KV events to the standbys (llmgw.server.ha.kvrelay), so a conversation's next turn
entering through a standby lands on the replica holding its prefix; and a session id lands on
the same replica whichever instance it enters (rendezvous hashing, llmgw.server.gateway.
policies), with no state shared between them."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.ha import Instance, cluster, models, stop_all
from tests.integration.harness import make_agent, start_agent, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

MODEL = "conv"
SYSTEM = "You are a careful assistant. " + " ".join(
    ("the of and to in is was for that on with as by at from it be this are or an".split()) * 24
)


def _metric(inst: Instance, pattern: str) -> list[tuple[str, ...]]:
    return re.findall(pattern, inst.server.metrics(), re.M)


def served_by(inst: Instance) -> dict[str, int]:
    """Requests this instance answered 200, per replica of the model."""
    pattern = r'^llmgw_requests_total\{model="' + MODEL + r'",replica="([^"]+)",code="200"\} (\d+)$'
    return {replica: int(n) for replica, n in _metric(inst, pattern)}


def indexed(inst: Instance) -> int:
    pattern = r'^llmgw_prefix_index_blocks\{model="' + MODEL + r'",index="events"\} (\d+)$'
    found = _metric(inst, pattern)
    return int(found[0]) if found else 0  # type: ignore[arg-type]


def decisions(inst: Instance, reason: str) -> int:
    pattern = (
        r'^llmgw_routing_decisions_total\{model="'
        + MODEL
        + r'",policy="kv-events",reason="'
        + reason
        + r'"\} (\d+)$'
    )
    found = _metric(inst, pattern)
    return int(found[0]) if found else 0  # type: ignore[arg-type]


def went_to(inst: Instance, before: dict[str, int]) -> str:
    after = served_by(inst)
    moved = [r for r in after if after[r] != before.get(r, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


@pytest.fixture(scope="module")
def ha(
    tmp_path_factory: pytest.TempPathFactory, pg_cluster: Any
) -> Iterator[tuple[list[Instance], dict[str, openai.OpenAI]]]:
    tmp: Path = tmp_path_factory.mktemp("haroute")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        instances = cluster(tmp, pg_cluster, count=3)
        procs.extend(i.server.proc for i in instances)
        leader = instances[0].server
        servers = [f"127.0.0.1:{i.server.grpc_port}" for i in instances]
        agent = make_agent(tmp, leader, "node-a", extra={"servers": servers})
        start_agent(agent)
        assert agent.proc is not None
        procs.append(agent.proc)
        wait_for(lambda: any(n["connected"] for n in leader.nodes()), timeout=60, what="agent")
        leader.approve_pending(expected=1)
        profile = {
            "engine": "sim",
            "routing": "kv-events",
            "max_concurrency": 4,
            "params": {"tps": "50", "kv_blocks": "4096"},
        }
        leader.api("PUT", "/api/catalog", {"models": {MODEL: {"profiles": {"default": profile}}}})
        leader.api("POST", "/api/models", {"name": MODEL, "profile": "default", "replicas": 3})
        wait_for(
            lambda: sum(1 for r in leader.replicas(MODEL) if r["routable"]) == 3,
            timeout=90,
            what="three ready replicas",
        )
        for inst in instances[1:]:
            wait_for(lambda i=inst: models(i) == [MODEL], timeout=30, what=f"{inst.name} routes")
        key = leader.api_key("conv")
        clients = {
            i.name: openai.OpenAI(base_url=i.server.url + "/v1", api_key=key, max_retries=0)
            for i in instances
        }
        yield instances, clients
    finally:
        stop_all(procs)


def ask(client: openai.OpenAI, history: list[Any], words: str, user: str) -> int:
    """One turn (appended to ``history``); its cached prompt tokens."""
    history.append({"role": "user", "content": words})
    reply = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, user=user)
    history.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_a_second_turn_through_a_standby_lands_on_the_replica_holding_its_prefix(
    ha: tuple[list[Instance], dict[str, openai.OpenAI]],
) -> None:
    instances, clients = ha
    leader, standby, other = instances
    history: list[Any] = [{"role": "system", "content": SYSTEM}]
    before = served_by(leader)
    assert ask(clients["cp1"], history, "first question about the river", "alice") == 0
    home = went_to(leader, before)
    # The replica's blocks reach the leader from its agent, and both standbys by the relay.
    for inst in instances:
        wait_for(lambda i=inst: indexed(i) >= 20, timeout=20, what=f"{inst.name}'s index")
    # Later turns, through each standby, under other users (so that no session's hash can
    # bring them home): each lands on the replica holding the conversation, a prefix hit.
    for n, (inst, user) in enumerate(
        [(standby, "bob"), (other, "carol"), (standby, "dave"), (other, "erin")]
    ):
        before = served_by(inst)
        hits = decisions(inst, "prefix_hit")
        cached = ask(clients[inst.name], history, f"follow-up {n} about the mountain", user)
        assert went_to(inst, before) == home, inst.name
        assert cached >= 300, cached
        assert decisions(inst, "prefix_hit") == hits + 1


def test_a_session_lands_on_one_replica_whichever_instance_it_enters(
    ha: tuple[list[Instance], dict[str, openai.OpenAI]],
) -> None:
    instances, clients = ha
    homes: dict[str, str] = {}
    for s in range(8):
        user = f"session-{s}"
        seen = set()
        for turn, inst in enumerate([*instances, *reversed(instances)]):
            # Each request a prompt of its own (nothing of it cached anywhere): only the
            # session says where it goes.
            history = [{"role": "user", "content": f"s{s}t{turn}: " + "unrelated words " * 8}]
            before = served_by(inst)
            ask(clients[inst.name], history, "and?", user)
            seen.add(went_to(inst, before))
        assert len(seen) == 1, (user, seen)
        homes[user] = seen.pop()
    # Sessions spread over the replicas (the hash, not one replica for all).
    assert len(set(homes.values())) >= 2, homes
