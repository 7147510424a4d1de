"""Serving by demand with a real control plane, agent and sim engines, through the official
``openai`` client: a model at zero gets a replica for the request that waits for it; a model
with no room is refused at once with why; a model scales up under load and back down after
its window, its retired replicas drained first, with no failed request."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    Agent,
    Client,
    Server,
    make_agent,
    run_ctl,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

ONE_GPU = Path(__file__).resolve().parent.parent / "fixtures" / "nvidia-smi" / "one-gpu"


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server: Server = start_server(tmp)
        self.agent: Agent = start_agent(
            make_agent(tmp, self.server, "dm-a", extra={"discovery": {"nvidia_smi": str(ONE_GPU)}})
        )
        wait_for(lambda: any(n["connected"] for n in self.server.nodes()), what="agent")
        self.server.approve_pending(1)
        wait_for(lambda: any(n["engines"] for n in self.server.nodes()), what="agent with engines")
        self.key = self.server.api_key()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.server.url + "/v1", api_key=self.key, max_retries=0, timeout=120
        )

    def deploy(self, name: str, replicas: Any, **extra: Any) -> dict[str, Any]:
        body = {"name": name, "engine": "sim", "replicas": replicas, **extra}
        return dict(self.server.api("POST", "/api/models", body))

    def model(self, name: str) -> dict[str, Any]:
        return next(m for m in self.server.api("GET", "/api/models") if m["name"] == name)

    def events(self, subject: str) -> list[dict[str, Any]]:
        return list(self.server.api("GET", f"/api/events?subject={subject}&limit=200"))

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_ctl(self.server, self.tmp / "xdg", *args)

    def stop(self) -> None:
        if self.agent.proc is not None:
            stop_process(self.agent.proc)
        for rec in self.agent.shard_records().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec["pid"], signal.SIGKILL)
        stop_process(self.server.proc)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("demand"))
    try:
        yield f
    finally:
        f.stop()


def test_a_model_at_zero_is_started_for_the_request_that_waits_and_others_refused_at_once(
    fleet: Fleet,
) -> None:
    # The node's one GPU for "cold", which takes 2 s to load; "big" wants it too.
    policy = {"min": 0, "max": 1, "scale_down_after": "2s"}
    deployed = fleet.deploy("cold", policy, gpus=1, params={"load_s": 2, "tps": 500})
    assert deployed["replicas"] == 0 and deployed["scaling"]["min"] == 0
    fleet.deploy("big", {"min": 0, "max": 1}, gpus=1)
    assert fleet.server.replicas("cold") == []
    listed = fleet.ctl("models")
    assert listed.returncode == 0, listed.stderr
    assert "0 (0-1)" in listed.stdout

    client = fleet.client()
    # Listed at zero: the first request starts it.
    assert {"cold", "big"} <= {m.id for m in client.models.list()}
    began = time.monotonic()
    out = client.chat.completions.create(
        model="cold", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    waited = time.monotonic() - began
    assert out.choices[0].message.content
    assert waited >= 2.0  # the engine's load: the request waited for it, was not refused
    up = [e["message"] for e in fleet.events("cold") if e["kind"] == "scaled_up"]
    assert up == [
        "cold 0 → 1: 0 in flight + 0 queued + 1 waiting for a replica, target 8 per replica"
    ]
    metrics = fleet.server.metrics()
    assert 'llmgw_capacity_wait_seconds_count{model="cold"} 1' in metrics
    # The start in its two parts: the engine's (its 2 s load, as the agent measured it)
    # and llmgw's (the rest, placement to routable).
    assert 'llmgw_replica_start_seconds_count{model="cold",part="llmgw"} 1' in metrics
    engine = metrics.split('llmgw_replica_start_seconds_sum{model="cold",part="engine"} ')[1]
    assert float(engine.split()[0]) >= 2.0
    ready = [e["message"] for e in fleet.events("") if e["kind"] == "shard_ready"]
    assert any("after placement (engine 2." in m for m in ready), ready

    # No GPU left for "big": refused at once, with why and when to retry.
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert time.monotonic() - began < 30  # not its cold_start_timeout (5 min)
    assert refused.value.status_code == 503
    assert refused.value.response.headers["Retry-After"] == "30"
    body = refused.value.response.json()["error"]
    assert body["code"] == "no_capacity"
    assert "none can be placed now: dm-a: 0 of 1 GPUs free, needs 1" in body["message"]

    # Idle for its window: "cold" goes back to zero, drained, and its GPU comes free; then a
    # request for "big" gets it.
    wait_for(lambda: fleet.model("cold")["replicas"] == 0, timeout=60, what="cold back to 0")
    wait_for(lambda: fleet.server.replicas("cold") == [], timeout=60, what="cold's replica gone")
    removed = [e["message"] for e in fleet.events("") if e["kind"] == "replica_removed"]
    assert any(m == "scaled cold to 0; its requests ended" for m in removed), removed
    out = client.chat.completions.create(
        model="big", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.choices[0].message.content


def test_load_scales_up_and_the_scale_down_fails_no_request(fleet: Fleet) -> None:
    # No GPU: as many replicas as wanted fit on the node.
    policy = {"min": 1, "max": 3, "target_inflight": 2, "scale_down_after": "3s"}
    fleet.deploy("busy", policy, params={"tps": 20})  # 8 tokens: ~0.4 s a request
    wait_for(lambda: fleet.model("busy")["ready"] == 1, timeout=60, what="busy's first replica")
    clients = [Client(fleet.server.url + "/v1", fleet.key, "busy") for _ in range(6)]
    for c in clients:
        c.start()
    try:
        wait_for(lambda: fleet.model("busy")["ready"] == 3, timeout=90, what="scaled up to 3")
    finally:
        for c in clients[1:]:
            c.stop.set()
    # One client goes on through the scale-down: every one of its requests answered.
    wait_for(lambda: fleet.model("busy")["replicas"] == 1, timeout=90, what="scaled down to 1")
    wait_for(lambda: len(fleet.server.replicas("busy")) == 1, timeout=90, what="retired ones gone")
    time.sleep(1)
    clients[0].stop.set()
    for c in clients:
        c.join(timeout=60)
    failures = [f for c in clients for f in c.failures]
    assert failures == []
    assert sum(c.ok for c in clients) > 20
    kinds = [e["kind"] for e in fleet.events("busy")]
    assert "scaled_up" in kinds and kinds.count("scaled_down") == 2
    metrics = fleet.server.metrics()
    assert 'llmgw_scaling_decisions_total{model="busy",direction="down",reason="idle"} 2' in (
        metrics
    )
    assert 'llmgw_desired_replicas{model="busy"} 1' in metrics


def test_a_client_that_gives_up_leaves_the_wait(fleet: Fleet) -> None:
    """A waiting request whose client goes away is no demand any more."""
    fleet.deploy("gone", {"min": 0, "max": 1}, params={"load_s": 30})
    client = openai.OpenAI(
        base_url=fleet.server.url + "/v1", api_key=fleet.key, max_retries=0, timeout=1.5
    )
    errors: list[Exception] = []

    def ask() -> None:
        try:
            client.chat.completions.create(
                model="gone", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        except Exception as exc:  # the client's own timeout
            errors.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    thread.join(timeout=30)
    assert errors and isinstance(errors[0], openai.APITimeoutError)
    wait_for(
        lambda: 'llmgw_capacity_waiting_requests{model="gone"} 0' in fleet.server.metrics(),
        timeout=30,
        what="the wait left",
    )


def test_a_stream_that_waits_for_a_cold_start_is_kept_alive_then_answered(fleet: Fleet) -> None:
    fleet.deploy("slow", {"min": 0, "max": 1}, params={"load_s": 2.5, "tps": 500})
    body = json.dumps(
        {
            "model": "slow",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        fleet.server.url + "/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {fleet.key}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        lines = [line.decode().rstrip("\n") for line in resp]
    comments = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data: ")]
    assert comments and comments[0] == ": waiting for a replica of slow to start"
    assert lines.index(comments[0]) < lines.index(data[0])  # before the answer, not in it
    assert data[-1] == "data: [DONE]"
    chunks = [json.loads(d[6:]) for d in data[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_a_high_priority_takes_the_gpu_from_a_normal_one(fleet: Fleet) -> None:
    # "big" (normal priority) holds the node's one GPU since the first test.
    wait_for(lambda: fleet.model("big")["ready"] == 1, timeout=60, what="big holds the GPU")
    deployed = fleet.ctl(
        "deploy", "vip", "--engine", "sim", "--replicas", "0-1", "--priority", "high"
    )
    assert deployed.returncode == 0, deployed.stderr
    fleet.server.api(
        "POST",
        "/api/models",
        {
            "name": "vip",
            "gpus": 1,
            "engine": "sim",
            "replicas": {"min": 0, "max": 1, "priority": "high"},
        },
    )
    out = fleet.client().chat.completions.create(
        model="vip", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.choices[0].message.content
    preempted = [e["message"] for e in fleet.events("big") if e["kind"] == "preempted"]
    assert preempted and "gives way to vip (priority high)" in preempted[0], preempted
    assert fleet.model("big")["replicas"] == 0


def test_a_catalog_model_scales_by_demand_as_the_catalog_says(fleet: Fleet) -> None:
    path = fleet.tmp / "catalog.yaml"
    path.write_text(
        "models:\n"
        "  listed:\n"
        "    replicas: {min: 0, max: 2, target_inflight: 4}\n"
        "    profiles:\n"
        "      default: {engine: sim, params: {tps: '500'}}\n"
    )
    applied = fleet.ctl("models", "apply", "-f", str(path))
    assert applied.returncode == 0, applied.stderr
    model = fleet.model("listed")
    assert (model["replicas"], model["scaling"]["max"]) == (0, 2)
    out = fleet.client().chat.completions.create(
        model="listed", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert out.choices[0].message.content
    events = [e["message"] for e in fleet.events("listed") if e["kind"] == "catalog_applied"]
    assert events == ["added: profiles default; 0-2 by demand (4 in flight each) replicas"]
