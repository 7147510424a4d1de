"""The agent keeps its engines across a control-plane restart and reconnects by itself."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import openai
import pytest

from tests.integration.harness import LLMGW, Server, make_agent, start_agent, stop_process, wait_for

pytestmark = pytest.mark.integration


def test_control_plane_restart_keeps_replicas_and_raises_the_fence(tmp_path: Path) -> None:
    from tests.integration import harness

    server = harness.start_server(tmp_path)
    agent = start_agent(make_agent(tmp_path, server, "node-r"))
    try:
        wait_for(lambda: any(n["connected"] for n in server.nodes()), what="agent connected")
        server.approve_pending(1)
        server.api("POST", "/api/models", {"name": "r", "engine": "sim", "replicas": 1})
        wait_for(lambda: [r["state"] for r in server.replicas("r")] == ["ready"], what="ready")
        before = server.replicas("r")[0]
        epoch1 = server.api("GET", "/api/status")["epoch"]
        oplog = json.loads((agent.dir / "state" / "oplog.json").read_text())
        assert oplog["max_epoch"] == epoch1
        assert len(oplog["applied"]) >= 1

        # Restart the control plane on the same ports and state directory.
        stop_process(server.proc)
        wait_for(lambda: "reconnecting" in agent.log(), what="the agent to notice")
        cfg = tmp_path / "server.yaml"
        with open(server.log_path, "ab") as out:
            server.proc = subprocess.Popen(
                [*LLMGW, "server", "--config", str(cfg)], stdout=out, stderr=out
            )
        wait_for(lambda: _status(server) is not None, what="server back")
        epoch2 = server.api("GET", "/api/status")["epoch"]
        assert epoch2 == epoch1 + 1
        wait_for(
            lambda: any(n["connected"] for n in server.nodes()),
            timeout=60,
            what="agent reconnected",
        )
        # The engine kept running and is routable again without a restart.
        after = wait_for(
            lambda: next((r for r in server.replicas("r") if r["routable"]), None),
            what="replica routable again",
        )
        assert after["pid"] == before["pid"]
        assert after["restarts"] == before["restarts"]
        key = server.api_key()
        out = openai.OpenAI(base_url=server.url + "/v1", api_key=key).chat.completions.create(
            model="r", messages=[{"role": "user", "content": "still there?"}]
        )
        assert out.choices[0].message.content
        wait_for(
            lambda: (
                json.loads((agent.dir / "state" / "oplog.json").read_text())["max_epoch"] == epoch2
            ),
            what="the agent to raise its fence",
        )
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def _status(server: Server) -> dict[str, object] | None:
    try:
        return server.api("GET", "/api/status")  # type: ignore[no-any-return]
    except OSError:
        return None
