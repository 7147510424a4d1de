"""``llmgw ctl gpus``: each node's GPUs with state and why, one node's, cordon and uncordon
by index or uuid, and the control plane's refusals as the operator reads them."""

from __future__ import annotations

from typing import Any

from llmgw.errors import APIError
from tests.unit.cli.ctl.fakeapi import FakeAPI

N1 = {
    "node": "gpu-1",
    "blocked": None,
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-a",
            "name": "H100",
            "memory_total_mib": 81559,
            "memory_used_mib": 100,
            "state": "healthy",
            "health": "",
            "cordon": None,
        },
        {
            "index": 1,
            "uuid": "GPU-b",
            "name": "H100",
            "memory_total_mib": 81559,
            "memory_used_mib": 0,
            "state": "cordoned",
            "health": "",
            "cordon": {"actor": "alice", "reason": "fan noise", "at": 1.0},
        },
    ],
}
N2 = {
    "node": "gpu-2",
    "blocked": "cannot move r-1 off a cordoned GPU: no room",
    "gpus": [
        {
            "index": 0,
            "uuid": "GPU-c",
            "name": "H100",
            "memory_total_mib": 81559,
            "memory_used_mib": 0,
            "state": "unhealthy",
            "health": "XID 79: GPU has fallen off the bus",
            "cordon": None,
        }
    ],
}


def _api() -> FakeAPI:
    def answer(method: str, path: str, body: Any) -> Any:
        if path == "/api/gpus":
            return [N1, N2]
        if path == "/api/nodes/gpu-1/gpus":
            return N1
        if path == "/api/nodes/gpu-1/gpus/cordon" and body["gpus"] == ["7"]:
            raise APIError(
                "node gpu-1 has no GPU '7'; its GPUs: 0 (GPU-a), 1 (GPU-b) "
                "('llmgw ctl gpus gpu-1' lists them)",
                status=404,
                code="not_found",
            )
        if path.startswith("/api/nodes/nope/"):
            raise APIError("no node 'nope'", status=404, code="not_found")
        return N1

    return FakeAPI(answer)


def test_every_node_s_gpus_with_state_and_why() -> None:
    api = _api()
    out = api.ctl("gpus")
    assert out.exit_code == 0, out.output
    assert api.requests == ["GET /api/gpus"]
    lines = out.output.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "UUID", "MEMORY", "STATE", "WHY"]
    assert lines[1].split() == ["gpu-1", "0", "GPU-a", "100/81559", "MiB", "healthy", "-"]
    assert lines[2].split()[4:] == ["MiB", "cordoned", "by", "alice:", "fan", "noise"]
    assert lines[3].split()[4:] == [
        "MiB",
        "unhealthy",
        "XID",
        "79:",
        "GPU",
        "has",
        "fallen",
        "off",
        "the",
        "bus",
    ]
    assert lines[4] == "gpu-2: cannot move r-1 off a cordoned GPU: no room"


def test_one_node() -> None:
    api = _api()
    out = api.ctl("gpus", "gpu-1")
    assert out.exit_code == 0, out.output
    assert api.requests == ["GET /api/nodes/gpu-1/gpus"]
    assert len(out.output.splitlines()) == 3


def test_cordon_and_uncordon_send_the_gpus_named() -> None:
    api = _api()
    out = api.ctl("gpus", "cordon", "gpu-1", "1,GPU-a", "--reason", "fan noise")
    assert out.exit_code == 0, out.output
    assert api.calls == [
        ("POST", "/api/nodes/gpu-1/gpus/cordon", {"gpus": ["1", "GPU-a"], "reason": "fan noise"})
    ]
    assert out.output == (
        "GPU 1,GPU-a of gpu-1 cordoned; its replicas move elsewhere "
        "('llmgw ctl gpus gpu-1' to watch)\n"
    )
    out = api.ctl("gpus", "uncordon", "gpu-1", "1")
    assert out.exit_code == 0, out.output
    assert api.calls[-1] == ("POST", "/api/nodes/gpu-1/gpus/uncordon", {"gpus": ["1"]})
    assert out.output == "GPU 1 of gpu-1 takes replicas again\n"


def test_refusals_say_what_exists() -> None:
    api = _api()
    out = api.ctl("gpus", "cordon", "gpu-1", "7")
    assert out.exit_code == 1
    assert "node gpu-1 has no GPU '7'; its GPUs: 0 (GPU-a), 1 (GPU-b)" in out.output
    out = api.ctl("gpus", "nope")
    assert out.exit_code == 1
    assert "no node 'nope'" in out.output
    out = api.ctl("gpus", "cordon", "gpu-1", ",")
    assert out.exit_code == 2
    assert "name GPUs by index or uuid" in out.output
    assert len(api.calls) == 2  # the bad list was never sent


def test_ctl_nodes_counts_and_names_unhealthy_gpus() -> None:
    gpus = [
        {"index": 0, "uuid": "GPU-a", "name": "H100", "memory_total_mib": 8, "memory_used_mib": 1},
        {
            "index": 1,
            "uuid": "GPU-b",
            "name": "H100",
            "memory_total_mib": 8,
            "memory_used_mib": 0,
            "health": "XID 79: GPU has fallen off the bus",
        },
    ]
    node = {
        "id": "gpu-1",
        "uid": "u-gpu-1",
        "state": "approved",
        "health": "healthy",
        "degraded": [],
        "connected": True,
        "draining": False,
        "lost": False,
        "dataplane_addr": "10.0.0.1:9443",
        "agent_version": "0.1.0",
        "last_seen": None,
        "shards": 1,
        "engines": ["sim"],
        "gpus": gpus,
        "gpu_status": "",
        "fingerprint": "sha256:" + "ab" * 32,
        "cert_expires_at": None,
        "update": None,
    }

    def answer(method: str, path: str, body: Any) -> Any:
        if path == "/api/status":
            return {"version": "0.1.0"}
        return [node] if path == "/api/nodes" else node

    api = FakeAPI(answer)
    out = api.ctl("nodes")
    assert out.exit_code == 0, out.output
    assert "2 (1 unhealthy)" in out.output
    out = api.ctl("nodes", "gpu-1")
    assert "GPUs:         2 (1 unhealthy)\n" in out.output
    assert (
        "  - 1 H100: memory 0/8 MiB, utilisation unknown, unhealthy: XID 79: GPU has fallen "
        "off the bus\n"
    ) in out.output
