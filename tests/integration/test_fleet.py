"""A control plane with two real agents: balancing, failure and restart, cancellation."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


@dataclass
class Fleet:
    server: Server
    agents: list[Agent]
    key: str

    @property
    def base_url(self) -> str:
        return self.server.url + "/v1"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("fleet")
    server = start_server(tmp)
    agents: list[Agent] = []
    try:
        for name in ("gpu-a", "gpu-b"):
            agents.append(start_agent(make_agent(tmp, server, name)))
        wait_for(
            lambda: sorted(n["id"] for n in server.nodes() if n["connected"]) == ["gpu-a", "gpu-b"],
            what="both agents connected",
        )
        assert sorted(server.approve_pending(2)) == ["gpu-a", "gpu-b"]
        server.api("POST", "/api/models", {"name": "m", "engine": "sim", "replicas": 2})
        wait_for(
            lambda: [r["state"] for r in server.replicas("m")] == ["ready", "ready"],
            what="two ready replicas",
        )
        yield Fleet(server, agents, server.api_key())
    finally:
        for agent in agents:
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)


def test_two_replicas_land_on_two_agents_and_both_get_traffic(fleet: Fleet) -> None:
    replicas = fleet.server.replicas("m")
    assert sorted(r["node"] for r in replicas) == ["gpu-a", "gpu-b"]
    client = openai.OpenAI(base_url=fleet.base_url, api_key=fleet.key)
    for i in range(20):
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=2
        )
    metrics = fleet.server.metrics()
    served: Counter[str] = Counter()
    for line in metrics.splitlines():
        if line.startswith('llmgw_requests_total{model="m"'):
            replica = line.split('replica="')[1].split('"')[0]
            served[replica] += int(float(line.rsplit(" ", 1)[1]))
    assert set(served) == {r["replica"] for r in replicas}
    assert all(count >= 3 for count in served.values()), served


def test_killed_engine_is_reported_failed_with_exit_code_and_restarted(fleet: Fleet) -> None:
    victim = fleet.server.replicas("m")[0]
    os.kill(victim["pid"], signal.SIGKILL)

    def failed_event() -> list[dict[str, object]]:
        events = fleet.server.api("GET", f"/api/events?subject={victim['shard']}")
        return [e for e in events if e["kind"] == "shard_failed"]

    events = wait_for(failed_event, what="shard_failed event")
    assert "killed by signal 9" in str(events[0]["message"])

    def restarted() -> dict[str, object] | None:
        for r in fleet.server.replicas("m"):
            if (
                r["shard"] == victim["shard"]
                and r["state"] == "ready"
                and r["pid"] != victim["pid"]
            ):
                return r
        return None

    again = wait_for(restarted, timeout=30, what="the replica to be started again")
    assert again["restarts"] == victim["restarts"] + 1
    assert again["exit_code"] is None or again["exit_code"] == -9
    kinds = [e["kind"] for e in fleet.server.api("GET", f"/api/events?subject={victim['shard']}")]
    assert "shard_restart" in kinds and "shard_ready" in kinds
    # Traffic flows again through every replica.
    client = openai.OpenAI(base_url=fleet.base_url, api_key=fleet.key)
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "back?"}])
    assert out.choices[0].message.content


def test_failed_exit_code_is_recorded(fleet: Fleet) -> None:
    victim = fleet.server.replicas("m")[1]
    os.kill(victim["pid"], signal.SIGTERM)

    def seen_failed() -> bool:
        events = fleet.server.api("GET", f"/api/events?subject={victim['shard']}")
        return any(e["kind"] == "shard_failed" for e in events)

    wait_for(seen_failed, what="shard_failed after SIGTERM")
    wait_for(
        lambda: any(
            r["shard"] == victim["shard"] and r["state"] == "ready"
            for r in fleet.server.replicas("m")
        ),
        timeout=30,
        what="restart after SIGTERM",
    )


def test_client_disconnect_cancels_the_upstream_request(fleet: Fleet) -> None:
    server = fleet.server
    server.api(
        "POST",
        "/api/models",
        {"name": "slow", "engine": "sim", "replicas": 1, "params": {"tps": 5}},
    )
    try:
        wait_for(
            lambda: [r["state"] for r in server.replicas("slow")] == ["ready"], what="slow ready"
        )
        client = openai.OpenAI(base_url=fleet.base_url, api_key=fleet.key)
        # 64 tokens at 5 tokens/s would take ~13 s; we leave after two chunks.
        stream = client.chat.completions.create(
            model="slow", messages=[{"role": "user", "content": "long"}], max_tokens=64, stream=True
        )
        it = iter(stream)
        next(it)
        next(it)
        assert server.replicas("slow")[0]["inflight"] == 1
        stream.close()
        wait_for(
            lambda: server.replicas("slow")[0]["inflight"] == 0, timeout=8, what="in-flight to drop"
        )
    finally:
        server.api("DELETE", "/api/models/slow")


def test_no_ready_replica_is_503_with_retry_after_and_the_reason(fleet: Fleet) -> None:
    server = fleet.server
    server.api(
        "POST",
        "/api/models",
        {
            "name": "big",
            "engine": "vllm",
            "source": "/srv/llmgw/models/big",
            "gpus": 1,
            "replicas": 1,
        },
    )
    try:
        req = urllib.request.Request(
            server.url + "/v1/chat/completions",
            data=json.dumps(
                {"model": "big", "messages": [{"role": "user", "content": "x"}]}
            ).encode(),
            headers={"Authorization": f"Bearer {fleet.key}", "Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=5)
        assert info.value.code == 503
        assert info.value.headers["Retry-After"] == "5"
        body = json.loads(info.value.read())
        assert body["error"]["code"] == "model_not_ready"
        models = {m["name"]: m for m in server.api("GET", "/api/models")}
        wait_for(lambda: server.api("GET", "/api/models"), what="models")
        problem = wait_for(
            lambda: {m["name"]: m for m in server.api("GET", "/api/models")}["big"]["unplaceable"],
            what="unplaceable reason",
        )
        assert (
            "gpu-a: engine vllm not offered (installed: sim)" in problem
            and "gpu-b: engine vllm not offered (installed: sim)" in problem
        )
        assert models["big"]["ready"] == 0
    finally:
        server.api("DELETE", "/api/models/big")


def test_ctl_tables_and_json(fleet: Fleet, tmp_path: Path) -> None:
    env = dict(
        os.environ,
        LLMGW_SERVER=fleet.server.url,
        LLMGW_TOKEN=fleet.server.admin_token,
        XDG_CONFIG_HOME=str(tmp_path),
    )

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=30
        )

    out = ctl("replicas", "m")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == [
        "REPLICA",
        "MODEL",
        "ROLE",  # a disaggregated model's pool (prefill, decode); "-" for the others
        "STATE",
        "NODE",
        "PORT",
        "RESTARTS",
        "INFLIGHT",
        "REASON",
    ]
    # Columns are aligned: every row starts its MODEL column where the header does.
    col = lines[0].index("MODEL")
    assert all(line[col : col + 1] == "m" for line in lines[1:])
    data = json.loads(ctl("--json", "models").stdout)
    assert {"name": "m", "replicas": 2}.items() <= {
        k: v for k, v in data[0].items() if k in ("name", "replicas")
    }.items()

    created = ctl("keys", "create", "ci-bot")
    assert created.returncode == 0
    secret = created.stdout.splitlines()[1]
    assert secret.startswith("sk-llmgw-")
    key_id = created.stdout.split()[2]
    client = openai.OpenAI(base_url=fleet.base_url, api_key=secret, max_retries=0)
    assert [m.id for m in client.models.list()]
    listed = ctl("keys", "list")
    assert "ci-bot" in listed.stdout and secret not in listed.stdout
    assert ctl("keys", "revoke", key_id).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    again = ctl("keys", "revoke", key_id)
    assert again.returncode == 1 and "already revoked" in again.stderr

    missing = ctl("undeploy", "nope")
    assert missing.returncode == 1
    assert "no model named nope" in missing.stderr

    bad = subprocess.run(
        [*LLMGW, "ctl", "--server", "http://127.0.0.1:9", "nodes"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 1
    assert "cannot reach a control plane; tried:" in bad.stderr
    assert "http://127.0.0.1:9 (from --server/LLMGW_SERVER)" in bad.stderr


def test_scale_down_and_undeploy_stop_the_engines(fleet: Fleet) -> None:
    server = fleet.server
    server.api("POST", "/api/models", {"name": "tmp", "engine": "sim", "replicas": 2})
    wait_for(
        lambda: [r["state"] for r in server.replicas("tmp")] == ["ready", "ready"], what="tmp ready"
    )
    pids = [r["pid"] for r in server.replicas("tmp")]
    server.api("POST", "/api/models", {"name": "tmp", "engine": "sim", "replicas": 1})
    wait_for(lambda: len(server.replicas("tmp")) == 1, what="scale down")
    server.api("DELETE", "/api/models/tmp")

    def gone(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    for pid in pids:
        wait_for(lambda pid=pid: gone(pid), timeout=20, what=f"engine {pid} to stop")
