"""Process engines in their bubblewrap sandbox, end to end: a control plane and an agent
(real processes), the sim engine serving through the gateway to the official openai client
from inside its sandbox, and what it can open there (``--probe-path``): its own model, not
the agent's key, configuration or shard records, another model, another shard's scratch.
An engine that needs a path its sandbox hides fails naming the path and the profile key
that widens it; ``sandbox: false`` runs unconfined with a warning; a restarted agent adopts a
sandboxed engine and stops it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.ci import require_tools
from tests.integration.harness import (
    Agent,
    Server,
    cmdline,
    make_agent,
    pids_of_session,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

READY_S = 60.0


@dataclass
class Fleet:
    server: Server
    agent: Agent
    key: str
    models: Path
    data: Path

    @property
    def state(self) -> Path:
        return self.agent.dir / "state"

    def probes(self, *paths: Path | str) -> list[str]:
        out: list[str] = []
        for path in paths:
            out += ["--probe-path", str(path)]
        return out


def _catalog(fleet_dir: Path, agent: Agent) -> dict[str, Any]:
    data = fleet_dir / "data"
    needed = str(data / "needed.txt")
    probes = [
        "--probe-path",
        str(agent.dir / "pki" / "node.key"),
        "--probe-path",
        str(agent.config),
        "--probe-path",
        str(agent.dir / "state" / "shards.json"),
        "--probe-path",
        str(fleet_dir / "models" / "other" / "weights.bin"),
        "--probe-path",
        str(fleet_dir / "models" / "own" / "weights.bin"),
        "--probe-path",
        "/etc/llmgw",
        "--probe-path",
        "/etc/hostname",
    ]

    def sim(**extra: Any) -> dict[str, Any]:
        return {"profiles": {"default": {"engine": "sim", **extra}}}

    return {
        "models": {
            "boxed": sim(source="own", args=probes),
            "needs": sim(args=["--probe-path", needed, "--probe-required"]),
            "given": sim(
                args=["--probe-path", needed, "--probe-required"],
                sandbox={"extra_ro": [str(data)]},
            ),
            "open": sim(args=["--probe-path", str(agent.dir / "pki" / "node.key")], sandbox=False),
            "sided": sim(
                sidecars=[
                    {
                        "name": "peek",
                        "command": [sys.executable, "-c", SIDECAR, str(agent.dir / "pki")],
                        "ready_after": 0.5,
                    }
                ]
            ),
        }
    }


# A sidecar that says whether it can see the agent's key folder and where its HOME is, then
# keeps running (it is healthy once it has run for ready_after).
SIDECAR = """
import os, sys, time
print("key folder seen:", os.path.exists(sys.argv[1]), "home:", os.environ["HOME"], flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_tools("bwrap")
    tmp = tmp_path_factory.mktemp("sandbox")
    models = tmp / "models"
    for name in ("own", "other"):
        (models / name).mkdir(parents=True)
        (models / name / "weights.bin").write_bytes(b"\0" * 16)
    data = tmp / "data"
    data.mkdir()
    (data / "needed.txt").write_text("what the engine needs\n")
    server = start_server(tmp)
    agent = make_agent(tmp, server, "box-a", extra={"models_root": str(models)})
    start_agent(agent)
    try:
        wait_for(
            lambda: any(n["id"] == "box-a" and n["connected"] for n in server.nodes()),
            what="the agent connected",
        )
        assert server.approve_pending(1) == ["box-a"]
        server.api("PUT", "/api/catalog", _catalog(tmp, agent))
        yield Fleet(server, agent, server.api_key(), models, data)
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def deploy(fleet: Fleet, model: str, state: str = "ready") -> dict[str, Any]:
    fleet.server.api("POST", "/api/models", {"name": model, "profile": "default", "replicas": 1})

    def reached() -> dict[str, Any] | None:
        replicas = fleet.server.replicas(model)
        return replicas[0] if replicas and replicas[0]["state"] == state else None

    replica: dict[str, Any] = wait_for(reached, timeout=READY_S, what=f"{model} {state}")
    return replica


def undeploy(fleet: Fleet, model: str, pid: int) -> None:
    fleet.server.api("DELETE", f"/api/models/{model}")
    wait_for(lambda: not pids_of_session(pid), what=f"{model}'s sandbox gone")


def shard_log(fleet: Fleet, shard: str) -> str:
    return (fleet.state / "logs" / f"{shard}.log").read_text(errors="replace")


def probe_lines(log: str) -> dict[str, str]:
    seen: dict[str, str] = {}
    for line in log.splitlines():
        if "llmgw.sim.probe probe " in line:
            path, _, outcome = line.split("llmgw.sim.probe probe ", 1)[1].partition(": ")
            seen[path] = outcome
    return seen


def test_a_sandboxed_sim_serves_through_the_gateway_and_sees_only_what_it_needs(
    fleet: Fleet,
) -> None:
    replica = deploy(fleet, "boxed")
    client = openai.OpenAI(base_url=fleet.server.url + "/v1", api_key=fleet.key, max_retries=0)
    reply = client.chat.completions.create(
        model="boxed", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content
    # The recorded process is bubblewrap, leading the session the engine runs in.
    assert cmdline(replica["pid"]).startswith(("bwrap ", "/usr/bin/bwrap ")), cmdline(
        replica["pid"]
    )
    seen = probe_lines(shard_log(fleet, replica["shard"]))
    agent = fleet.agent
    hidden = [
        agent.dir / "pki" / "node.key",  # the node's key
        agent.config,  # its configuration
        agent.dir / "state" / "shards.json",  # its state directory
        fleet.models / "other" / "weights.bin",  # another model under models_root
    ]
    for path in hidden:
        assert seen[str(path)].startswith("cannot open: [Errno 2]"), (path, seen)
    assert seen["/etc/llmgw"].startswith("cannot open")
    assert seen[str(fleet.models / "own" / "weights.bin")] == "readable"
    assert seen["/etc/hostname"] == "readable"

    # Another shard's scratch: a second sandboxed engine cannot open the first one's.
    first_home = fleet.state / "scratch" / replica["shard"] / "home"
    assert first_home.is_dir()
    (first_home / "notes").write_text("the first shard's")
    fleet.server.api(
        "PUT",
        "/api/catalog",
        {
            "models": {
                "peek": {
                    "profiles": {
                        "default": {
                            "engine": "sim",
                            "args": ["--probe-path", str(first_home / "notes")],
                        }
                    }
                }
            }
        },
    )
    peek = deploy(fleet, "peek")
    assert probe_lines(shard_log(fleet, peek["shard"])) == {
        str(first_home / "notes"): (
            f"cannot open: [Errno 2] No such file or directory: '{first_home / 'notes'}'"
        )
    }
    undeploy(fleet, "peek", peek["pid"])
    assert not (fleet.state / "scratch" / peek["shard"]).exists()  # stopped for good


def test_an_engine_that_needs_a_hidden_path_fails_naming_it_and_extra_ro_widens_it(
    fleet: Fleet,
) -> None:
    needed = fleet.data / "needed.txt"
    failed = deploy(fleet, "needs", state="failed")
    assert failed["reason"].startswith(
        f"the engine could not open {needed}, which its sandbox hides; add it to the "
        "profile's sandbox.extra_ro (or sandbox.extra_rw for a path it writes); engine "
        "exited with code 1"
    ), failed["reason"]
    fleet.server.api("DELETE", "/api/models/needs")
    given = deploy(fleet, "given")
    assert probe_lines(shard_log(fleet, given["shard"])) == {str(needed): "readable"}
    undeploy(fleet, "given", given["pid"])


def test_sandbox_false_runs_the_engine_unconfined_and_says_so(fleet: Fleet) -> None:
    replica = deploy(fleet, "open")
    assert "bwrap" not in cmdline(replica["pid"]).split(" ", 1)[0]
    key = fleet.agent.dir / "pki" / "node.key"
    assert probe_lines(shard_log(fleet, replica["shard"])) == {str(key): "readable"}
    assert "engine not sandboxed: its profile says sandbox: false" in fleet.agent.log()
    undeploy(fleet, "open", replica["pid"])


def test_a_sidecar_runs_in_a_sandbox_of_its_own_with_the_shards_scratch(fleet: Fleet) -> None:
    replica = deploy(fleet, "sided")
    shard = replica["shard"]
    log = fleet.state / "logs" / f"{shard}.peek.log"
    wait_for(lambda: log.exists() and "key folder seen" in log.read_text(), what="the sidecar")
    home = fleet.state / "scratch" / shard / "home"
    assert log.read_text().splitlines()[-1] == f"key folder seen: False home: {home}"
    record = fleet.agent.shard_records()[shard]["sidecars"][0]
    assert record["sandboxed"] is True
    assert cmdline(record["pid"]).startswith(("bwrap ", "/usr/bin/bwrap "))
    undeploy(fleet, "sided", replica["pid"])
    wait_for(lambda: not pids_of_session(record["pid"]), what="the sidecar's sandbox gone")


def test_a_restarted_agent_adopts_the_sandboxed_engine_and_stops_it(fleet: Fleet) -> None:
    replica = next(r for r in fleet.server.replicas("boxed") if r["state"] == "ready")
    agent = fleet.agent
    assert agent.proc is not None
    stop_process(agent.proc, signal.SIGKILL)  # no drain, no stop: the engine runs on
    assert pids_of_session(replica["pid"])
    start_agent(agent)
    wait_for(
        lambda: "shard adopted" in agent.log() and f"pid={replica['pid']}" in agent.log(),
        what="the sandboxed engine adopted",
    )
    client = openai.OpenAI(base_url=fleet.server.url + "/v1", api_key=fleet.key, max_retries=2)
    wait_for(
        lambda: [r["state"] for r in fleet.server.replicas("boxed")] == ["ready"],
        timeout=READY_S,
        what="boxed ready again",
    )
    reply = client.chat.completions.create(
        model="boxed", messages=[{"role": "user", "content": "again"}], max_tokens=4
    )
    assert reply.choices[0].message.content
    assert fleet.server.replicas("boxed")[0]["pid"] == replica["pid"]  # the same engine
    undeploy(fleet, "boxed", replica["pid"])
    log = shard_log(fleet, replica["shard"])
    assert "sim engine shutting down" in log  # it had its SIGTERM, not only a SIGKILL
    assert not os.path.exists(fleet.state / "scratch" / replica["shard"])
