"""systemd readiness: READY=1 only once the stream is up and the data plane listens."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.harness import (
    LLMGW,
    listening,
    make_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration


def test_ready_after_stream_and_dataplane_then_status_and_watchdog(tmp_path: Path) -> None:
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(0.2)
    server = start_server(tmp_path)
    agent = make_agent(tmp_path, server, "notified")
    # Stop the control plane first: the agent must not claim readiness without a stream.
    stop_process(server.proc)
    env = dict(os.environ, NOTIFY_SOCKET=str(notify_path), WATCHDOG_USEC="1000000")
    proc = subprocess.Popen(
        [*LLMGW, "agent", "--config", str(agent.config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    messages: list[tuple[float, str]] = []

    def drain() -> None:
        while True:
            try:
                data = sock.recv(4096).decode()
            except TimeoutError:
                return
            messages.extend((time.monotonic(), line) for line in data.splitlines())

    try:
        wait_for(lambda: listening(agent.dataplane_port), what="data plane listening")
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            drain()
        assert "READY=1" not in [m for _, m in messages], messages
        assert any(m == "WATCHDOG=1" for _, m in messages), "watchdog pings while waiting"
        # The control plane comes back on the same ports: now the agent is ready.
        cfg = tmp_path / "server.yaml"
        with open(server.log_path, "ab") as out:
            server.proc = subprocess.Popen(
                [*LLMGW, "server", "--config", str(cfg)], stdout=out, stderr=out
            )

        def ready() -> bool:
            drain()
            return "READY=1" in [m for _, m in messages]

        wait_for(ready, timeout=60, what="READY=1")
        statuses = [m for _, m in messages if m.startswith("STATUS=")]
        assert any(
            s.startswith("STATUS=connected to 127.0.0.1:") and s.endswith("0 shards")
            for s in statuses
        )
        proc.terminate()
        proc.wait(timeout=60)
        drain()
        assert "STOPPING=1" in [m for _, m in messages]
    finally:
        stop_process(proc)
        stop_process(server.proc)
        sock.close()
