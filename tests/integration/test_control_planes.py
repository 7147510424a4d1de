"""The control planes an agent learns from the leader: kept in its state directory, dialled
after a restart when agent.yaml names only instances that are gone, and never at the cost
of an engine.

The leader listens on every address and advertises 127.0.0.2, so the list it sends names
an address that no agent.yaml in this test does; a standby on the same state directory
refuses and names the leader by that same address."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    free_port,
    make_agent,
    start_agent,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

LEARNT = "learnt the control planes from the leader"


def _server(tmp: Path, name: str, state: Path, grpc_listen: str, **extra: object) -> Server:
    http_port = free_port()
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(state),
                "http_listen": f"127.0.0.1:{http_port}",
                "grpc_listen": grpc_listen,
                "enroll_listen": "127.0.0.1:0",
                "heartbeat_interval": 1.0,
                "loss_timeout": 30.0,
                "drain_grace": 0,  # no load balancer here: a stop waits for no grace
                **extra,
            }
        )
    )
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([*LLMGW, "server", "--config", str(cfg)], stdout=out, stderr=out)
    return Server(state, http_port, int(grpc_listen.rpartition(":")[2]), proc, log_path)


def _health(server: Server) -> int:
    try:
        with urllib.request.urlopen(server.url + "/healthz", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def _restart(agent: Agent, servers: list[str]) -> None:
    """Stop the agent (its engines keep running), give it an agent.yaml naming ``servers``
    only, and start it again."""
    assert agent.proc is not None
    stop_process(agent.proc)
    cfg = yaml.safe_load(agent.config.read_text())
    cfg["servers"] = servers
    agent.config.write_text(yaml.safe_dump(cfg))
    runs = len(list(agent.dir.glob("agent.log.*")))
    agent.log_path.rename(agent.dir / f"agent.log.{runs + 1}")  # the log reads this run's
    start_agent(agent)


def _connected_to(agent: Agent) -> list[str]:
    """The servers this run of the agent was welcomed by (its log's fields)."""
    return [
        line.split(" server=", 1)[1].split()[0]
        for line in agent.log().splitlines()
        if "connected to the control plane" in line and " server=" in line
    ]


def test_a_restarted_agent_reaches_the_leader_through_the_address_it_learnt(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    grpc_port = free_port()
    advertised = f"127.0.0.2:{grpc_port}"
    leader = _server(tmp_path, "leader", state, f"0.0.0.0:{grpc_port}", advertise=["127.0.0.2"])
    procs = [leader.proc]
    agent: Agent | None = None
    try:
        wait_for(lambda: _health(leader) == 200, what="leader up")
        standby = _server(tmp_path, "standby", state, f"127.0.0.1:{free_port()}")
        procs.append(standby.proc)
        wait_for(lambda: _health(standby) == 503, what="standby up")
        gone = f"127.0.0.1:{free_port()}"

        # 1. agent.yaml names the standby only: refused, sent to the leader, which it
        # reaches at the advertised address and whose list it keeps.
        agent = make_agent(
            tmp_path,
            leader,
            "node-l",
            extra={
                "servers": [f"127.0.0.1:{standby.grpc_port}"],
                "stop_shards_on_exit": False,
            },
        )
        start_agent(agent)
        wait_for(lambda: any(n["connected"] for n in leader.nodes()), timeout=60, what="agent on")
        learnt = agent.dir / "state" / "servers.json"
        wait_for(learnt.exists, what="servers.json")
        assert json.loads(learnt.read_text()) == {"servers": [advertised]}
        assert (learnt.stat().st_mode & 0o777) == 0o600
        log = agent.log()
        assert "control plane is a standby; moving to the leader it names" in log
        assert _connected_to(agent) == [advertised]
        assert LEARNT in log
        leader.approve_pending(1)
        leader.api("POST", "/api/models", {"name": "m", "engine": "sim", "replicas": 1})
        before = wait_for(
            lambda: next((r for r in leader.replicas("m") if r["routable"]), None),
            timeout=60,
            what="a routable replica",
        )

        # 2. Restarted with an agent.yaml that names only an address where nothing
        # listens: it dials that, then the learnt address, and the leader has it back.
        _restart(agent, [gone])
        wait_for(lambda: _connected_to(agent), timeout=60, what="the restarted agent welcomed")
        assert _connected_to(agent) == [advertised]
        log = agent.log()
        assert f"{gone} unavailable" in log
        assert "standby" not in log  # the standby is neither a seed nor learnt any more
        after = wait_for(
            lambda: next((r for r in leader.replicas("m") if r["routable"]), None),
            timeout=60,
            what="the replica routable again",
        )
        assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])
        assert json.loads(learnt.read_text()) == {"servers": [advertised]}

        # 3. A corrupt file is logged and never fatal: the seed is dialled, and the leader's
        # list replaces the file.
        learnt.write_text("{half a file")
        _restart(agent, [gone, f"127.0.0.1:{grpc_port}"])
        wait_for(lambda: _connected_to(agent), timeout=60, what="the agent welcomed again")
        assert _connected_to(agent) == [f"127.0.0.1:{grpc_port}"]
        assert "the control planes learnt before are unreadable" in agent.log()
        wait_for(lambda: learnt.read_text().startswith("{\n"), what="servers.json written again")
        assert json.loads(learnt.read_text()) == {"servers": [advertised]}
        again = wait_for(
            lambda: next((r for r in leader.replicas("m") if r["routable"]), None),
            timeout=60,
            what="the replica routable once more",
        )
        assert (again["pid"], again["restarts"]) == (before["pid"], before["restarts"])
    finally:
        if agent is not None:
            if agent.proc is not None:
                stop_process(agent.proc)
            for rec in agent.shard_records().values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rec["pid"], signal.SIGKILL)
        for proc in reversed(procs):
            stop_process(proc)
