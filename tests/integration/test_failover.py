"""Several control planes: a standby refuses and names the leader; the agent follows."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.integration.harness import (
    LLMGW,
    Server,
    free_port,
    make_agent,
    start_agent,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


def _server(tmp: Path, name: str, state: Path) -> Server:
    http_port, grpc_port = free_port(), free_port()
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "state_dir": str(state),
                "http_listen": f"127.0.0.1:{http_port}",
                "grpc_listen": f"127.0.0.1:{grpc_port}",
                "enroll_listen": "127.0.0.1:0",
                "heartbeat_interval": 1.0,
                "loss_timeout": 3.0,
                "drain_grace": 0,  # no load balancer here: a stop waits for no grace
            }
        )
    )
    log_path = tmp / f"{name}.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([*LLMGW, "server", "--config", str(cfg)], stdout=out, stderr=out)
    return Server(state, http_port, grpc_port, proc, log_path)


def _health(server: Server) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(server.url + "/healthz", timeout=2) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


def test_agent_follows_the_leader_through_a_standby_and_a_dead_server(tmp_path: Path) -> None:
    state = tmp_path / "state"
    leader = _server(tmp_path, "a", state)
    procs = [leader.proc]
    try:
        wait_for(lambda: _health(leader)[0] == 200, what="leader up")
        standby = _server(tmp_path, "b", state)
        procs.append(standby.proc)
        _code, body = wait_for(lambda: (h := _health(standby))[0] == 503 and h, what="standby up")
        assert body["status"] == "standby"
        assert body["leader"] == leader.url

        dead = f"127.0.0.1:{free_port()}"
        agent = make_agent(
            tmp_path,
            leader,
            "node-f",
            extra={
                "servers": [dead, f"127.0.0.1:{standby.grpc_port}", f"127.0.0.1:{leader.grpc_port}"]
            },
        )
        start_agent(agent)
        assert agent.proc is not None
        procs.append(agent.proc)
        wait_for(
            lambda: any(n["connected"] for n in leader.nodes()),
            timeout=60,
            what="agent on the leader",
        )
        log = agent.log()
        assert f"{dead} unavailable" in log
        assert "control plane is a standby; moving to the leader it names" in log
        epoch1 = leader.api("GET", "/api/status")["epoch"]

        # The leader goes away: the standby takes over with a higher epoch and the agent follows.
        stop_process(leader.proc)
        wait_for(lambda: _health(standby)[0] == 200, timeout=30, what="standby promoted")
        status = standby.api("GET", "/api/status")
        assert status["epoch"] == epoch1 + 1
        wait_for(
            lambda: any(n["connected"] for n in standby.nodes()),
            timeout=60,
            what="agent on the new leader",
        )
        wait_for(
            lambda: (
                json.loads((agent.dir / "state" / "oplog.json").read_text())["max_epoch"]
                == epoch1 + 1
            ),
            what="the agent's fence raised to the new leader's epoch",
        )
        assert "the leader is gone; taking over" in standby.log()
    finally:
        for proc in reversed(procs):
            stop_process(proc)
