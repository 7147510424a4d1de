"""A rolling restart of instances behind haproxy, for tests/integration/test_drain.py and a
bench (bench/continuity.py): Debian's haproxy run as a plain process with the configuration
an operator would write (README, "High availability": /healthz checked, ``option
redispatch`` and ``retries``), and each instance in turn stopped with SIGTERM (it drains)
and started again, the next only once haproxy sends to it again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.ha import Instance, health
from tests.integration.harness import free_port, stop_process, wait_for


def haproxy_binary() -> str | None:
    return shutil.which("haproxy") or (
        "/usr/sbin/haproxy" if os.access("/usr/sbin/haproxy", os.X_OK) else None
    )


def haproxy_config(port: int, backends: list[tuple[str, int]], *, inter_ms: int = 500) -> str:
    """What the README shows, with the check interval shortened (the drain's grace must
    cover ``fall`` checks: 2 times 500 ms here against a 2 s grace)."""
    servers = "\n".join(
        f"    server {name} 127.0.0.1:{p} check inter {inter_ms} fall 2 rise 2"
        for name, p in backends
    )
    return f"""\
global
    maxconn 4096

defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response response-timeout 503

frontend llmgw
    bind 127.0.0.1:{port}
    default_backend instances

backend instances
    balance leastconn
    option httpchk GET /healthz
    http-check expect status 200
{servers}
"""


@dataclass
class Haproxy:
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def up(self) -> set[str]:
        """The servers haproxy sends to now (from its stats CSV; none before it listens)."""
        try:
            with urllib.request.urlopen(self.url + "/haproxy-stats;csv", timeout=5) as resp:
                lines = resp.read().decode().splitlines()
        except OSError:
            return set()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:]]
        return {
            r["svname"]
            for r in rows
            if r.get("pxname") == "instances"
            and r["svname"] not in ("BACKEND", "FRONTEND")
            and r["status"] == "UP"
        }

    def stop(self) -> None:
        stop_process(self.proc)


def start_haproxy(tmp: Path, instances: list[Instance], *, inter_ms: int = 500) -> Haproxy:
    binary = haproxy_binary()
    assert binary, "haproxy is missing: apt-get install -y haproxy (.ci/run installs it)"
    port = free_port()
    text = haproxy_config(
        port, [(i.name, i.server.http_port) for i in instances], inter_ms=inter_ms
    )
    # The stats page the helper reads which servers are up from (the test's addition).
    text = text.replace(
        "frontend llmgw\n",
        "frontend llmgw\n    stats enable\n    stats uri /haproxy-stats\n",
    )
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(text)
    log = tmp / "haproxy.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [binary, "-db", "-f", str(cfg)], stdout=out, stderr=out, start_new_session=True
        )
    proxy = Haproxy(port, proc, log)
    names = {i.name for i in instances}
    wait_for(lambda: proc.poll() is None and proxy.up() == names, timeout=30, what="haproxy up")
    return proxy


@dataclass
class Restart:
    """One instance's turn: how long its stop took, and until haproxy sent to it again."""

    name: str
    stop_s: float
    back_s: float
    exit_code: int


@dataclass
class RollingRestart:
    turns: list[Restart] = field(default_factory=list)


def rolling_restart(
    instances: list[Instance],
    proxy: Haproxy,
    start: Callable[[Instance], Instance],
    *,
    stop_timeout: float,
) -> RollingRestart:
    """Each instance in turn: SIGTERM (it drains and exits), started again by *start* (which
    returns the new process's Instance, put in its place in *instances*), then the next
    once haproxy counts it up again."""
    done = RollingRestart()
    for index, inst in enumerate(list(instances)):
        began = time.monotonic()
        os.kill(inst.server.proc.pid, signal.SIGTERM)
        code = inst.server.proc.wait(timeout=stop_timeout)
        stopped = time.monotonic() - began
        new = start(inst)
        instances[index] = new
        wait_for(lambda new=new: health(new.server)[0] == 200, timeout=60, what=f"{new.name} up")
        wait_for(lambda new=new: new.name in proxy.up(), timeout=30, what=f"haproxy: {new.name}")
        done.turns.append(
            Restart(inst.name, round(stopped, 1), round(time.monotonic() - began, 1), code)
        )
    return done
