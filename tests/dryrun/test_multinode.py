"""A two-node sim replica across two Debian 12 containers, each installed by the one-liner
'llmgw ctl join-command' prints with its node facts (a fabric, the fake nvidia-smi and
InfiniBand sysfs the integration tests use), with ufw active on both (issue 13 points 2, 3).

The one-liner's installer writes the facts into agent.yaml and opens :9443 from the gateway
and the multi-node port range (29500-29999) from the gateway and the other node only; the
replica's rank 0 binds its rendezvous port in that range and the worker on the other node
dials it through ufw, and the replica serves a completion through the gateway."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration.harness import wait_for
from tests.packaging.pkgcheck import systemd_image_of

from .lab import MOUNT, Lab, Node

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
ON_NODE = "/opt/llmgw-fixtures"  # root's, where the hardened agent may read and run them
MODEL = "dry-wide"
FABRIC = "ib-dry"
CATALOG = f"""\
models:
  {MODEL}:
    profiles:
      two-nodes:
        engine: sim
        gpus: 1
        nodes: 2
        params: {{ttft_ms: "0", tps: "5000", max_tokens: "8"}}
"""


def install(lab: Lab, node: Node, peer: Node) -> dict[str, object]:
    """Join ``node`` with the facts and firewall options on the one-liner."""
    join = json.loads(
        lab.ctl(
            "--json", "join-command", "--node", node.node_id,
            "--fabric", f"{FABRIC}:mlx5_0",
            "--nvidia-smi", f"{ON_NODE}/one-gpu", "--ib-root", f"{ON_NODE}/ib",
            "--firewall-from", lab.gateway, "--fabric-peers", f"{peer.ip}/32",
        ).stdout
    )  # fmt: skip
    command = join["command"]
    assert "install-agent.sh install" in command and f"--fabric-peers {peer.ip}/32" in command
    result = node.sh(command)
    assert f"node {node.node_id} joined" in result.stdout + result.stderr, result.stderr
    return join  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def pair(lab: Lab) -> tuple[Node, Node]:
    shutil.copytree(FIXTURES / "ib", lab.dir / "mn-fixtures" / "ib")
    shutil.copy(FIXTURES / "nvidia-smi" / "one-gpu", lab.dir / "mn-fixtures" / "one-gpu")
    image = systemd_image_of("bookworm")
    a, b = lab.boot(image, "dry-mn-a"), lab.boot(image, "dry-mn-b")
    for node in (a, b):
        node.sh(
            f"cp -r {MOUNT}/mn-fixtures {ON_NODE} && chmod -R go-w {ON_NODE} "
            f"&& chmod 0755 {ON_NODE}/one-gpu && ufw --force enable >/dev/null"
        )
    return a, b


def test_a_two_node_sim_replica_serves_across_two_containers_with_ufw_active(
    lab: Lab, pair: tuple[Node, Node], tmp_path: Path
) -> None:
    assert lab.server is not None
    a, b = pair
    installer = lab.unpack(lab.bundle_n, "mn-unpacked") + "/install-agent.sh"
    install(lab, a, b)
    install(lab, b, a)
    for node, peer in ((a, b), (b, a)):
        config = node.out("cat /etc/llmgw/agent.yaml")
        assert f"- name: {FABRIC}" in config and f"nvidia_smi: {ON_NODE}/one-gpu" in config
        assert node.sh("llmgw agent --check --config /etc/llmgw/agent.yaml").returncode == 0
        assert node.out("llmgw agent --check --print multinode_ports") == "29500-29999"
        rules = node.out("ufw status")
        assert f"29500:29999/tcp            ALLOW       {peer.ip}" in rules, rules
        assert f"9443/tcp                   ALLOW       {lab.gateway}" in rules, rules
        # The peer gets the range, not the agent's port.
        assert f"9443/tcp                   ALLOW       {peer.ip}" not in rules, rules
        status = node.out(f"sh {installer} status")
        assert (
            f"firewall:   ufw allows 29500-29999/tcp (multi-node replicas) from {peer.ip}/32"
            in (status)
        ), status
        assert f"fabric:     {FABRIC}:mlx5_0" in status, status
        lab.approve(node.node_id)

    def on_fabric(node: Node) -> bool:
        seen = lab.server.api("GET", f"/api/nodes/{node.node_id}")  # type: ignore[union-attr]
        return seen["health"] == "healthy" and any(
            f.get("name") == FABRIC and f.get("healthy") for f in seen["fabrics"]
        )

    wait_for(
        lambda: on_fabric(a) and on_fabric(b), what="both nodes healthy on their fabric", timeout=60
    )
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(CATALOG)
    lab.ctl("models", "apply", "-f", str(catalog))
    lab.ctl("deploy", MODEL, "--profile", "two-nodes", "--replicas", "1")
    try:
        server = lab.server
        wait_for(
            lambda: any(r["routable"] for r in server.replicas(MODEL)),
            what=f"a routable two-node replica of {MODEL}",
            timeout=180,
            interval=1,
        )
        shards = json.loads(lab.ctl("--json", "replicas").stdout)
        mine = sorted((s for s in shards if s["model"] == MODEL), key=lambda s: s["rank"])
        assert {s["node"] for s in mine} == {a.node_id, b.node_id}, mine
        key = server.api_key("dry-multinode")
        assert lab.complete(MODEL, key)
    finally:
        lab.ctl("undeploy", MODEL)
        # The lab is shared: later modules place their replicas on their own nodes.
        for node in (a, b):
            lab.ctl("drain", node.node_id, "--no-wait")
