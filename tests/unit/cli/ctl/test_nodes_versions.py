"""``llmgw ctl nodes [NODE]``: the warning about agent versions next to the control plane's
(newer: refused; more than two minor releases behind: unsupported), in the table and for one
node. The admin API is a stand-in answering /api/nodes[/NODE] and /api/status."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.errors import APIError
from tests.unit.cli.ctl.fakeapi import FakeAPI

SERVER_VERSION = "0.5.0"


def _node(node_id: str, version: str) -> dict[str, Any]:
    return {
        "id": node_id,
        "uid": "u-" + node_id,
        "state": "approved",
        "connected": True,
        "draining": False,
        "lost": False,
        "dataplane_addr": "10.0.0.1:9443",
        "agent_version": version,
        "last_seen": None,
        "shards": 0,
        "gpus": [],
        "gpu_status": "",
        "engines": ["sim"],
        "fingerprint": "sha256:" + "ab" * 32,
        "cert_expires_at": None,
        "cert_serial": None,
        "update": None,
    }


NODES = [
    _node("gpu-n2", "0.3.0"),  # N-2: supported
    _node("gpu-n3", "0.2.4"),  # N-3
    _node("gpu-new", "0.6.0rc1"),
    _node("gpu-dev", "0.5.0+local"),
]


@pytest.fixture
def api() -> FakeAPI:
    def answer(method: str, path: str, body: Any) -> Any:
        if path == "/api/status":
            return {"version": SERVER_VERSION}
        if path == "/api/nodes":
            return NODES
        node_id = path.removeprefix("/api/nodes/")
        for node in NODES:
            if node["id"] == node_id:
                return node
        raise APIError(
            f"no node {node_id!r}; 'llmgw ctl nodes' lists them", status=404, code="not_found"
        )

    return FakeAPI(answer)


@pytest.fixture
def calls(api: FakeAPI) -> list[str]:
    return api.requests


N3_WARNING = (
    "warning: node gpu-n3 runs llmgw 0.2.4, more than 2 minor releases behind the control "
    "plane's llmgw 0.5.0 (unsupported); upgrade it: llmgw ctl update gpu-n3 --version 0.5.0"
)
NEW_WARNING = (
    "warning: node gpu-new runs llmgw 0.6.0rc1, newer than the control plane's llmgw 0.5.0: "
    "its stream is refused; upgrade the control plane to 0.6.0rc1 or later first"
)


def test_the_table_marks_and_explains_the_agents_out_of_the_window(
    api: FakeAPI, calls: list[str]
) -> None:
    out = api.ctl("nodes")
    assert out.exit_code == 0, out.output
    assert calls == ["GET /api/nodes", "GET /api/status"]
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    assert " 0.3.0 " in rows["gpu-n2"] and "(!)" not in rows["gpu-n2"]
    assert " 0.5.0+local " in rows["gpu-dev"] and "(!)" not in rows["gpu-dev"]
    assert " 0.2.4 (!) " in rows["gpu-n3"]
    assert " 0.6.0rc1 (!) " in rows["gpu-new"]
    assert out.stderr.splitlines() == [N3_WARNING, NEW_WARNING]


def test_one_node_says_its_version_and_the_warning(api: FakeAPI, calls: list[str]) -> None:
    out = api.ctl("nodes", "gpu-n3")
    assert out.exit_code == 0, out.output
    assert "version:      0.2.4 (control plane: 0.5.0)" in out.stdout.splitlines()
    assert "node:         gpu-n3" in out.stdout.splitlines()
    assert out.stderr.splitlines() == [N3_WARNING]


def test_one_node_within_the_window_has_no_warning(api: FakeAPI, calls: list[str]) -> None:
    out = api.ctl("nodes", "gpu-n2")
    assert out.exit_code == 0, out.output
    assert out.stderr == ""
    assert "version:      0.3.0 (control plane: 0.5.0)" in out.stdout.splitlines()


def test_an_unknown_node_is_refused_naming_the_listing(api: FakeAPI, calls: list[str]) -> None:
    out = api.ctl("nodes", "gpu-x")
    assert out.exit_code == 1
    assert "no node 'gpu-x'; 'llmgw ctl nodes' lists them" in out.stderr


def test_json_of_one_node_is_the_api_record(api: FakeAPI, calls: list[str]) -> None:
    out = api.ctl("--json", "nodes", "gpu-new")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == _node("gpu-new", "0.6.0rc1")
