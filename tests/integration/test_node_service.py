"""The agent as a node service: restarts that keep engines, drain on stop, engine installs."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform
import signal
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import openai
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


@dataclass
class Pair:
    server: Server
    # Engine builds served on loopback (plain http: listed in the agents' install_sources).
    files: dict[str, bytes]
    files_port: int
    agents: dict[str, Agent] = field(default_factory=dict)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    server = start_server(tmp_path)
    files: dict[str, bytes] = {}
    httpd, port = _serve(files)
    p = Pair(server, files, port)
    extra = {"stop_shards_on_exit": False, "install_sources": [f"http://127.0.0.1:{port}/"]}
    try:
        for name in ("svc-a", "svc-b"):
            # A real node service: engines outlive the agent.
            p.agents[name] = start_agent(make_agent(tmp_path, server, name, extra=extra))
        wait_for(lambda: sum(n["connected"] for n in server.nodes()) == 2, what="two agents")
        server.approve_pending(2)
        yield p
    finally:
        for agent in p.agents.values():
            if agent.proc is not None:
                stop_process(agent.proc)
            for rec in agent.shard_records().values():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(rec["pid"], signal.SIGKILL)
        stop_process(server.proc)
        httpd.shutdown()


def _routable(server: Server, model: str, node: str) -> dict[str, object] | None:
    for r in server.replicas(model):
        if r["node"] == node and r["routable"]:
            return r
    return None


def test_twenty_agent_restarts_keep_every_engine_and_lose_no_request(pair: Pair) -> None:
    server = pair.server
    server.api("POST", "/api/models", {"name": "svc", "engine": "sim", "replicas": 2})
    wait_for(
        lambda: [r["routable"] for r in server.replicas("svc")] == [True, True],
        what="two routable replicas",
    )
    before = {r["shard"]: (r["pid"], r["restarts"]) for r in server.replicas("svc")}
    victim = pair.agents["svc-a"]
    # Non-streamed requests: any that the killed agent was serving are retried on the other
    # replica by the gateway (nothing was sent to the client yet). A stream already flowing
    # through an agent killed with SIGKILL cannot be resumed; streams are covered by the
    # SIGTERM drain tests.
    client = Client(server.url + "/v1", server.api_key(), "svc", streams=False)
    client.start()
    try:
        for n in range(20):
            sig = signal.SIGKILL if n % 2 == 0 else signal.SIGTERM
            assert victim.proc is not None
            stop_process(victim.proc, sig, timeout=60)
            start_agent(victim)
            wait_for(
                lambda: _routable(server, "svc", "svc-a"),
                timeout=60,
                what=f"svc-a back after restart {n}",
            )
    finally:
        client.stop.set()
        client.join(timeout=60)
    after = {r["shard"]: (r["pid"], r["restarts"]) for r in server.replicas("svc")}
    assert after == before, "an engine was restarted or replaced"
    assert client.ok > 40
    assert client.failures == []
    # No engine was started twice: one sim process per shard port.
    records = victim.shard_records()
    assert len(records) == 1
    (rec,) = records.values()
    assert rec["pid"] == before[next(iter(records))][0]


def test_sigterm_drains_the_node_first(pair: Pair) -> None:
    server = pair.server
    server.api("POST", "/api/models", {"name": "d", "engine": "sim", "replicas": 2})
    wait_for(lambda: [r["routable"] for r in server.replicas("d")] == [True, True], what="routable")
    agent = pair.agents["svc-b"]
    assert agent.proc is not None
    stop_process(agent.proc, signal.SIGTERM)
    events = server.api("GET", "/api/events?subject=svc-b")
    assert any(e["kind"] == "node_draining" for e in events)
    assert "agent stopping; draining" in agent.log()
    # Its engine keeps running after the agent has gone.
    pid = next(r["pid"] for r in server.replicas("d") if r["node"] == "svc-b")
    os.kill(pid, 0)


def _serve(files: dict[str, bytes]) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, int(httpd.server_address[1])


def _tarball(script: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = script.encode()
        info = tarfile.TarInfo("llama-b1/bin/llama-server")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_engine_install_good_and_tampered(pair: Pair, tmp_path: Path) -> None:
    good = _tarball("#!/bin/sh\necho 'version: 4242 (llmgw test build)'\n")
    pair.files.update({"/good.tar.gz": good, "/bad.tar.gz": good + b"tampered"})
    port = pair.files_port
    env = dict(
        os.environ,
        LLMGW_SERVER=pair.server.url,
        LLMGW_TOKEN=pair.server.admin_token,
        XDG_CONFIG_HOME=str(tmp_path),
    )
    ok = subprocess.run(
        [
            *LLMGW,
            "ctl",
            "engines",
            "install",
            "svc-a",
            "llamacpp",
            "b4242",
            "--url",
            f"http://127.0.0.1:{port}/good.tar.gz",
            "--sha256",
            hashlib.sha256(good).hexdigest(),
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # ctl engines install waits and shows the node's row: installed and checked is "ready".
    assert ok.stdout.splitlines()[1].split() == [
        "svc-a",
        platform.machine(),
        "llamacpp",
        "b4242",
        "ready",
    ]
    state = pair.agents["svc-a"].dir / "state"
    manifest = json.loads(
        (state / "engines" / "llamacpp" / "b4242" / "llmgw-engine.json").read_text()
    )
    assert manifest["version"] == "b4242"

    def details() -> list[dict[str, object]]:
        node = next(n for n in pair.server.nodes() if n["id"] == "svc-a")
        inv = pair.server.api("GET", "/api/nodes")
        del inv
        return [e for e in node.get("engine_details", []) if e["name"] == "llamacpp"]

    bad = subprocess.run(
        [
            *LLMGW,
            "ctl",
            "engines",
            "install",
            "svc-a",
            "llamacpp",
            "b4243",
            "--url",
            f"http://127.0.0.1:{port}/bad.tar.gz",
            "--sha256",
            hashlib.sha256(good).hexdigest(),
            "--timeout",
            "60",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
    )
    assert bad.returncode == 1
    assert "checksum mismatch" in bad.stdout
    assert not (state / "engines" / "llamacpp" / "b4243").exists()
    assert [p.name for p in (state / "engines").iterdir() if p.name.startswith(".tmp")] == []
    del details


def test_gateway_waits_for_the_only_replica_while_its_agent_restarts(tmp_path: Path) -> None:
    from tests.integration.harness import start_server_with

    server = start_server_with(tmp_path, replica_wait=30)
    agent = start_agent(make_agent(tmp_path, server, "solo", extra={"stop_shards_on_exit": False}))
    try:
        wait_for(lambda: any(n["connected"] for n in server.nodes()), what="agent")
        server.approve_pending(1)
        server.api("POST", "/api/models", {"name": "one", "engine": "sim", "replicas": 1})
        wait_for(lambda: [r["routable"] for r in server.replicas("one")] == [True], what="routable")
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key=server.api_key(), max_retries=0, timeout=60
        )
        assert agent.proc is not None
        stop_process(agent.proc, signal.SIGTERM)
        # Nothing is routable now; the request waits instead of failing with 503.
        assert [r["routable"] for r in server.replicas("one")] == [False]
        result: dict[str, object] = {}

        def ask() -> None:
            try:
                out = client.chat.completions.create(
                    model="one", messages=[{"role": "user", "content": "x"}]
                )
                result["text"] = out.choices[0].message.content
            except Exception as exc:
                result["error"] = repr(exc)

        thread = threading.Thread(target=ask)
        thread.start()
        time.sleep(1.0)
        start_agent(agent)
        thread.join(timeout=60)
        assert "error" not in result, result
        assert result.get("text")
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        for rec in agent.shard_records().values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec["pid"], signal.SIGKILL)
        stop_process(server.proc)
