"""Whether dockerd answers, for a node whose runtime is docker: a daemon that is not there, a
stand-in daemon on a unix socket that answers as dockerd does, and one that answers wrong."""

from __future__ import annotations

import json
import socketserver
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from llmgw.agent.discovery.docker import docker_address, docker_problem
from llmgw.agent.dockerproxy import DEFAULT_LISTEN


class _Daemon(BaseHTTPRequestHandler):
    """What the SDK asks before and for a ping: its API version, then /_ping."""

    broken = False

    def do_GET(self) -> None:
        if self.broken:
            body, status, kind = b'{"message": "daemon is shutting down"}', 500, "application/json"
        elif self.path == "/version":
            body = json.dumps({"ApiVersion": "1.43", "Version": "24.0.7"}).encode()
            status, kind = 200, "application/json"
        elif self.path.endswith("/_ping"):
            body, status, kind = b"OK", 200, "text/plain"
        else:
            body, status, kind = b'{"message": "page not found"}', 404, "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a unix socket has no client address to log


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _serve(path: Path, handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = _Server(str(path), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"unix://{path}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def dockerd(tmp_path: Path) -> Iterator[str]:
    yield from _serve(tmp_path / "docker.sock", _Daemon)


@pytest.fixture
def broken_dockerd(tmp_path: Path) -> Iterator[str]:
    class Broken(_Daemon):
        broken = True

    yield from _serve(tmp_path / "broken.sock", Broken)


def test_a_daemon_that_answers_is_no_problem(dockerd: str) -> None:
    assert docker_problem(dockerd) == ""


def test_no_daemon_says_so_and_what_to_install(tmp_path: Path) -> None:
    host = f"unix://{tmp_path / 'absent.sock'}"
    problem = docker_problem(host, timeout=2)
    assert problem.startswith(
        f"runtime is docker but dockerd at {host} cannot be reached (No such file or directory); "
    )
    assert "apt install docker.io" in problem and "systemctl start docker" in problem
    assert "install-agent.sh install --docker" in problem
    assert problem.endswith("until then this node runs no shard")


def test_a_socket_nobody_listens_on_is_refused(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))  # bound, never listening: what a dead dockerd leaves behind
    try:
        problem = docker_problem(f"unix://{path}", timeout=2)
    finally:
        stale.close()
    assert "(Connection refused)" in problem


def test_a_daemon_that_answers_with_errors_is_a_problem(broken_dockerd: str) -> None:
    problem = docker_problem(broken_dockerd, timeout=2)
    assert problem.startswith(
        f"runtime is docker but dockerd at {broken_dockerd} does not answer as it should ("
    )
    assert "daemon is shutting down" in problem
    assert "journalctl -u docker" in problem and "systemctl restart docker" in problem
    assert problem.endswith("until then this node runs no shard")


def test_the_proxy_socket_names_the_proxy() -> None:
    # A socket in the proxy's directory that is surely not there, on any machine.
    host = f"unix://{DEFAULT_LISTEN.parent}/not-there-{id(object())}.sock"
    problem = docker_problem(host, timeout=2)
    assert f"dockerd at {host} cannot be reached" in problem
    assert "systemctl start llmgw-docker-proxy" in problem
    assert "apt install docker.io" not in problem


def test_the_address_follows_docker_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    assert docker_address(None) == "unix:///var/run/docker.sock"
    monkeypatch.setenv("DOCKER_HOST", "tcp://10.0.0.5:2375")
    assert docker_address(None) == "tcp://10.0.0.5:2375"
    assert docker_address("unix:///run/x.sock") == "unix:///run/x.sock"
