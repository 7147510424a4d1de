"""The catalog end to end: 'ctl models apply -f', deploying a profile, refusals that change
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import (
    LLMGW,
    Agent,
    Client,
    Server,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

CATALOG = """\
models:
  chat:
    profiles:
      default: {engine: sim, gpus: 0, params: {ttft_ms: "1"}}
      fast:
        engine: sim
        params: {ttft_ms: "0", tps: "2000"}
        placement: spread
"""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Server, Agent]]:
    server = start_server(tmp_path)
    agent = start_agent(make_agent(tmp_path, server, "node-a"))
    try:
        wait_for(lambda: any(n["connected"] for n in server.nodes()), what="the agent")
        server.approve_pending(1)
        yield server, agent
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def ctl(server: Server, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(
        LLMGW_SERVER=server.url,
        LLMGW_TOKEN=server.admin_token,
        XDG_CONFIG_HOME=str(tmp / "xdg"),
    )
    return subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60
    )


def api_error(server: Server, method: str, path: str, body: Any) -> tuple[int, str]:
    """The status and error message of a request that must fail."""
    with pytest.raises(urllib.error.HTTPError) as info:
        server.api(method, path, body)
    return info.value.code, json.loads(info.value.read())["error"]["message"]


def test_apply_deploy_and_refusals(cluster: tuple[Server, Agent], tmp_path: Path) -> None:
    server, _agent = cluster
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)

    applied = ctl(server, tmp_path, "models", "apply", "-f", str(path))
    assert applied.returncode == 0, applied.stderr
    lines = applied.stdout.splitlines()
    assert lines[0].split() == ["CHANGE", "MODEL", "PROFILES"]
    assert lines[1].split() == ["added", "chat", "default,", "fast"]
    assert lines[-1] == f"catalog {path}: 1 added, 0 updated, 0 unchanged"
    again = ctl(server, tmp_path, "models", "apply", "-f", str(path))
    assert again.stdout.splitlines()[1].split()[:2] == ["unchanged", "chat"], again.stdout
    assert again.stdout.splitlines()[-1].endswith("0 added, 0 updated, 1 unchanged")

    stored = server.api("GET", "/api/catalog")
    assert set(stored["models"]) == {"chat"}
    fast = stored["models"]["chat"]["profiles"]["fast"]
    assert fast["params"] == {"ttft_ms": "0", "tps": "2000"}
    assert (fast["gpus"], fast["nodes"], fast["placement"]) == (0, 1, "spread")
    listed = ctl(server, tmp_path, "models")
    assert listed.stdout.splitlines()[0].split() == [
        "MODEL",
        "PROFILE",
        "ENGINE",
        "GPUS",
        "NODES",
        "DESIRED",
        "READY",
        "ROUTING",
        "CACHED",
        "PROBLEM",
    ]
    assert listed.stdout.splitlines()[1].split() == [
        "chat",
        "default",
        "sim",
        "0",
        "1",
        "0",
        "0",
        "least-outstanding",
        "-",
    ]

    # Deploy a profile; the sim needs no GPUs, so its replicas come up.
    deployed = ctl(server, tmp_path, "deploy", "chat", "--profile", "fast", "--replicas", "2")
    assert deployed.returncode == 0, deployed.stderr
    assert deployed.stdout.startswith(
        "deployed chat: 2 replicas of profile fast (engine sim, 0 GPU(s) x 1 node(s))"
    ), deployed.stdout
    wait_for(
        lambda: [r["state"] for r in server.replicas("chat")] == ["ready", "ready"],
        what="two ready replicas of chat",
    )
    model = server.api("GET", "/api/models")[0]
    assert {k: model[k] for k in ("profile", "engine", "gpus", "nodes", "replicas")} == {
        "profile": "fast",
        "engine": "sim",
        "gpus": 0,
        "nodes": 1,
        "replicas": 2,
    }
    assert model["params"] == {"ttft_ms": "0", "tps": "2000"}
    listed = ctl(server, tmp_path, "models")
    assert listed.stdout.splitlines()[1].split() == [
        "chat",
        "fast",
        "sim",
        "0",
        "1",
        "2",
        "2",
        "least-outstanding",
        "-",
    ]

    # Changing the running profile's settings (not its engine) applies, with a note.
    path.write_text(CATALOG.replace('tps: "2000"', 'tps: "1000"'))
    updated = ctl(server, tmp_path, "models", "apply", "-f", str(path))
    assert updated.returncode == 0, updated.stderr
    assert updated.stdout.splitlines()[1].split()[:2] == ["updated", "chat"], updated.stdout
    assert updated.stderr.strip() == (
        "note: chat: 2 running replica(s) of profile fast keep the settings they started "
        "with until they are replaced"
    )
    assert server.api("GET", "/api/models")[0]["params"] == {"ttft_ms": "0", "tps": "1000"}

    before = server.api("GET", "/api/catalog")

    # A catalog the parser refuses: ctl refuses it before sending anything.
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        textwrap.dedent(
            """\
            models:
              extra:
                profiles:
                  default: {engine: sim}
              chat:
                profiles:
                  default: {engine: sim, gpus: 0, nodes: 2}
            """
        )
    )
    refused = ctl(server, tmp_path, "models", "apply", "-f", str(bad))
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"error: {bad}: models.chat.profiles.default.nodes: 2 nodes need gpus >= 1 "
        "(multi-node replicas shard GPUs across nodes)"
    )
    # The server checks with the same parser.
    status, message = api_error(
        server,
        "PUT",
        "/api/catalog",
        {"models": {"chat": {"profiles": {"default": {"engine": "sim", "gpu": 1}}}}},
    )
    assert status == 400
    assert message.startswith("catalog: models.chat.profiles.default.gpu: unknown key 'gpu'")
    assert "did you mean 'gpus'?" in message
    assert server.api("GET", "/api/catalog") == before

    # Valid, but it changes the engine under running replicas: 409, and the new model in the
    # same file is not added either.
    engine_change = tmp_path / "engine.yaml"
    engine_change.write_text(
        textwrap.dedent(
            """\
            models:
              extra:
                profiles:
                  default: {engine: sim}
              chat:
                profiles:
                  default: {engine: sim, gpus: 0, params: {ttft_ms: "1"}}
                  fast: {engine: vllm, source: /srv/llmgw/models/chat, gpus: 1}
            """
        )
    )
    conflict = ctl(server, tmp_path, "models", "apply", "-f", str(engine_change))
    assert conflict.returncode == 1
    assert conflict.stderr.strip() == (
        "error: model chat runs 2 replica(s) of profile fast with engine sim, and the new "
        "profile fast has engine vllm; 'llmgw ctl undeploy chat' (or scale it to 0) first, "
        "or give engine vllm another profile"
    )
    assert server.api("GET", "/api/catalog") == before
    assert [m["name"] for m in server.api("GET", "/api/models")] == ["chat"]

    # Unknown profiles are named with the ones there are (the running profile untouched);
    # mixing the catalog and ad-hoc forms is a usage error.
    missing = ctl(server, tmp_path, "deploy", "chat", "--profile", "huge")
    assert missing.returncode == 1
    assert "model chat has no profile huge; its profiles: default, fast" in missing.stderr
    assert server.api("GET", "/api/models")[0]["profile"] == "fast"
    mixed = ctl(server, tmp_path, "deploy", "chat", "--profile", "fast", "--engine", "sim")
    assert mixed.returncode == 2
    assert "give one or the other" in mixed.stderr
    status, message = api_error(
        server, "POST", "/api/models", {"name": "chat", "engine": "sim", "replicas": 1}
    )
    assert status == 409
    assert "model chat comes from the catalog (profiles default, fast)" in message

    # Scaling keeps the deployed profile.
    scaled = ctl(server, tmp_path, "deploy", "chat", "--replicas", "1")
    assert scaled.returncode == 0, scaled.stderr
    wait_for(lambda: len(server.replicas("chat")) == 1, what="scale down to one")
    assert server.api("GET", "/api/models")[0]["profile"] == "fast"


def test_adhoc_deploys_get_a_default_profile(cluster: tuple[Server, Agent], tmp_path: Path) -> None:
    server, _agent = cluster
    deployed = ctl(server, tmp_path, "deploy", "adhoc", "--param", "ttft_ms=3")
    assert deployed.returncode == 0, deployed.stderr
    assert deployed.stdout.startswith("deployed adhoc: 1 replicas of engine sim"), deployed.stdout
    wait_for(lambda: [r["state"] for r in server.replicas("adhoc")] == ["ready"], what="ready")
    profiles = server.api("GET", "/api/catalog")["models"]["adhoc"]["profiles"]
    assert list(profiles) == ["default"]
    assert profiles["default"]["engine"] == "sim"
    assert profiles["default"]["params"] == {"ttft_ms": "3"}
    # The catalog's own listing applies again as it is.
    again = tmp_path / "again.yaml"
    again.write_text(json.dumps(server.api("GET", "/api/catalog")))
    applied = ctl(server, tmp_path, "models", "apply", "-f", str(again))
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.splitlines()[1].split()[:2] == ["unchanged", "adhoc"]
    model = server.api("GET", "/api/models")[0]
    assert (model["profile"], model["engine"], model["params"]) == (
        "default",
        "sim",
        {"ttft_ms": "3"},
    )


def test_a_profile_switch_replaces_replicas_one_at_a_time_without_failing_a_request(
    cluster: tuple[Server, Agent], tmp_path: Path
) -> None:
    server, _agent = cluster
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)
    assert ctl(server, tmp_path, "models", "apply", "-f", str(path)).returncode == 0
    deployed = ctl(server, tmp_path, "deploy", "chat", "--profile", "fast", "--replicas", "2")
    assert deployed.returncode == 0, deployed.stderr

    def routable(profile: str) -> bool:
        rows = server.api("GET", "/api/replicas?model=chat")
        return len(rows) == 2 and all(r["routable"] and r["profile"] == profile for r in rows)

    wait_for(lambda: routable("fast"), timeout=60, what="two replicas of profile fast")
    before = {r["replica"] for r in server.api("GET", "/api/replicas?model=chat")}
    client = Client(server.url + "/v1", server.api_key(), "chat")
    client.start()
    try:
        switched = ctl(server, tmp_path, "deploy", "chat", "--profile", "default")
        assert switched.returncode == 0, switched.stderr
        assert "2 replica(s) of another profile keep serving" in switched.stdout
        wait_for(lambda: routable("default"), timeout=90, what="two replicas of profile default")
    finally:
        client.stop.set()
        client.join(timeout=60)
    assert client.failures == []
    assert client.ok > 5
    after = {r["replica"] for r in server.api("GET", "/api/replicas?model=chat")}
    assert after.isdisjoint(before)
    kinds = [e["kind"] for e in server.api("GET", "/api/events?subject=chat&limit=100")]
    assert kinds.count("profile_replacing") == 2 and kinds.count("profile_replaced") == 2
    model = server.api("GET", "/api/models")[0]
    assert (model["profile"], model["older_profile_replicas"]) == ("default", 0)
