"""Desired engines end to end: ``llmgw ctl engines install --all`` before any node joined,
kept across a control-plane restart; a node that joins afterwards gets the build for its
architecture, and no replica of that engine lands on it until the install was checked (a
wrong SHA-256 fails it, ``ctl models`` says why); the right build installs, the replica
serves through the gateway from the installed program, and a reconnect re-checks the
install without downloading it again.

The build is a stand-in ``llama-server`` (a Python script answering ``--version`` and
serving /health and chat completions), fetched over file:// from a folder the agent lists
in ``install_sources``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    LLMGW,
    Server,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FAKE_SERVER = """#!{python}
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

if "--version" in sys.argv:
    print("version: 4242 (stand-in llama.cpp b1)")
    sys.exit(0)
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
alias = args[args.index("--alias") + 1]


class Handler(BaseHTTPRequestHandler):
    def answer(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.answer({{"status": "ok"}})
        else:
            self.answer({{"object": "list", "data": [{{"id": alias, "object": "model"}}]}})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.answer({{
            "id": "c1", "object": "chat.completion", "created": int(time.time()),
            "model": alias,
            "choices": [{{"index": 0, "finish_reason": "stop",
                         "message": {{"role": "assistant", "content": "from the installed b1"}}}}],
            "usage": {{"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}},
        }})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def build_archive() -> bytes:
    script = FAKE_SERVER.format(python=sys.executable).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        info = tarfile.TarInfo("llama-b1/bin/llama-server")
        info.size, info.mode = len(script), 0o755
        tar.addfile(info, io.BytesIO(script))
    return out.getvalue()


def ctl(server: Server, tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        LLMGW_SERVER=server.url,
        LLMGW_TOKEN=server.admin_token,
        XDG_CONFIG_HOME=str(tmp),
    )
    return subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=120
    )


def restart(server: Server, tmp: Path) -> None:
    stop_process(server.proc)
    with open(server.log_path, "ab") as out:
        server.proc = subprocess.Popen(
            [*LLMGW, "server", "--config", str(tmp / "server.yaml")], stdout=out, stderr=out
        )

    def up() -> bool:
        try:
            server.api("GET", "/api/status")
        except (urllib.error.URLError, OSError):
            return False
        return True

    wait_for(up, what="the control plane back")


def engine_row(server: Server, node: str) -> dict[str, Any] | None:
    rows = server.api("GET", "/api/engines")["nodes"]
    return next((r for r in rows if r["node"] == node and r["engine"] == "llamacpp"), None)


def test_desired_engine_reaches_a_node_that_joins_after_a_restart(tmp_path: Path) -> None:
    builds = tmp_path / "builds"
    builds.mkdir()
    archive = build_archive()
    (builds / "llama-b1.tar.gz").write_bytes(archive)
    url = (builds / "llama-b1.tar.gz").as_uri()
    good = hashlib.sha256(archive).hexdigest()
    wrong = hashlib.sha256(b"another build").hexdigest()
    arch = platform.machine()
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").write_bytes(b"GGUF")

    server = start_server(tmp_path)
    agent = None
    try:
        # Recorded with no node at all, then kept across a restart.
        out = ctl(server, tmp_path, "engines", "install", "--all", "llamacpp", "b1",
                  "--url", url, "--sha256", wrong, "--arch", arch)  # fmt: skip
        assert out.returncode == 0, out.stderr
        restart(server, tmp_path)
        out = ctl(server, tmp_path, "--json", "engines")
        assert out.returncode == 0, out.stderr
        (desired,) = json.loads(out.stdout)["desired"]
        assert desired == {
            "node": None,
            "engine": "llamacpp",
            "version": "b1",
            "builds": [{"arch": arch, "url": url, "sha256": wrong}],
        }

        # A node joins afterwards: it is ordered the build, which fails its check.
        agent = start_agent(
            make_agent(
                tmp_path,
                server,
                "late-1",
                extra={"install_sources": [builds.as_uri() + "/"], "models_root": str(models)},
            )
        )
        server.approve_pending(1)
        failed = wait_for(
            lambda: (r := engine_row(server, "late-1")) and r["state"] == "failed" and r,
            timeout=60,
            what="the wrong build to fail on the node",
        )
        assert "checksum mismatch" in failed["reason"]
        server.api(
            "POST",
            "/api/models",
            {
                "name": "tiny",
                "engine": "llamacpp",
                "replicas": 1,
                "source": str(models / "tiny.gguf"),
            },
        )
        problem = wait_for(
            lambda: next(m for m in server.api("GET", "/api/models") if m["name"] == "tiny")[
                "unplaceable"
            ],
            what="the model's reason",
        )
        assert problem.startswith("late-1: llamacpp b1 failed to install: checksum mismatch")
        assert server.replicas("tiny") == []
        out = ctl(server, tmp_path, "models")
        assert "llamacpp b1 failed to install" in out.stdout

        # The right build: installed, checked, and only then the replica is placed.
        out = ctl(server, tmp_path, "engines", "install", "--all", "llamacpp", "b1",
                  "--url", url, "--sha256", good, "--arch", arch, "--timeout", "60")  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.splitlines()[1].split()[:5] == ["late-1", arch, "llamacpp", "b1", "ready"]
        wait_for(
            lambda: [r["state"] for r in server.replicas("tiny")] == ["ready"],
            timeout=60,
            what="the replica ready on the installed engine",
        )
        key = server.api_key()
        answer = openai.OpenAI(base_url=server.url + "/v1", api_key=key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "which build?"}]
        )
        assert answer.choices[0].message.content == "from the installed b1"

        # A control-plane restart: the order is sent again, the agent checks what it has.
        manifest = agent.dir / "state" / "engines" / "llamacpp" / "b1" / "llmgw-engine.json"
        before = manifest.stat()
        first_op = engine_row(server, "late-1")
        assert first_op is not None and first_op["state"] == "ready"
        restart(server, tmp_path)
        wait_for(
            lambda: (
                (r := engine_row(server, "late-1")) is not None
                and r["connected"]
                and r["op_id"] != first_op["op_id"]
                and r["state"] == "ready"
            ),
            timeout=60,
            what="the re-sent order checked on the node",
        )
        after = manifest.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        assert agent.log().count("installed llamacpp b1 from") == 1  # one download, ever
        wait_for(
            lambda: any(r["routable"] for r in server.replicas("tiny")),
            timeout=60,
            what="the replica routable again",
        )
        out = ctl(server, tmp_path, "engines")
        (line,) = [x for x in out.stdout.splitlines() if x.startswith("late-1")]
        assert line.split()[:6] == ["late-1", arch, "llamacpp", "b1", "b1", "ready"]

        # Forgotten: nothing desired, the install stays where it is.
        out = ctl(server, tmp_path, "engines", "forget", "--all", "llamacpp")
        assert out.returncode == 0, out.stderr
        assert server.api("GET", "/api/engines")["desired"] == []
        assert manifest.exists()
    finally:
        if agent is not None and agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def test_what_cannot_be_desired_is_refused_with_the_fix(tmp_path: Path) -> None:
    server = start_server(tmp_path)
    try:
        sha = "c" * 64
        cases = [
            (
                ["--all", "llamacpp", "b1", "--url", "ftp://h/x.tgz", "--sha256", sha],
                "the nodes do not fetch 'ftp://h/x.tgz'",
            ),
            (
                ["--all", "llamacpp", "b1", "--url", "https://h/x.tgz", "--sha256", "abc"],
                "sha256 'abc' is not 64 hex digits",
            ),
            (
                ["nobody", "llamacpp", "b1", "--url", "https://h/x.tgz", "--sha256", sha],
                "nobody",
            ),
        ]
        for args, message in cases:
            out = ctl(server, tmp_path, "engines", "install", *args)
            assert out.returncode == 1, out.stdout
            assert message in out.stderr
        out = ctl(server, tmp_path, "engines", "forget", "--all", "vllm")
        assert out.returncode == 1
        assert "no vllm build is desired on every node" in out.stderr
        assert server.api("GET", "/api/engines") == {"desired": [], "nodes": []}
    finally:
        stop_process(server.proc)
