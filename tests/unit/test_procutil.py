"""llmgw.procutil against real processes: programs run to the end or killed with their
helpers, this one, children that end, and a zombie."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmgw.procutil import process_running, process_start_time, run_to_end


def test_run_to_end_keeps_stdout_and_stderr_apart() -> None:
    result = run_to_end(
        [
            sys.executable,
            "-c",
            "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
        ],
        10,
    )
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_run_to_end_merges_stderr_into_stdout_in_order() -> None:
    script = "import sys; print('one', flush=True); print('two', file=sys.stderr, flush=True); print('three')"
    result = run_to_end([sys.executable, "-c", script], 10, merge_stderr=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "one\ntwo\nthree\n", "")


def test_run_to_end_passes_the_environment_and_no_input() -> None:
    script = "import os, sys; print(os.environ.get('PROBE'), repr(sys.stdin.read()))"
    result = run_to_end([sys.executable, "-c", script], 10, env={"PROBE": "yes"})
    assert result.stdout == "yes ''\n"


def test_run_to_end_replaces_undecodable_bytes() -> None:
    script = "import sys; sys.stdout.buffer.write(b'a\\xffb')"
    assert run_to_end([sys.executable, "-c", script], 10).stdout == "a\ufffdb"


def test_run_to_end_raises_oserror_when_the_program_cannot_start(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        run_to_end([str(tmp_path / "absent")], 10)


def test_run_to_end_kills_the_whole_process_group_on_timeout(tmp_path: Path) -> None:
    # The program forks a helper that would outlive it; both must be gone after the timeout.
    pidfile = tmp_path / "helper.pid"
    script = (
        "import subprocess, sys, time\n"
        "helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(helper.pid))\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_to_end([sys.executable, "-c", script], 3.0)
    assert time.monotonic() - start < 15
    helper = int(pidfile.read_text())
    started = process_start_time(helper)
    deadline = time.monotonic() + 5
    while process_running(helper, started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_running(helper, started)


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
