"""What the docker runtime's integration tests share (test_docker_runtime.py,
test_docker_proxy.py): this run's node label, a ``sim`` launch in a container, waits on its
health, and the whole path through the gateway. The ``api`` and ``image`` fixtures are in
conftest.py."""

from __future__ import annotations

import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import docker.errors
import openai
import pytest

from llmgw.agent.runtimes.base import Launch
from llmgw.agent.runtimes.containers import launch_for
from llmgw.agent.shards import ShardSpec, pick_port
from tests.integration.harness import Agent, Server, start_agent

IMAGE_ENV = "LLMGW_TEST_DOCKER_IMAGE"
DEFAULT_IMAGE = "llmgw-test-engine:local"
NODE = f"dtest-{uuid.uuid4().hex[:8]}"  # this run's containers; runs may share a dockerd
CLUSTER = "test-cluster"
WAIT_S = 30.0


def sim_launch(tmp_path: Path, image: str, shard_id: str, **kwargs: Any) -> Launch:
    spec = ShardSpec(shard_id=shard_id, replica_id="r1", model="sim-model", engine="sim")
    return launch_for(
        spec,
        port=pick_port(),
        log_path=tmp_path / "logs" / f"{shard_id}.log",
        node_id=NODE,
        cluster_id=CLUSTER,
        images={"sim": image},
        **kwargs,
    )


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return int(resp.status)
    except OSError:
        return None


def wait_healthy(port: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if health(port) == 200:
            return
        time.sleep(0.1)
    pytest.fail(f"the sim in the container did not answer /health on 127.0.0.1:{port}")


def gone(api: Any, container_id: str) -> bool:
    try:
        api.inspect_container(container_id)
    except docker.errors.NotFound:
        return True
    return False


def serve_one_replica(server: Server, agent: Agent, model: str = "boxed") -> None:
    """Start ``agent``, approve it, deploy ``model`` (sim, one replica) and wait until the
    gateway routes to it and answers a chat."""
    start_agent(agent)
    deadline = time.monotonic() + WAIT_S
    while not any(n["connected"] for n in server.nodes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    server.approve_pending(1)
    server.api("POST", "/api/models", {"name": model, "engine": "sim", "replicas": 1})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = server.replicas(model)
        if rows and rows[0]["routable"]:
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"no routable replica: {server.replicas(model)}\n{agent.log()}")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key())
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content


def wait_adopted(server: Server, agent: Agent, model: str = "boxed") -> None:
    """After a restart of ``agent``: up to 60 s for ``model``'s replica to be routable again
    and the agent to say it adopted its shards (the caller asserts what it needs)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = server.replicas(model)
        if rows and rows[0]["routable"] and "shards after restart" in agent.log():
            break
        time.sleep(0.2)
