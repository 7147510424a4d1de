"""Shell completion of values from a real control plane (issue 20): ``llmgw ctl approve
<TAB>`` offers the pending nodes and no approved one, ``drain`` every node, and with the
control plane unreachable a TAB offers nothing and prints nothing. Each completion is a real
``llmgw`` run the way click's bash script calls it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.harness import Server, make_agent, start_agent, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[2]
# The installed command (the venv's, from this checkout): completion keys on the program's
# name, which 'python -m llmgw' would not give.
LLMGW_SCRIPT = Path(sys.executable).parent / "llmgw"


def complete(*words: str, server: str, token: str) -> tuple[list[str], str, float]:
    """What bash's completion function gets for ``llmgw ctl --server S --token T WORDS``
    (the last word the one being completed): the values, stderr, and the seconds it took."""
    line = ["llmgw", "ctl", "--server", server, "--token", token, *words]
    env = {
        **os.environ,
        "_LLMGW_COMPLETE": "bash_complete",
        "COMP_WORDS": " ".join(line),
        "COMP_CWORD": str(len(line) - 1),
        "PYTHONPATH": str(ROOT),
    }
    started = time.monotonic()
    result = subprocess.run(
        [str(LLMGW_SCRIPT), *line[1:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    values = [row.split(",", 1)[1] for row in result.stdout.splitlines() if "," in row]
    return values, result.stderr, took


def test_approve_offers_pending_nodes_and_drain_every_node(server: Server, tmp_path: Path) -> None:
    agents = [start_agent(make_agent(tmp_path, server, name)) for name in ("gpu-01", "gpu-02")]
    try:
        wait_for(
            lambda: len([n for n in server.nodes() if n["connected"]]) == 2 or None,
            what="two nodes connected",
        )
        server.approve("gpu-01")
        token = server.admin_token
        assert complete("approve", "", server=server.url, token=token)[0] == ["gpu-02"]
        assert complete("reject", "gpu", server=server.url, token=token)[0] == ["gpu-02"]
        assert sorted(complete("drain", "", server=server.url, token=token)[0]) == [
            "gpu-01",
            "gpu-02",
        ]
        assert complete("drain", "gpu-01", server=server.url, token=token)[0] == ["gpu-01"]
        # Subcommands and options come from click itself.
        assert "approve" in complete("ap", server=server.url, token=token)[0]
        assert "--fingerprint" in complete("approve", "--", server=server.url, token=token)[0]
        server.api("POST", "/api/models", {"name": "tiny", "engine": "sim", "replicas": 0})
        assert complete("undeploy", "t", server=server.url, token=token)[0] == ["tiny"]
    finally:
        for agent in agents:
            if agent.proc is not None:
                stop_process(agent.proc)


def test_an_unreachable_control_plane_offers_nothing_and_prints_nothing(tmp_path: Path) -> None:
    values, stderr, took = complete("approve", "", server="http://127.0.0.1:9", token="not-a-token")
    assert values == [] and stderr == ""
    assert took < 30  # generous: the client's timeout is one second
    # A wrong token is the same: nothing, silently.
    values, stderr, _ = complete("approve", "", server="http://10.255.255.1:9", token="x")
    assert values == [] and stderr == ""
