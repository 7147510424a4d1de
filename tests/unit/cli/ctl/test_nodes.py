"""``llmgw ctl nodes [NODE]``: the HEALTH column beside STATE, a line under the table for each
degraded node, and one node in full with what to fix. The admin API is a stand-in."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.cli.ctl.fakeapi import FakeAPI

ENGINE = {
    "code": "engine",
    "engine": "vllm",
    "fabric": "",
    "message": "engine vllm (/opt/vllm) will not run: libcudart.so.12 => not found; install "
    "what it lacks, or reinstall it",
}
FABRIC = {
    "code": "fabric",
    "engine": "",
    "fabric": "ib-a",
    "message": "fabric ib-a is down: adapter mlx5_0 has no ACTIVE port",
}


def _node(
    node_id: str, health: str, degraded: list[dict[str, str]], **extra: Any
) -> dict[str, Any]:
    return {
        "id": node_id,
        "uid": "u-" + node_id,
        "state": "approved",
        "health": health,
        "degraded": degraded,
        "connected": health != "offline",
        "draining": False,
        "lost": False,
        "dataplane_addr": "10.0.0.1:9443",
        "agent_version": "0.1.0",
        "last_seen": None,
        "shards": 1,
        "cpus": 8,
        "memory_total_bytes": 1,
        "gpus": [],
        "gpu_status": "",
        "engines": ["sim"],
        "fingerprint": "sha256:" + "ab" * 32,
        "cert_expires_at": None,
        "cert_serial": "01",
        "update": None,
        **extra,
    }


NODES = [
    _node("gpu-1", "healthy", []),
    _node("gpu-2", "degraded", [ENGINE, FABRIC]),
    _node("gpu-3", "offline", [ENGINE]),
]
DETAIL = _node(
    "gpu-2",
    "degraded",
    [ENGINE, FABRIC],
    engine_details=[
        {"name": "sim", "path": "/usr/bin/llmgw", "version": "0.1.0", "ok": True, "problem": ""},
        {"name": "vllm", "path": "/opt/vllm", "version": "", "ok": False, "problem": "libcudart"},
    ],
    fabrics=[
        {"name": "ib-a", "hcas": ["mlx5_0"], "healthy": False},
        {"name": "ib-b", "hcas": ["mlx5_1"], "healthy": True},
    ],
    warnings=["fabric ib-a: adapter mlx5_0 has no ACTIVE port"],
    driver_version="",
    memory_total_bytes=256 << 30,
    sleepers_host_memory_bytes=180 << 30,
)


@pytest.fixture
def api() -> FakeAPI:
    def answer(method: str, path: str, body: Any) -> Any:
        if path == "/api/status":
            return {"version": "0.1.0"}
        return DETAIL if path == "/api/nodes/gpu-2" else NODES

    return FakeAPI(answer)


@pytest.fixture
def calls(api: FakeAPI) -> list[str]:
    return api.requests


def test_the_list_shows_health_and_a_line_per_degraded_node(api: FakeAPI, calls: list[str]) -> None:
    out = api.ctl("nodes")
    assert out.exit_code == 0, out.output
    assert calls == ["GET /api/nodes", "GET /api/status"]
    lines = out.output.splitlines()
    assert lines[0].split()[:4] == ["NODE", "STATE", "HEALTH", "CONNECTED"]
    assert [line.split()[:4] for line in lines[1:4]] == [
        ["gpu-1", "approved", "healthy", "yes"],
        ["gpu-2", "approved", "degraded", "yes"],
        ["gpu-3", "approved", "offline", "no"],
    ]
    # Only a node degraded now gets the line; an offline one's old reasons are in its detail.
    assert lines[4:] == [
        "gpu-2 is degraded (engine vllm, fabric ib-a); 'llmgw ctl nodes gpu-2' says what to fix"
    ]


def test_one_node_says_why_it_is_degraded_and_what_to_fix(api: FakeAPI, calls: list[str]) -> None:
    out = api.ctl("nodes", "gpu-2")
    assert out.exit_code == 0, out.output
    assert calls == ["GET /api/nodes/gpu-2", "GET /api/status"]
    assert out.output == (
        "node:         gpu-2\n"
        "state:        approved\n"
        "health:       degraded\n"
        "connected:    yes\n"
        "data plane:   10.0.0.1:9443\n"
        "version:      0.1.0 (control plane: 0.1.0)\n"
        "last seen:    -\n"
        "shards:       1\n"
        "GPUs:         0\n"
        "host memory:  256.0 GiB, sleepers hold 180.0 GiB\n"
        "engines:      sim\n"
        f"fingerprint:  sha256:{'ab' * 32}\n"
        "cert expires: -\n"
        "degraded: placement keeps it from what each names, only that\n"
        f"  - engine vllm: {ENGINE['message']}\n"
        f"  - fabric ib-a: {FABRIC['message']}\n"
        "fabrics: ib-a (down), ib-b (up)\n"
        "warnings:\n"
        "  - fabric ib-a: adapter mlx5_0 has no ACTIVE port\n"
    )


def test_one_node_as_json(api: FakeAPI, calls: list[str]) -> None:
    out = api.ctl("--json", "nodes", "gpu-2")
    assert out.exit_code == 0, out.output
    assert '"health": "degraded"' in out.output and '"code": "fabric"' in out.output


def test_what_a_node_wrote_cannot_drive_the_terminal(
    api: FakeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    sly = dict(ENGINE, message="will not run\x1b]0;owned\x07\nhealth: healthy")
    node = _node("gpu-2", "degraded", [sly], warnings=["\x1b[2Jcleared"])

    def answer(method: str, path: str, body: Any) -> Any:
        return {"version": "0.1.0"} if path == "/api/status" else node

    api.handler = answer
    out = api.ctl("nodes", "gpu-2")
    assert out.exit_code == 0, out.output
    assert "\x1b" not in out.output and "\x07" not in out.output
    assert "  - engine vllm: will not run\ufffd]0;owned\ufffd\ufffdhealth: healthy\n" in out.output
    assert "  - \ufffd[2Jcleared\n" in out.output


def test_one_node_shows_each_gpus_memory_and_utilisation(
    api: FakeAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    def gpu(index: int, used: int, busy: int | None) -> dict[str, Any]:
        return {
            "index": index,
            "uuid": f"GPU-{index}",
            "name": "NVIDIA H100 80GB HBM3",
            "memory_total_mib": 81559,
            "memory_used_mib": used,
            "utilization_percent": busy,
        }

    node = _node("gpu-1", "healthy", [], gpus=[gpu(0, 74213, 94), gpu(1, 0, 0), gpu(2, 0, None)])

    def answer(method: str, path: str, body: Any) -> Any:
        return {"version": "0.1.0"} if path == "/api/status" else node

    api.handler = answer
    out = api.ctl("nodes", "gpu-1")
    assert out.exit_code == 0, out.output
    assert "GPUs:         3\n" in out.output
    # An idle GPU is 0%; one that cannot tell (or a node away) is unknown, never 0%.
    assert (
        "gpus:\n"
        "  - 0 NVIDIA H100 80GB HBM3: memory 74213/81559 MiB, utilisation 94%\n"
        "  - 1 NVIDIA H100 80GB HBM3: memory 0/81559 MiB, utilisation 0%\n"
        "  - 2 NVIDIA H100 80GB HBM3: memory 0/81559 MiB, utilisation unknown\n"
    ) in out.output
    # What the node named its GPU cannot drive the terminal either.
    node["gpus"] = [dict(gpu(0, 1, 5), name="\x1b[2Jcleared")]
    out = api.ctl("nodes", "gpu-1")
    assert "  - 0 \ufffd[2Jcleared: memory 1/81559 MiB, utilisation 5%\n" in out.output


def test_a_control_plane_before_utilisation_shows_it_unknown(
    api: FakeAPI,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    old = {"index": 0, "uuid": "GPU-0", "name": "A", "memory_total_mib": 8, "memory_used_mib": 1}
    node = _node("gpu-1", "healthy", [], gpus=[old])

    def answer(method: str, path: str, body: Any) -> Any:
        return {"version": "0.1.0"} if path == "/api/status" else node

    api.handler = answer
    out = api.ctl("nodes", "gpu-1")
    assert out.exit_code == 0, out.output
    assert "  - 0 A: memory 1/8 MiB, utilisation unknown\n" in out.output


def test_one_node_lists_the_sources_it_keeps_warm(api: FakeAPI) -> None:
    import time

    warm = [
        {
            "source": "llama",
            "state": "warm",
            "reason": "",
            "bytes": 16 * 1024**3,
            "pass_seconds": 62.04,
            "last_pass_at": time.time() - 180,
        },
        {
            "source": "big",
            "state": "skipped",
            "reason": "the node is short of memory: 3.0 GiB available",
            "bytes": 0,
            "pass_seconds": 0.0,
            "last_pass_at": 0.0,
        },
    ]
    node = _node("gpu-1", "healthy", [], warm=warm)
    api.handler = lambda method, path, body: {"version": "0.1.0"} if path == "/api/status" else node
    out = api.ctl("nodes", "gpu-1")
    assert out.exit_code == 0, out.output
    assert (
        "warm sources (prefetch: kept in the page cache):\n"
        "  - llama: warm, 16.0 GiB, read in 62.0 s, 3m ago\n"
        "  - big: skipped (the node is short of memory: 3.0 GiB available)\n"
    ) in out.output
    # A node that keeps none (or an older control plane) shows no such section.
    node.pop("warm")
    assert "warm sources" not in api.ctl("nodes", "gpu-1").output


def test_with_the_database_away_the_table_comes_with_a_warning_saying_so() -> None:
    """The leader answers the list from memory while PostgreSQL is away; /api/status says
    since when, and ctl nodes says it under the table and exits 0."""
    away = "unreachable since 2026-01-02 03:04:05; scheduling and admin writes pause"

    def answer(method: str, path: str, body: Any) -> Any:
        if path == "/api/status":
            return {"version": "0.1.0", "database": away}
        return NODES

    out = FakeAPI(answer).ctl("nodes")
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[0].split()[:2] == ["NODE", "STATE"]
    assert f"warning: database {away}" in out.output
