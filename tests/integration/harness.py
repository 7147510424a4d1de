"""Real processes for integration tests: a control plane, agents, and `llmgw up`.

Everything runs as subprocesses of the test on loopback with ports picked free, through
the same `llmgw` entry point a user runs, so TLS, gRPC and the data plane are the real ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import yaml

from llmgw import pki

LLMGW = [sys.executable, "-m", "llmgw"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(
    predicate: Any, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def stop_process(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30.0
) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class Server:
    """A control plane subprocess."""

    state_dir: Path
    http_port: int
    grpc_port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pki_dir(self) -> Path:
        return self.state_dir / "pki"

    @property
    def admin_token(self) -> str:
        return (self.state_dir / "admin.token").read_text().strip()

    @property
    def metrics_token(self) -> str:
        return (self.state_dir / "metrics.token").read_text().strip()

    def metrics(self) -> str:
        """/metrics as Prometheus scrapes it: with the metrics token."""
        req = urllib.request.Request(
            self.url + "/metrics", headers={"Authorization": f"Bearer {self.metrics_token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return str(resp.read().decode())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode() if body is not None else None,
            method=method,
            headers={
                "Authorization": f"Bearer {self.admin_token}",
                "Content-Type": "application/json",
            },
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def replicas(self, model: str | None = None) -> list[dict[str, Any]]:
        return self.api("GET", "/api/replicas" + (f"?model={model}" if model else ""))  # type: ignore[no-any-return]

    def nodes(self) -> list[dict[str, Any]]:
        return self.api("GET", "/api/nodes")  # type: ignore[no-any-return]

    def approve_pending(self, expected: int = 1) -> list[str]:
        """Approve pending nodes with the fingerprints they connected with, as an operator would."""
        pending = wait_for(
            lambda: (
                [n for n in self.nodes() if n["state"] == "pending" and n["connected"]][:expected]
                if len([n for n in self.nodes() if n["state"] == "pending" and n["connected"]])
                >= expected
                else None
            ),
            what=f"{expected} pending node(s)",
        )
        for node in pending:
            self.api(
                "POST", f"/api/nodes/{node['id']}/approve", {"fingerprint": node["fingerprint"]}
            )
        return [n["id"] for n in pending]

    def approve(self, *node_ids: str) -> None:
        """Approve these nodes, once each is pending and connected, with its fingerprint."""
        for node_id in node_ids:
            node = wait_for(
                lambda node_id=node_id: next(
                    (
                        n
                        for n in self.nodes()
                        if n["id"] == node_id and n["state"] == "pending" and n["connected"]
                    ),
                    None,
                ),
                what=f"{node_id} pending",
            )
            self.api("POST", f"/api/nodes/{node_id}/approve", {"fingerprint": node["fingerprint"]})

    def api_key(self, name: str | None = None) -> str:
        """A new key's secret; unnamed, a fresh name each (an active key's name is taken)."""
        name = name or f"test-{secrets.token_hex(4)}"
        return str(self.api("POST", "/api/keys", {"name": name})["key"])


def run_ctl(server: Server, config_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``llmgw ctl ARGS`` against ``server`` as its admin, with ``config_dir`` as its
    XDG_CONFIG_HOME and no other LLMGW_ variable of this environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env.update(
        LLMGW_SERVER=server.url,
        LLMGW_TOKEN=server.admin_token,
        XDG_CONFIG_HOME=str(config_dir),
    )
    return subprocess.run(
        [*LLMGW, "ctl", *args], capture_output=True, text=True, env=env, timeout=60
    )


def start_server(tmp: Path, *, heartbeat: float = 1.0) -> Server:
    """A control plane on free loopback ports, state under ``tmp/server``, ready to serve."""
    return start_server_with(tmp, heartbeat=heartbeat)


@dataclass
class Agent:
    node_id: str
    dir: Path
    config: Path
    dataplane_port: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default=Path("/dev/null"))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def shard_records(self) -> dict[str, Any]:
        try:
            return json.loads((self.dir / "state" / "shards.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {}

    def kill_engines(self) -> None:
        """Kill the engines its shards.json records (each its own session and process
        group): for a test whose agent leaves them running (``stop_shards_on_exit: false``),
        once it is done with them."""
        for record in self.shard_records().values():
            pid = record.get("pid") if isinstance(record, dict) else None
            if isinstance(pid, int) and pid > 1:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


def make_agent(
    tmp: Path,
    server: Server,
    node_id: str,
    *,
    cert_node_id: str | None = None,
    ca_dir: Path | None = None,
    extra: dict[str, Any] | None = None,
) -> Agent:
    """Issue a certificate (for ``cert_node_id``, default the node id) and write agent.yaml."""
    d = tmp / f"agent-{node_id}"
    d.mkdir(parents=True, exist_ok=True)
    ca = pki.load_ca(ca_dir or server.pki_dir)
    ident = pki.issue_node_cert(ca, cert_node_id or node_id, d / "pki")
    port = free_port()
    cfg: dict[str, Any] = {
        "server": f"127.0.0.1:{server.grpc_port}",
        "node_id": node_id,
        "listen": f"127.0.0.1:{port}",
        "state_dir": str(d / "state"),
        "tls": {"cert": str(ident.cert), "key": str(ident.key), "ca": str(ident.ca)},
        "stop_shards_on_exit": True,
    }
    if ca_dir is not None:
        # A node of another cluster still trusts *our* server's CA for the stream, so
        # that the refusal under test is the server refusing its certificate.
        cfg["tls"]["ca"] = str(server.pki_dir / "ca.crt")
    cfg.update(extra or {})
    if "servers" in cfg:
        cfg.pop("server")
    path = d / "agent.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return Agent(node_id, d, path, port)


def start_agent(agent: Agent, *, env: dict[str, str] | None = None) -> Agent:
    """Start ``agent``'s process; ``env``: its environment (default: this one's)."""
    agent.log_path = agent.dir / "agent.log"
    with open(agent.log_path, "ab") as out:
        agent.proc = subprocess.Popen(
            [*LLMGW, "agent", "--config", str(agent.config)], stdout=out, stderr=out, env=env
        )
    return agent


def pids_of_session(sid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) == sid:
                out.append(int(entry))
        except OSError:
            continue
    return out


def alive(pid: int) -> bool:
    """``pid`` exists (a zombie, not yet reaped, counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Something accepts TCP connections on ``host:port`` (within a second)."""
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def cmdline(pid: int) -> str:
    """The command line of process ``pid``, its arguments joined by spaces ("" once gone)."""
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def start_server_with(tmp: Path, *, heartbeat: float = 1.0, **extra: Any) -> Server:
    """:func:`start_server` with more keys in server.yaml (e.g. ``cert_lifetime=12``); a key
    given as None is left out, so the server's default holds (``loss_timeout=None``)."""
    state = tmp / "server"
    http_port, grpc_port = free_port(), free_port()
    keys: dict[str, Any] = {
        "state_dir": str(state),
        "http_listen": f"127.0.0.1:{http_port}",
        "grpc_listen": f"127.0.0.1:{grpc_port}",
        "enroll_listen": "127.0.0.1:0",
        "heartbeat_interval": heartbeat,
        # Long enough that an agent restart is not a loss; loss tests shorten it.
        "loss_timeout": max(10.0, heartbeat * 3),
        "replica_wait": 2,
        # No load balancer checks /healthz here: a stop waits for no grace (the drain's own
        # tests set one).
        "drain_grace": 0,
        **extra,
    }
    cfg = tmp / "server.yaml"
    cfg.write_text(yaml.safe_dump({k: v for k, v in keys.items() if v is not None}))
    log_path = tmp / "server.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen([*LLMGW, "server", "--config", str(cfg)], stdout=out, stderr=out)
    server = Server(state, http_port, grpc_port, proc, log_path)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.url + "/healthz", timeout=1) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    wait_for(healthy, what="control plane /healthz")
    return server


