"""What the hostile-input tests share: the cluster they attack (one real ``llmgw up`` for the
package, the ``up`` fixture of conftest.py), the checks every module ends with (no traceback
in any log, /healthz still 200, RSS bounded), and a raw HTTP exchange.

The modules send what an attacker on the network (or a holder of an API key or a node
certificate) would send to each listener: :8080 gateway and admin API, :8443 enrolment,
:9443 data plane, :7443 gRPC stream.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.integration.harness import cmdline

# RSS may grow this much over what the process had once the cluster was up; a leak per
# request (or a body kept whole) over a module's thousands of requests goes far above it.
RSS_GROWTH_LIMIT = 150 * 1024 * 1024


@dataclass
class Cluster:
    """A running ``llmgw up`` and what a test needs to reach each of its listeners."""

    proc: subprocess.Popen[str]
    state_dir: Path
    http_port: int
    grpc_port: int
    enroll_port: int
    agent_port: int
    api_key: str
    output: list[str] = field(default_factory=list)
    rss_at_start: dict[int, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "server" / "pki"

    @property
    def admin_token(self) -> str:
        return (self.state_dir / "server" / "admin.token").read_text().strip()

    def log_count(self, needle: str, *, at_least: int = 0, name: str = "server.log") -> int:
        """Lines of ``logs/<name>`` holding ``needle``; waits (up to 10 s) for ``at_least``."""
        path = self.state_dir / "logs" / name
        deadline = time.monotonic() + 10
        while True:
            n = path.read_text(errors="replace").count(needle) if path.exists() else 0
            if n >= at_least or time.monotonic() > deadline:
                return n
            time.sleep(0.05)

    def logs(self) -> str:
        text = "".join(self.output)
        for name in ("server.log", "agent.log"):
            path = self.state_dir / "logs" / name
            if path.exists():
                text += path.read_text(errors="replace")
        return text

    def pids(self) -> list[int]:
        """The control plane (``up`` itself) and the local agent."""
        found = [self.proc.pid]
        agent_yaml = str(self.state_dir / "agent" / "agent.yaml")
        for entry in os.listdir("/proc"):
            if entry.isdigit() and agent_yaml in cmdline(int(entry)):
                found.append(int(entry))
        return found

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        *,
        admin: bool = False,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            hdrs = dict(headers or {})
            if admin:
                hdrs.setdefault("Authorization", f"Bearer {self.admin_token}")
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def assert_still_healthy(cluster: Cluster) -> None:
    """What every hostile module ends with: no traceback logged by any process, /healthz
    answers 200 with the node still connected, and neither process grew without bound."""
    logs = cluster.logs()
    assert "Traceback" not in logs, _around(logs, "Traceback")
    status, body = cluster.request("GET", "/healthz", admin=True)  # the details: a reader's
    assert status == 200, body
    assert json.loads(body)["nodes"] == 1, body
    for pid, before in cluster.rss_at_start.items():
        now = rss(pid)
        print(f"RSS of {pid}: {before >> 20} MiB at start, {now >> 20} MiB now")
        assert now < before + RSS_GROWTH_LIMIT, (
            f"pid {pid} ({cmdline(pid)[:80]}) grew from {before >> 20} MiB to {now >> 20} MiB"
        )


def _around(text: str, needle: str) -> str:
    at = text.find(needle)
    return text[max(0, at - 500) : at + 3000]


def raw_exchange(
    port: int,
    data: bytes,
    *,
    tls: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    timeout: float = 20.0,
    method: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` as is and parse one HTTP answer: (status, headers, body); status 0 when
    the server closed without answering. Parsed here, not by http.client, which refuses the
    HTTP/2.0 or HTTP/0.9 status lines a server echoes back."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
        sock: Any = raw
        if tls is not None:
            sock = tls.wrap_socket(raw, server_hostname=server_hostname or "127.0.0.1")
        sock.sendall(data)
        reader = sock.makefile("rb")
        while True:
            try:
                line = reader.readline(65537)
            except (ConnectionResetError, ssl.SSLError):
                return 0, {}, b""
            if not line:
                return 0, {}, b""
            match = re.match(rb"HTTP/\d\.\d (\d{3})", line)
            assert match, f"not an HTTP status line: {line[:200]!r}"
            status = int(match.group(1))
            headers: dict[str, str] = {}
            while (line := reader.readline(65537)) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
            if status >= 200:
                break
        if method == "HEAD" or status in (204, 304):
            return status, headers, b""
        if "content-length" in headers:
            return status, headers, reader.read(int(headers["content-length"]))
        if "chunked" in headers.get("transfer-encoding", ""):
            body = b""
            while size := int(reader.readline().split(b";")[0], 16):
                body += reader.read(size)
                reader.readline()
            reader.readline()
            return status, headers, body
        return status, headers, reader.read()


def json_error(body: bytes) -> dict[str, Any]:
    """The ``error`` object of a JSON error answer (asserting it is one)."""
    data = json.loads(body)
    assert isinstance(data, dict) and isinstance(data.get("error"), dict), body[:300]
    error: dict[str, Any] = data["error"]
    assert isinstance(error.get("message"), str) and error["message"], body[:300]
    return error


def seconds_until_closed(port: int, data: bytes, *, timeout: float = 30.0) -> float:
    """Send ``data`` as is to ``port`` and read until the server closes the connection (or
    resets it); how long that took after the send."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        started = time.monotonic()
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        return time.monotonic() - started
