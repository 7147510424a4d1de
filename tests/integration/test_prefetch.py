"""``prefetch: true`` end to end: a real control plane and two agents, only one of which has
the model's source under its models_root; the leader names the source to that node alone,
its agent reads it into the page cache and reports it warm, and `ctl nodes` shows it, with
no replica running (the model is at zero)."""

from __future__ import annotations

import os
import subprocess
import textwrap
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
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

SIZE = 3 * 1024 * 1024


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Server, dict[str, Agent]]]:
    server = start_server(tmp_path)
    roots = {"a": tmp_path / "models-a", "b": tmp_path / "models-b"}
    roots["a"].mkdir()
    weights = roots["b"] / "org" / "tiny"
    weights.mkdir(parents=True)
    (weights / "model.safetensors").write_bytes(os.urandom(SIZE))
    (weights / "config.json").write_text("{}")
    agents = {}
    for name, root in roots.items():
        extra = {"models_root": str(root), "cache_root": str(tmp_path / f"cache-{name}")}
        agents[name] = start_agent(make_agent(tmp_path, server, name, extra=extra))
    try:
        wait_for(
            lambda: sum(n["connected"] for n in server.nodes()) == 2, what="both agents", timeout=30
        )
        server.approve_pending(2)
        yield server, agents
    finally:
        for agent in agents.values():
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(server.proc)


def ctl(server: Server, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(
        LLMGW_SERVER=server.url, LLMGW_TOKEN=server.admin_token, XDG_CONFIG_HOME=str(tmp / "xdg")
    )
    return subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60
    )


def _warm(server: Server, node: str) -> list[dict[str, Any]]:
    return list(server.api("GET", f"/api/nodes/{node}").get("warm") or [])


def test_an_agent_keeps_a_prefetch_models_source_warm(
    fleet: tuple[Server, dict[str, Agent]], tmp_path: Path
) -> None:
    server, _agents = fleet
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(
        textwrap.dedent(
            """\
            models:
              tiny:
                replicas: {min: 0, max: 2, prefetch: true}
                profiles:
                  default: {engine: sim, source: org/tiny}
            """
        )
    )
    applied = ctl(server, tmp_path, "models", "apply", "-f", str(catalog))
    assert applied.returncode == 0, applied.stderr
    deployed = ctl(server, tmp_path, "deploy", "tiny")
    assert deployed.returncode == 0, deployed.stderr

    def warm_on_b() -> dict[str, Any] | None:
        found = [w for w in _warm(server, "b") if w["state"] == "warm"]
        return found[0] if found else None

    status = wait_for(warm_on_b, what="org/tiny warm on b", timeout=90)
    assert status["source"] == "org/tiny"
    assert status["bytes"] == SIZE + 2  # the weights and config.json ("{}")
    assert status["last_pass_at"] > 0 and status["reason"] == ""
    assert _warm(server, "a") == []  # a has no org/tiny: placement would not put it there
    assert server.replicas("tiny") == []  # warm with no replica: at zero

    shown = ctl(server, tmp_path, "nodes", "b")
    assert shown.returncode == 0, shown.stderr
    assert "warm sources (prefetch: kept in the page cache):\n  - org/tiny: warm, " in shown.stdout
    models = ctl(server, tmp_path, "models")
    assert "0 (0-2, prefetch)" in models.stdout

    # Prefetch turned off: the next ack names nothing, and b stops keeping it.
    off = ctl(server, tmp_path, "deploy", "tiny", "--replicas", "0-2", "--no-prefetch")
    assert off.returncode == 0, off.stderr
    wait_for(lambda: _warm(server, "b") == [], what="b no longer warming", timeout=40)
