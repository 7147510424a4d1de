"""GPU health and cordon through a real control plane and agent, the agent's GPUs the NVML
stand-in's (tests/fixtures/nvml): a GPU cordoned moves its replica to another GPU of the
node, make-before-break, while the node's other replica keeps serving; a GPU that reports an
XID (NVML's event API) is marked unhealthy with an event and its replica rebuilt elsewhere.
One cluster for the module: the second test starts where the first left off."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    Agent,
    Server,
    make_agent,
    run_ctl,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "fixtures" / "nvml"
UUIDS = [f"GPU-7a1c0e2b-0000-4000-8000-00000000000{i}" for i in range(3)]


class Rig:
    def __init__(self, server: Server, agent: Agent, machine: Path, tmp: Path) -> None:
        self.server, self.agent, self.machine, self.tmp = server, agent, machine, tmp

    def placed(self) -> dict[str, tuple[list[str], bool]]:
        """replica -> (its GPUs, routable)."""
        return {r["replica"]: (r["gpus"], r["routable"]) for r in self.server.replicas("m")}

    def chat(self) -> str:
        client = openai.OpenAI(base_url=self.server.url + "/v1", api_key=self.key)
        out = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        return str(out.choices[0].message.content)

    def events(self, kind: str) -> list[dict[str, Any]]:
        events = self.server.api("GET", "/api/events?limit=200")
        return [e for e in reversed(events) if e["kind"] == kind]

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_ctl(self.server, self.tmp, *args)

    key = ""


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("gpuhealth")
    machine = tmp / "nvml-machine.json"
    machine.write_text(
        json.dumps(
            {
                "driver_version": "550.54.15",
                "gpus": [
                    {
                        "name": "NVIDIA H100 80GB HBM3",
                        "uuid": uuid,
                        "memory_total_mib": 81559,
                        "memory_used_mib": 0,
                    }
                    for uuid in UUIDS
                ],
            }
        )
    )
    server = start_server(tmp)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(STANDIN), str(ROOT)]),
        LLMGW_FAKE_NVML=str(machine),
    )
    agent = start_agent(make_agent(tmp, server, "g1"), env=env)
    try:
        server.approve_pending(1)
        wait_for(
            lambda: len(server.api("GET", "/api/nodes/g1/gpus")["gpus"]) == 3,
            what="g1's three GPUs (NVML)",
        )
        server.api(
            "POST",
            "/api/models",
            {
                "name": "m",
                "engine": "sim",
                "replicas": 2,
                "gpus": 1,
                "params": {"ttft_ms": "0", "tps": "5000", "max_tokens": "4"},
            },
        )
        rig = Rig(server, agent, machine, tmp)
        rig.key = server.api_key()
        wait_for(
            lambda: (p := rig.placed()) and len(p) == 2 and all(r for _g, r in p.values()),
            timeout=60,
            what="two replicas of m serving",
        )
        yield rig
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def test_a_cordoned_gpu_s_replica_moves_and_the_node_keeps_serving(rig: Rig) -> None:
    before = rig.placed()
    assert sorted(g for gpus, _r in before.values() for g in gpus) == UUIDS[:2]
    moved = next(r for r, (gpus, _) in before.items() if gpus == [UUIDS[0]])
    stays = next(r for r in before if r != moved)

    # Requests all along: make-before-break fails none of them.
    done, failures, answered = threading.Event(), [], []

    def load() -> None:
        while not done.is_set():
            try:
                answered.append(rig.chat())
            except Exception as exc:
                failures.append(repr(exc))

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    out = rig.ctl("gpus", "cordon", "g1", "0", "--reason", "fan noise")
    assert out.returncode == 0, out.stderr
    # The original serves until its replacement on GPU 2 is routable.
    try:
        after = wait_for(
            lambda: (p := rig.placed()) and moved not in p and len(p) == 2 and p,
            timeout=60,
            what="the replica on GPU 0 moved",
        )
    finally:
        done.set()
        loader.join(timeout=30)
    assert failures == []
    assert answered
    assert after[stays] == ([UUIDS[1]], True)
    [new] = [r for r in after if r != stays]
    assert after[new] == ([UUIDS[2]], True)
    assert rig.chat()
    moving = rig.events("gpu_moving")
    assert [e["message"] for e in moving] == [f"{moved} -> {new} (off a cordoned GPU)"]
    [cordoned] = rig.events("gpu_cordon")
    assert (cordoned["actor"], cordoned["message"]) == (
        "token",
        f"GPU 0 ({UUIDS[0]}) cordoned: fan noise",
    )

    listing = rig.ctl("gpus", "g1")
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[1:]]
    assert [(r[1], r[5]) for r in rows] == [("0", "cordoned"), ("1", "healthy"), ("2", "healthy")]
    wait_for(
        lambda: 'llmgw_gpus{state="cordoned"} 1' in rig.server.metrics(),
        what="the cordoned GPU on /metrics",
    )
    refused = rig.ctl("gpus", "cordon", "g1", "7")
    assert refused.returncode == 1
    assert f"node g1 has no GPU '7'; its GPUs: 0 ({UUIDS[0]})" in refused.stderr

    out = rig.ctl("gpus", "uncordon", "g1", "0")
    assert out.returncode == 0, out.stderr


def test_a_gpu_reporting_an_xid_is_unhealthy_and_its_replica_rebuilt(rig: Rig) -> None:
    before = rig.placed()
    on_gpu2 = next(r for r, (gpus, _) in before.items() if gpus == [UUIDS[2]])
    stays = next(r for r in before if r != on_gpu2)
    machine = json.loads(rig.machine.read_text())
    machine["gpus"][2]["xid_events"] = [79]
    rig.machine.write_text(json.dumps(machine))

    event = wait_for(
        lambda: next(iter(rig.events("gpu_unhealthy")), None), what="the GPU marked unhealthy"
    )
    assert event["subject"] == "g1"
    assert event["message"] == f"GPU 2 ({UUIDS[2]}) unhealthy: XID 79: GPU has fallen off the bus"
    after = wait_for(
        lambda: (
            (p := rig.placed())
            and on_gpu2 not in p
            and len(p) == 2
            and all(r for _g, r in p.values())
            and p
        ),
        timeout=60,
        what="the replica on GPU 2 rebuilt",
    )
    assert after[stays] == before[stays]  # the rest of the node kept serving
    [rebuilt] = [r for r in after if r != stays]
    assert after[rebuilt] == ([UUIDS[0]], True)
    assert rig.chat()
    gpus = rig.server.api("GET", "/api/nodes/g1/gpus")["gpus"]
    assert [(g["index"], g["state"]) for g in gpus] == [
        (0, "healthy"),
        (1, "healthy"),
        (2, "unhealthy"),
    ]
    removed = [e["message"] for e in rig.events("replica_removed") if e["subject"] == on_gpu2]
    assert removed == [
        f"GPU 2 ({UUIDS[2]}) of g1 is unhealthy: XID 79: GPU has fallen off the bus; "
        "rebuilding it elsewhere"
    ]