class Client(threading.Thread):
    """Sends requests through the gateway until stopped, alternating streamed and not."""

    def __init__(
        self,
        base_url: str,
        key: str,
        model: str,
        *,
        streams: bool = True,
        max_tokens: int = 8,
        extra_body: dict[str, object] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.streams = streams
        self.max_tokens = max_tokens
        self.extra_body = extra_body
        self.client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
        self.model = model
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []

    def run(self) -> None:
        i = 0
        while not self.stop.is_set() and i < 100_000:
            i += 1
            try:
                if i % 2 or not self.streams:
                    out = self.client.chat.completions.create(
                        model=self.model,
                        messages=[{"role": "user", "content": f"q{i}"}],
                        max_tokens=self.max_tokens,
                        extra_body=self.extra_body,
                    )
                    assert out.choices[0].message.content
                else:
                    text = "".join(
                        c.choices[0].delta.content or ""
                        for c in self.client.chat.completions.create(
                            model=self.model,
                            messages=[{"role": "user", "content": f"s{i}"}],
                            max_tokens=self.max_tokens,
                            extra_body=self.extra_body,
                            stream=True,
                        )
                        if c.choices
                    )
                    assert text
                self.ok += 1
            except Exception as exc:
                self.failures.append(f"request {i}: {type(exc).__name__}: {exc}")


@dataclass
class Up:
    """A running ``llmgw up`` and what its banner said."""

    proc: subprocess.Popen[str]
    state_dir: Path
    base_url: str
    api_key: str
    output: list[str]


def start_up(
    state_dir: Path,
    *,
    port: int | None = None,
    grpc_port: int = 0,
    agent_port: int = 0,
    enroll_port: int = 0,
) -> Up:
    """``llmgw up`` on ``state_dir`` (the HTTP port free when not given, the others as given:
    0 lets it pick), once its banner has said the base URL and the API key."""
    env = dict(os.environ, XDG_CONFIG_HOME=str(state_dir / "xdg"), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            *LLMGW,
            "up",
            "--state-dir",
            str(state_dir),
            "--port",
            str(port or free_port()),
            "--grpc-port",
            str(grpc_port),
            "--agent-port",
            str(agent_port),
            "--enroll-port",
            str(enroll_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines: list[str] = []
    found: dict[str, str] = {}
    assert proc.stdout is not None
    stdout = proc.stdout

    def reader() -> None:
        for line in stdout:
            lines.append(line)
            if m := re.search(r"OpenAI base URL: (\S+)", line):
                found["url"] = m.group(1)
            if m := re.search(r"API key: +(\S+)", line):
                found["key"] = m.group(1)

    threading.Thread(target=reader, daemon=True).start()
    try:
        wait_for(
            lambda: ("url" in found and "key" in found) or proc.poll() is not None,
            timeout=120,
            what="llmgw up banner",
        )
    except AssertionError:
        stop_process(proc, signal.SIGKILL)  # type: ignore[arg-type]
        raise AssertionError("".join(lines)) from None
    assert proc.poll() is None, "".join(lines)
    return Up(proc, state_dir, found["url"], found["key"], lines)
