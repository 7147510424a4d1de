#!/usr/bin/python3
"""A STAND-IN for the llmgw program, used only as the payload of the package-mechanics tests.

It is not llmgw: it prints ``llmgw VERSION`` for ``--version`` and, run by the units as
``llmgw agent ...`` or ``llmgw server ...``, behaves the way systemd sees llmgw: the agent
starts one long-lived "engine" (``sleep``) unless the one it recorded still runs, sends
READY=1 and WATCHDOG=1, and both write what they saw to ``STATE/standin-run.json``.
The tests copy it with STANDIN_VERSION replaced. The real program is checked separately,
with the one-folder build, when ``dist/`` holds one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

STANDIN_VERSION = "0.0.0"
STATE_DIRS = {"agent": "/var/lib/llmgw-agent", "server": "/var/lib/llmgw"}


def notify(message: str) -> None:
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def engine(state: str) -> int:
    """The engine a previous run started, or a new one (it outlives this process)."""
    record = os.path.join(state, "standin-engine.pid")
    try:
        with open(record) as f:
            pid = int(f.read())
        if alive(pid):
            return pid
    except (OSError, ValueError):
        pass
    child = subprocess.Popen(["sleep", "infinity"], start_new_session=True)
    with open(record, "w") as f:
        f.write(str(child.pid))
    return child.pid


def serve(role: str) -> int:
    state = STATE_DIRS[role]
    seen = {
        "version": STANDIN_VERSION,
        "pid": os.getpid(),
        "uid": os.getuid(),
        "tmpdir": os.environ.get("TMPDIR"),
        "engine_pid": engine(state) if role == "agent" else None,
    }
    with open(os.path.join(state, "standin-run.json"), "w") as f:
        json.dump(seen, f)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    notify("READY=1")
    usec = os.environ.get("WATCHDOG_USEC", "")
    interval = int(usec) / 2e6 if usec.isdigit() else 1.0
    while not stop:
        notify("WATCHDOG=1")
        time.sleep(min(interval, 0.5))
    notify("STOPPING=1")
    return 0


def main(args: list[str]) -> int:
    if args[:1] in (["--version"], ["-V"]):
        print(f"llmgw {STANDIN_VERSION}")
        return 0
    if not args or args[0] not in STATE_DIRS:
        print("llmgw stand-in: give --version, agent or server", file=sys.stderr)
        return 2
    if "--check" in args:
        print("llmgw stand-in: --check is for the real program", file=sys.stderr)
        return 2
    return serve(args[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
