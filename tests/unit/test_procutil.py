"""llmgw.procutil against real processes: this one, children that end, and a zombie."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmgw.procutil import process_running, process_start_time


def test_process_start_time_of_this_process() -> None:
    value = process_start_time(os.getpid())
    assert isinstance(value, int)
    assert value > 0
    assert process_start_time(os.getpid()) == value


def test_process_start_time_of_a_dead_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_start_time(proc.pid) is None


def test_process_start_time_survives_odd_command_names(tmp_path: Path) -> None:
    # The command name (field 2) may hold spaces and parentheses.
    odd = tmp_path / "we ird) (name"
    odd.symlink_to(sys.executable)
    proc = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        value = process_start_time(proc.pid)
        assert isinstance(value, int)
        assert value >= process_start_time(os.getpid())  # type: ignore[operator]
    finally:
        proc.kill()
        proc.wait()


def test_a_process_runs_only_with_its_own_start_time() -> None:
    me = os.getpid()
    start = process_start_time(me)
    assert process_running(me, start)
    assert not process_running(me, start + 1)  # type: ignore[operator]  # a reused pid
    assert not process_running(me, None)


def test_an_ended_process_is_not_running() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    start = process_start_time(proc.pid)
    assert process_running(proc.pid, start)
    proc.communicate(b"")  # it ends and is reaped
    assert not process_running(proc.pid, start)


def test_a_zombie_is_not_running() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start_time(proc.pid)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped
    try:
        assert process_start_time(proc.pid) == start  # still in /proc
        assert not process_running(proc.pid, start)
    finally:
        proc.wait()
