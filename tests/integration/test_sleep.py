"""Sleeping replicas end to end: a real control plane, a real agent and a sim engine that
sleeps with vLLM's protocol. A replica put to sleep ('ctl replicas sleep') answers nothing
routed (the gateway refuses as for a model with no ready replica), 'ctl replicas' and
/metrics show it asleep; woken ('ctl replicas wake'), it is routed again after the sim's
wake cost and answers."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

WAKE_S = 1.5
CATALOG = {
    "models": {
        "sleepy": {
            "profiles": {
                "default": {
                    "engine": "sim",
                    "params": {"wake_seconds": str(WAKE_S), "sleep_host_mib": "256"},
                    "sleep": {"level": 1},
                }
            }
        }
    }
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Agent, Path]]:
    tmp = tmp_path_factory.mktemp("sleep")
    # A request for a model with no ready replica waits this long, then is refused.
    server = start_server_with(tmp, replica_wait=1)
    # Engines outlive the agent, as in production: a restarted agent adopts them.
    agent = start_agent(make_agent(tmp, server, "node-a", extra={"stop_shards_on_exit": False}))
    try:
        wait_for(lambda: any(n["connected"] for n in server.nodes()), what="the agent")
        server.approve_pending(1)
        server.api("PUT", "/api/catalog", CATALOG)
        server.api("POST", "/api/models", {"name": "sleepy", "profile": "default", "replicas": 1})
        wait_for(lambda: _routable(server), what="a routable replica of sleepy")
        yield server, agent, tmp
    finally:
        stop_process(agent.proc) if agent.proc is not None else None
        agent.kill_engines()  # they outlive the agent (stop_shards_on_exit: false)
        stop_process(server.proc)


def _routable(server: Server) -> bool:
    rows = server.replicas("sleepy")
    return bool(rows) and all(r["routable"] for r in rows)


def _state(server: Server) -> str:
    (row,) = server.replicas("sleepy")
    return str(row["state"])


def ctl(server: Server, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(LLMGW_SERVER=server.url, LLMGW_TOKEN=server.admin_token)
    env["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    return subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60
    )


def chat(server: Server, key: str) -> tuple[int, dict[str, Any]]:
    body = {"model": "sleepy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_sleep_takes_a_replica_out_and_wake_brings_it_back(
    cluster: tuple[Server, Agent, Path],
) -> None:
    server, agent, tmp = cluster
    key = server.api_key()
    assert chat(server, key)[0] == 200
    (row,) = server.replicas("sleepy")
    replica = row["replica"]

    slept = ctl(server, tmp, "replicas", "sleep", replica)
    assert slept.returncode == 0, slept.stderr
    assert slept.stdout.startswith(f"{replica} is falling asleep at level 1")
    wait_for(lambda: _state(server) == "asleep", what="the replica asleep")
    (row,) = server.replicas("sleepy")
    assert (row["routable"], row["sleep_level"], row["host_memory_mib"]) == (False, 1, 256)
    listed = ctl(server, tmp, "replicas", "sleepy")
    assert "asleep (level 1, 256 MiB host)" in listed.stdout, listed.stdout
    assert 'llmgw_replicas{model="sleepy",state="asleep"} 1' in server.metrics()
    # Routed nowhere: refused as for a model with no ready replica (after replica_wait).
    status, body = chat(server, key)
    assert (status, body["error"]["code"]) == (503, "model_not_ready")
    # The agent keeps it asleep: recorded, and its data plane port not ready.
    assert agent.shard_records()[row["shard"]]["state"] == "asleep"
    # Asleep already: refused with the reason.
    again = ctl(server, tmp, "replicas", "sleep", replica)
    assert again.returncode == 1 and "is asleep already" in again.stderr

    began = time.monotonic()
    woke = ctl(server, tmp, "replicas", "wake", replica)
    assert woke.returncode == 0, woke.stderr
    wait_for(lambda: _routable(server), what="the replica routable again")
    took = time.monotonic() - began
    assert took >= WAKE_S  # the sim's wake cost, observed end to end
    assert chat(server, key)[0] == 200
    events = server.api("GET", "/api/events?subject=" + replica)
    kinds = {e["kind"]: e for e in events}
    assert kinds["replica_asleep"]["actor"] == "token"  # the admin token acted
    assert "asleep at level 1 in " in kinds["replica_asleep"]["message"]
    awake = kinds["replica_awake"]["message"]
    engine_s = float(awake.split("(engine ")[1].split("s)")[0])
    assert engine_s >= WAKE_S
    # Awake: nothing to wake.
    refused = ctl(server, tmp, "replicas", "wake", replica)
    assert refused.returncode == 1 and "needs no waking" in refused.stderr


def test_an_agent_restart_keeps_a_sleeping_replica_asleep(
    cluster: tuple[Server, Agent, Path],
) -> None:
    server, agent, tmp = cluster
    key = server.api_key()
    (row,) = server.replicas("sleepy")
    replica, shard = row["replica"], row["shard"]
    assert ctl(server, tmp, "replicas", "sleep", replica).returncode == 0
    wait_for(lambda: _state(server) == "asleep", what="the replica asleep")
    pid = agent.shard_records()[shard]["pid"]
    assert agent.proc is not None
    stop_process(agent.proc)
    start_agent(agent)
    wait_for(
        lambda: "shard adopted" in agent.log() and any(n["connected"] for n in server.nodes()),
        what="the agent back, its engine adopted",
    )
    # Adopted asleep (starting until its health check): the same engine, routed nowhere.
    wait_for(lambda: agent.shard_records()[shard]["state"] == "asleep", what="adopted asleep")
    wait_for(lambda: _state(server) == "asleep", what="reported asleep")
    (row,) = server.replicas("sleepy")
    assert (row["state"], row["pid"], row["routable"]) == ("asleep", pid, False)
    assert agent.shard_records()[shard]["state"] == "asleep"
    assert ctl(server, tmp, "replicas", "wake", replica).returncode == 0
    wait_for(lambda: _routable(server), what="the replica routable again")
    assert chat(server, key)[0] == 200
    (row,) = server.replicas("sleepy")
    assert (row["pid"], row["restarts"]) == (pid, 0)  # woken, never restarted


def test_an_idle_replica_sleeps_by_itself_and_the_next_request_wakes_it(
    cluster: tuple[Server, Agent, Path],
) -> None:
    """Serving by demand with sleep_after: the planner puts the idle replica to sleep and a
    request wakes it (the wake's cost, not a start's): the same engine process serves."""
    server, _agent, _tmp = cluster
    catalog = {"models": {"dozy": CATALOG["models"]["sleepy"]}}
    server.api("PUT", "/api/catalog", catalog)
    policy = {"min": 1, "max": 1, "sleep_after": "1s"}
    server.api("POST", "/api/models", {"name": "dozy", "profile": "default", "replicas": policy})
    wait_for(lambda: [r["routable"] for r in server.replicas("dozy")] == [True], what="dozy up")
    (before,) = server.replicas("dozy")
    wait_for(
        lambda: [r["state"] for r in server.replicas("dozy")] == ["asleep"],
        timeout=30,
        what="dozy asleep after a second idle",
    )
    events = server.api("GET", f"/api/events?subject={before['replica']}&limit=50")
    assert any(e["kind"] == "replica_asleep" for e in events), events
    key = server.api_key("dozy")
    body = {"model": "dozy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    request = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    began = time.monotonic()
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert json.loads(resp.read())["choices"][0]["message"]["content"]
    assert time.monotonic() - began >= WAKE_S  # it waited for the wake
    (after,) = server.replicas("dozy")
    assert (after["replica"], after["pid"]) == (before["replica"], before["pid"])  # woken
    assert after["restarts"] == 0
    # The wake measured in its two parts: the engine's (its wake cost) and llmgw's.
    metrics = server.metrics()
    assert 'llmgw_replica_wake_seconds_count{model="dozy",part="llmgw"} 1' in metrics
    engine = metrics.split('llmgw_replica_wake_seconds_sum{model="dozy",part="engine"} ')[1]
    assert float(engine.split()[0]) >= WAKE_S
