"""Multi-node replicas through the control plane: real agents on InfiniBand fabrics (the
sysfs-shaped fixture), a ``nodes: 2`` sim profile from the catalog, the sim engine's real
TCP rendezvous, a worker killed and the replica rebuilt, and fabrics that keep a replica
unplaced until a second node of one fabric joins. The agents' GPUs (fake nvidia-smi) show
their utilisation in the admin API and ``ctl nodes``, live from the heartbeats.

Each agent has its own loopback address (127.0.0.x) as its management address, so that
rank 0's dist-init port is bound on "its node's" address, as it would be on a fleet.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    LLMGW,
    Agent,
    alive,
    free_port,
    listening,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
IB_ROOT = FIXTURES / "ib"  # mlx5_0 has an ACTIVE port
ONE_GPU = FIXTURES / "nvidia-smi" / "one-gpu"

CATALOG = """\
models:
  wide:
    profiles:
      two-nodes:
        engine: sim
        gpus: 1
        nodes: 2
        params: {ttft_ms: "0", tps: "5000", max_tokens: "8"}
"""


class Cluster:
    """A control plane and the agents started for one test; stops them all at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.server = start_server(tmp)
        self.agents: dict[str, Agent] = {}
        self._next_host = 2

    def add_node(self, node_id: str, fabric: str | None, *, nvidia_smi: Path = ONE_GPU) -> Agent:
        """Start an agent with one GPU (``nvidia_smi`` says which), on ``fabric`` (its
        adapter: the fixture's mlx5_0) or on none, with its own loopback address; approve
        it."""
        host = f"127.0.0.{self._next_host}"
        self._next_host += 1
        extra: dict[str, Any] = {
            "listen": f"{host}:{free_port()}",
            "mgmt_addr": host,
            "discovery": {"nvidia_smi": str(nvidia_smi), "ib_root": str(IB_ROOT)},
        }
        if fabric is not None:
            extra["fabrics"] = [{"name": fabric, "hcas": ["mlx5_0"]}]
        agent = start_agent(make_agent(self.tmp, self.server, node_id, extra=extra))
        self.agents[node_id] = agent
        wait_for(
            lambda: any(n["id"] == node_id and n["connected"] for n in self.server.nodes()),
            what=f"{node_id} connected",
        )
        assert self.server.approve_pending(1) == [node_id]
        wait_for(
            lambda: any(
                n["id"] == node_id and n["state"] == "approved" and n["engines"]
                for n in self.server.nodes()
            ),
            what=f"{node_id} approved with its engines",
        )
        return agent

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update(
            LLMGW_SERVER=self.server.url,
            LLMGW_TOKEN=self.server.admin_token,
            XDG_CONFIG_HOME=str(self.tmp / "xdg"),
        )
        return subprocess.run(
            [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60
        )

    def apply_and_deploy(self) -> None:
        path = self.tmp / "catalog.yaml"
        path.write_text(CATALOG)
        applied = self.ctl("models", "apply", "-f", str(path))
        assert applied.returncode == 0, applied.stderr
        deployed = self.ctl("deploy", "wide", "--profile", "two-nodes", "--replicas", "1")
        assert deployed.returncode == 0, deployed.stderr

    def shards(self) -> list[dict[str, Any]]:
        """``ctl replicas --json``: one entry per shard."""
        out = self.ctl("--json", "replicas")
        assert out.returncode == 0, out.stderr
        return sorted(json.loads(out.stdout), key=lambda s: (s["replica"], s["rank"]))

    def model(self) -> dict[str, Any]:
        return next(m for m in self.server.api("GET", "/api/models") if m["name"] == "wide")

    def close(self) -> None:
        for agent in self.agents.values():
            if agent.proc is not None:
                # A stopped agent (SIGSTOP) must be let go before it can stop.
                agent.proc.send_signal(signal.SIGCONT)
                stop_process(agent.proc)
        stop_process(self.server.proc)

    def logs(self) -> str:
        parts = [f"--- server\n{self.server.log()[-4000:]}"]
        for agent in self.agents.values():
            parts.append(f"--- {agent.node_id}\n{agent.log()[-3000:]}")
        return "\n".join(parts)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        print(c.logs())  # pytest shows it only when the test failed
        c.close()


def _complete(client: openai.OpenAI) -> str:
    done = client.completions.create(model="wide", prompt="hello there", max_tokens=4)
    assert done.model == "wide"
    return done.choices[0].text


def _ready_replica(c: Cluster, old: str | None = None) -> list[dict[str, Any]]:
    """The shards of the one replica once both are ready (another than ``old``)."""

    def ready() -> list[dict[str, Any]] | None:
        shards = c.shards()
        if (
            len(shards) == 2
            and all(s["state"] == "ready" for s in shards)
            and shards[0]["replica"] != old
            and shards[0]["routable"]
        ):
            return shards
        return None

    return wait_for(ready, timeout=60, what="both shards of a replica ready")


def test_two_node_replica_on_one_fabric_rebuilt_after_its_worker_dies(cluster: Cluster) -> None:
    c = cluster
    a = c.add_node("mn-a", "ib-a")
    b = c.add_node("mn-b", "ib-a")
    c.add_node("mn-c", "ib-b")  # alone on its fabric: never part of the replica
    key = c.server.api_key()
    client = openai.OpenAI(base_url=c.server.url + "/v1", api_key=key, max_retries=0)

    # The worker's agent is held still, so that rank 0 is seen waiting for it.
    assert b.proc is not None
    b.proc.send_signal(signal.SIGSTOP)
    try:
        c.apply_and_deploy()
        shards = wait_for(
            lambda: (s := c.shards()) and len(s) == 2 and s[0]["pid"] and s,
            what="rank 0 started",
        )
        # Both shards on the fabric that has two nodes; rank 0 first in id order.
        assert [(s["rank"], s["node"]) for s in shards] == [(0, "mn-a"), (1, "mn-b")]
        rank0 = shards[0]
        log0 = a.dir / "state" / "logs" / f"{rank0['shard']}.log"
        wait_for(
            lambda: log0.exists() and "waiting for 1 worker(s) on 127.0.0.2:" in log0.read_text(),
            what="rank 0 waiting for its worker",
        )
        # Rank 0 binds the dist-init port on its node's address and serves nothing yet.
        record = a.shard_records()[rank0["shard"]]
        dist_host, dist_port = record["dist_init_addr"].rsplit(":", 1)
        assert dist_host == "127.0.0.2"
        assert listening(int(dist_port), dist_host)
        assert not listening(record["port"])
        assert c.shards()[0]["state"] == "starting"
        with pytest.raises(openai.APIStatusError) as info:
            _complete(client)
        assert info.value.status_code == 503
    finally:
        b.proc.send_signal(signal.SIGCONT)

    first = _ready_replica(c)
    assert _complete(client)
    assert c.model()["unplaceable"] is None

    # Kill the worker's engine: rank 0 notices and exits, and the replica is rebuilt.
    worker_pid, rank0_pid = first[1]["pid"], first[0]["pid"]
    os.kill(worker_pid, signal.SIGKILL)
    wait_for(lambda: not alive(rank0_pid), timeout=30, what="rank 0 to exit")
    second = _ready_replica(c, old=first[0]["replica"])
    assert {s["node"] for s in second} == {"mn-a", "mn-b"}
    assert worker_pid not in {s["pid"] for s in second}
    assert _complete(client)
    events = c.server.api("GET", "/api/events?limit=200")
    removed = [
        e for e in events if e["kind"] == "replica_removed" and e["subject"] == first[0]["replica"]
    ]
    assert removed and "failed; rebuilding" in removed[0]["message"], events


def _utilisation(c: Cluster, node_id: str) -> list[int | None]:
    node = next(n for n in c.server.nodes() if n["id"] == node_id)
    return [g["utilization_percent"] for g in node["gpus"]]


def test_replica_waits_for_two_nodes_on_one_fabric(cluster: Cluster) -> None:
    c = cluster
    c.add_node("mn-a", "ib-a")
    # Its GPU's utilisation (the fake nvidia-smi says 37 %) comes with the heartbeats.
    wait_for(lambda: _utilisation(c, "mn-a") == [37], what="mn-a's GPU utilisation")
    assert [g["utilization_percent"] for g in c.server.api("GET", "/api/nodes/mn-a")["gpus"]] == [
        37
    ]
    c.add_node("mn-b", "ib-b")
    c.add_node("mn-n", None)
    c.apply_and_deploy()

    reason = wait_for(lambda: c.model()["unplaceable"], what="an unplaceable reason")
    assert reason == (
        "mn-n: no fabric (multi-node replicas need one); "
        "fabric ib-a: 1 of 1 node free, needs 2; fabric ib-b: 1 of 1 node free, needs 2"
    )
    assert c.shards() == []
    listed = c.ctl("models")
    assert "fabric ib-a: 1 of 1 node free, needs 2" in listed.stdout, listed.stdout

    # A second node on ib-b: the replica goes there.
    c.add_node("mn-c", "ib-b")
    shards = _ready_replica(c)
    assert [(s["rank"], s["node"]) for s in shards] == [(0, "mn-b"), (1, "mn-c")]
    assert c.model()["unplaceable"] is None
    client = openai.OpenAI(base_url=c.server.url + "/v1", api_key=c.server.api_key())
    assert _complete(client)


def test_gpu_utilisation_reaches_the_api_each_heartbeat_without_an_inventory(
    cluster: Cluster, tmp_path: Path
) -> None:
    c = cluster
    # A GPU whose utilisation we move: nvidia-smi answers what the file says (atomically
    # replaced, as a half-written answer would be news).
    answer = tmp_path / "smi.csv"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexec /bin/cat {answer}\n")
    smi.chmod(0o755)

    def busy(value: str) -> None:
        part = answer.with_suffix(".part")
        part.write_text(
            "0, GPU-7c0e3f5a-2b1d-4e8f-9a6c-3d5b7e9f1a2c, NVIDIA GeForce RTX 4090, 24564, "
            f"1093, 550.54.15, {value}\n"
        )
        os.replace(part, answer)

    busy("37")
    c.add_node("mn-u", None, nvidia_smi=smi)
    wait_for(lambda: _utilisation(c, "mn-u") == [37], what="the first figure")

    def inventories() -> int:
        events = c.server.api("GET", "/api/events?subject=mn-u&limit=200")
        return sum(1 for e in events if e["kind"] == "inventory_changed")

    told = inventories()
    busy("81")
    wait_for(lambda: _utilisation(c, "mn-u") == [81], timeout=15, what="the figure moved")
    shown = c.ctl("nodes", "mn-u")
    assert shown.returncode == 0, shown.stderr
    assert "  - 0 NVIDIA GeForce RTX 4090: memory 1093/24564 MiB, utilisation 81%" in shown.stdout
    busy("[Not Supported]")  # unknown: null, not 0 and not the last figure
    wait_for(lambda: _utilisation(c, "mn-u") == [None], timeout=15, what="unknown")
    busy("0")  # idle: 0, known
    wait_for(lambda: _utilisation(c, "mn-u") == [0], timeout=15, what="idle")
    # All of it came with the heartbeats: the agent looks at its inventory every 30 s, and
    # not one inventory (a store write and an event each) was sent for any of it.
    assert inventories() == told
