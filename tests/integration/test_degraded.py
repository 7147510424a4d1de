"""A degraded node (DESIGN §5): an agent whose llama.cpp will not run says so with its reason;
the control plane shows it degraded (admin API, events, ``ctl nodes``), keeps llama.cpp models
off it, and still places sim there, which serves through the gateway. Fixed and restarted,
the node is healthy again and takes the llama.cpp model."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BROKEN = FIXTURES / "engines" / "missing-lib"  # fails as a CUDA build without libcudart does
WORKS = FIXTURES / "engines" / "works"  # answers --version as llama-server does


@pytest.fixture
def degraded(tmp_path: Path) -> Iterator[tuple[Server, Agent]]:
    server = start_server(tmp_path)
    agent = start_agent(
        make_agent(
            tmp_path,
            server,
            "deg-a",
            extra={
                "engines": {"llamacpp": {"bin": str(BROKEN)}},
                "models_root": str(tmp_path / "models"),
            },
        )
    )
    try:
        server.approve_pending(1)
        yield server, agent
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def _node(server: Server) -> dict[str, object]:
    return server.api("GET", "/api/nodes/deg-a")  # type: ignore[no-any-return]


def test_a_node_with_a_broken_engine_is_degraded_for_it_alone(
    degraded: tuple[Server, Agent], tmp_path: Path
) -> None:
    server, agent = degraded
    node = wait_for(
        lambda: (n := _node(server))["health"] == "degraded" and n,
        what="deg-a degraded",
    )
    assert node["state"] == "approved"  # health is beside the state, not one of them
    (reason,) = node["degraded"]  # type: ignore[misc]
    assert (reason["code"], reason["engine"]) == ("engine", "llamacpp")
    assert reason["message"].startswith(f"engine llamacpp ({BROKEN}) will not run: ")
    assert "libcudart.so.12" in reason["message"]
    assert "llmgw ctl engines install deg-a llamacpp" in reason["message"]
    events = server.api("GET", "/api/events?subject=deg-a&limit=50")
    assert [e["message"] for e in events if e["kind"] == "node_degraded"] == [reason["message"]]

    # llama.cpp models are kept off it, and the reason says why (its weights are there: the
    # source check of placement passes).
    models_root = Path(yaml.safe_load(agent.config.read_text())["models_root"])
    models_root.mkdir(parents=True, exist_ok=True)
    (models_root / "m.gguf").write_bytes(b"GGUF")
    server.api(
        "POST",
        "/api/models",
        {"name": "gg", "engine": "llamacpp", "replicas": 1, "source": "m.gguf"},
    )
    model = wait_for(
        lambda: next(
            (m for m in server.api("GET", "/api/models") if m["name"] == "gg" and m["unplaceable"]),
            None,
        ),
        what="gg unplaceable",
    )
    assert model["unplaceable"].startswith("deg-a: degraded: engine llamacpp")
    assert server.replicas("gg") == []

    # sim still goes there, and serves.
    server.api("POST", "/api/models", {"name": "s", "engine": "sim", "replicas": 1})
    wait_for(
        lambda: [(r["node"], r["routable"]) for r in server.replicas("s")] == [("deg-a", True)],
        what="sim ready on deg-a",
    )
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key())
    out = client.chat.completions.create(model="s", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content
    assert server.replicas("gg") == []

    # What the operator reads.
    env = dict(
        os.environ,
        LLMGW_SERVER=server.url,
        LLMGW_TOKEN=server.admin_token,
        XDG_CONFIG_HOME=str(tmp_path),
    )
    listing = subprocess.run(
        [*LLMGW, "ctl", "nodes"], capture_output=True, text=True, env=env, timeout=60
    )
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[1].split()[:4] == ["deg-a", "approved", "degraded", "yes"]
    assert (
        "deg-a is degraded (engine llamacpp); 'llmgw ctl nodes deg-a' says what to fix"
        in listing.stdout
    )
    detail = subprocess.run(
        [*LLMGW, "ctl", "nodes", "deg-a"], capture_output=True, text=True, env=env, timeout=60
    )
    assert detail.returncode == 0, detail.stderr
    assert "health:       degraded" in detail.stdout
    assert f"  - engine llamacpp: {reason['message']}" in detail.stdout

    # Fixed (agent.yaml points at a llama-server that runs) and restarted: healthy again,
    # said in an event, and the llama.cpp model goes there.
    assert agent.proc is not None
    stop_process(agent.proc)
    config = yaml.safe_load(agent.config.read_text())
    config["engines"]["llamacpp"]["bin"] = str(WORKS)
    agent.config.write_text(yaml.safe_dump(config))
    start_agent(agent)
    wait_for(lambda: _node(server)["health"] == "healthy", what="deg-a healthy again")
    assert _node(server)["degraded"] == []
    events = server.api("GET", "/api/events?subject=deg-a&limit=100")
    assert [e["message"] for e in events if e["kind"] == "node_healthy"] == [
        f"no longer degraded (was: {reason['message']})"
    ]
    # (This stand-in exits at once, so the replica fails and is restarted; it was placed.)
    wait_for(
        lambda: [r["node"] for r in server.replicas("gg")] == ["deg-a"],
        what="gg placed on deg-a",
    )
