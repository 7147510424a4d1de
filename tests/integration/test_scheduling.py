"""Drain moves replicas without an outage; a lost node's replicas are rebuilt elsewhere."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import (
    LLMGW,
    Agent,
    Client,
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Server, dict[str, Agent]]]:
    server = start_server_with(tmp_path, loss_timeout=4)
    agents: dict[str, Agent] = {}
    try:
        for name in ("sch-a", "sch-b"):
            agents[name] = start_agent(
                make_agent(tmp_path, server, name, extra={"stop_shards_on_exit": False})
            )
        wait_for(lambda: sum(n["connected"] for n in server.nodes()) == 2, what="two agents")
        server.approve_pending(2)
        yield server, agents
    finally:
        for agent in agents.values():
            if agent.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(agent.proc.pid, signal.SIGCONT)
                stop_process(agent.proc)
            for rec in agent.shard_records().values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rec["pid"], signal.SIGKILL)
        stop_process(server.proc)


def _nodes_of(server: Server, model: str) -> list[str]:
    return sorted(r["node"] for r in server.replicas(model) if r["routable"])


def test_drain_moves_replicas_one_at_a_time_without_failing_a_request(
    fleet: tuple[Server, dict[str, Agent]], tmp_path: Path
) -> None:
    server, _agents = fleet
    server.api(
        "POST",
        "/api/models",
        {"name": "dm", "engine": "sim", "replicas": 2, "params": {"tps": 200}},
    )
    wait_for(lambda: _nodes_of(server, "dm") == ["sch-a", "sch-b"], what="one replica per node")
    client = Client(server.url + "/v1", server.api_key(), "dm")
    client.start()
    env = dict(
        os.environ,
        LLMGW_SERVER=server.url,
        LLMGW_TOKEN=server.admin_token,
        XDG_CONFIG_HOME=str(tmp_path),
    )
    try:
        out = subprocess.run(
            [*LLMGW, "ctl", "drain", "sch-a", "--timeout", "90"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        client.stop.set()
        client.join(timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sch-a is drained" in out.stdout
    assert "moving" in out.stdout
    assert _nodes_of(server, "dm") == ["sch-b", "sch-b"]
    assert client.failures == []
    assert client.ok > 5
    kinds = [e["kind"] for e in server.api("GET", "/api/events?subject=sch-a&limit=100")]
    assert "drain_moving" in kinds and "drain_moved" in kinds
    # While drained, new replicas avoid it; uncordon lets it take them again.
    server.api(
        "POST",
        "/api/models",
        {"name": "dm", "engine": "sim", "replicas": 3, "params": {"tps": 200}},
    )
    wait_for(lambda: len(_nodes_of(server, "dm")) == 3, what="third replica")
    assert "sch-a" not in _nodes_of(server, "dm")
    again = subprocess.run(
        [*LLMGW, "ctl", "uncordon", "sch-a"], capture_output=True, text=True, env=env, timeout=60
    )
    assert again.returncode == 0 and "takes new replicas again" in again.stdout
    server.api(
        "POST",
        "/api/models",
        {"name": "dm", "engine": "sim", "replicas": 4, "params": {"tps": 200}},
    )
    wait_for(lambda: "sch-a" in _nodes_of(server, "dm"), what="a replica back on sch-a")


def test_lost_node_has_its_replicas_rebuilt_and_stops_its_orphans_when_back(
    fleet: tuple[Server, dict[str, Agent]],
) -> None:
    server, agents = fleet
    server.api("POST", "/api/models", {"name": "lm", "engine": "sim", "replicas": 2})
    wait_for(lambda: _nodes_of(server, "lm") == ["sch-a", "sch-b"], what="one replica per node")
    orphan_pid = next(r["pid"] for r in server.replicas("lm") if r["node"] == "sch-a")
    victim = agents["sch-a"]
    assert victim.proc is not None
    # The agent freezes: its heartbeats stop but its TCP connection stays open.
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        wait_for(
            lambda: any(
                e["kind"] == "node_lost" for e in server.api("GET", "/api/events?subject=sch-a")
            ),
            timeout=30,
            what="node_lost",
        )
        wait_for(
            lambda: _nodes_of(server, "lm") == ["sch-b", "sch-b"],
            timeout=30,
            what="rebuilt on sch-b",
        )
        assert next(n for n in server.nodes() if n["id"] == "sch-a")["lost"] is True
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    # Back: it reconnects, and the engine it still runs belongs to no replica: it is stopped.
    wait_for(
        lambda: any(n["id"] == "sch-a" and n["connected"] for n in server.nodes()),
        timeout=60,
        what="back",
    )

    def gone() -> bool:
        try:
            os.kill(orphan_pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, timeout=30, what="the orphaned engine to be stopped")
    assert any(e["kind"] == "node_back" for e in server.api("GET", "/api/events?subject=sch-a"))
    assert _nodes_of(server, "lm") == ["sch-b", "sch-b"]
