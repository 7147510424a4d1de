"""Request body limits end to end: server.yaml's limit, a catalog profile raising it for its
model (and the agent taking it although its own agent.yaml limit is lower), the admin API's
small limit; the control plane keeps serving."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

KIB = 1024


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Server, Agent]]:
    server = start_server_with(tmp_path, max_request_body="64KiB")
    agent = start_agent(make_agent(tmp_path, server, "node-a", extra={"max_request_body": "64KiB"}))
    try:
        wait_for(lambda: any(n["connected"] for n in server.nodes()), what="the agent")
        server.approve_pending(1)
        yield server, agent
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def post(url: str, key: str, body: bytes) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def chat(model: str, size: int) -> bytes:
    return json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x" * size}], "max_tokens": 4}
    ).encode()


def test_limits_per_model_reach_the_data_plane(cluster: tuple[Server, Agent]) -> None:
    server, _agent = cluster
    server.api(
        "PUT",
        "/api/catalog",
        {
            "models": {
                "chat": {"profiles": {"default": {"engine": "sim"}}},
                # A long context too: 300 KiB of 'x' is a token a byte to the sim.
                "long": {
                    "profiles": {
                        "default": {
                            "engine": "sim",
                            "max_request_body": "512KiB",
                            "params": {"max_length": "1000000"},
                        }
                    }
                },
            }
        },
    )
    assert (
        server.api("GET", "/api/catalog")["models"]["long"]["profiles"]["default"][
            "max_request_body"
        ]
        == 512 * KIB
    )
    for model in ("chat", "long"):
        server.api("POST", "/api/models", {"name": model, "profile": "default", "replicas": 1})
    wait_for(
        lambda: (
            sorted(r["model"] for r in server.replicas() if r["state"] == "ready")
            == ["chat", "long"]
        ),
        what="a ready replica of each model",
    )
    key = server.api_key()
    url = server.url + "/v1/chat/completions"

    status, answer = post(url, key, chat("chat", 1000))
    assert status == 200, answer
    status, answer = post(url, key, chat("chat", 100 * KIB))
    assert status == 413
    assert answer["error"]["code"] == "request_too_large"
    assert "model 'chat' takes at most 64 KiB" in answer["error"]["message"]
    assert "max_request_body in server.yaml" in answer["error"]["message"]

    # The profile's 512 KiB holds on the gateway and on the data plane, whose own
    # agent.yaml limit (64 KiB) would refuse it.
    status, answer = post(url, key, chat("long", 300 * KIB))
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"]
    status, answer = post(url, key, chat("long", 600 * KIB))
    assert status == 413
    assert "no model on this gateway takes more than 512 KiB" in answer["error"]["message"]

    # The admin API takes small bodies only.
    req = urllib.request.Request(
        server.url + "/api/keys",
        data=json.dumps({"name": "k", "pad": "x" * (2 * 1024 * KIB)}).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {server.admin_token}"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 413
    assert json.loads(info.value.read())["error"]["code"] == "request_too_large"

    with urllib.request.urlopen(server.url + "/healthz", timeout=10) as resp:
        assert resp.status == 200
    assert "Traceback" not in server.log()
