"""Running and inspecting local processes.

Running: :func:`run_to_end` runs a program in its own session to the end, or kills its whole
process group after a timeout (engines and tools fork helpers). The agent's discovery probes
(``nvidia-smi``, ``ldd``, an engine's ``--version``) and ``llmgw engine check`` both use it.

Inspecting, from ``/proc``: when a process started, and whether it is still the process that
started then. A pid alone names a process only until it ends: the kernel may give the number
to another. The pair (pid, start time) does not recur, so the agent records it for every
engine it starts, adopts an engine a previous agent left only when the pair still matches, and
``llmgw up`` stops only the engines whose pair matches (:mod:`llmgw.cli.local_cluster`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Finished", "process_running", "process_start_time", "run_to_end"]


@dataclass(frozen=True)
class Finished:
    """How a program ended and what it wrote (``stderr`` is empty when it was merged into
    ``stdout``)."""

    returncode: int
    stdout: str
    stderr: str


def run_to_end(
    argv: Sequence[str],
    timeout: float,
    *,
    env: Mapping[str, str] | None = None,
    merge_stderr: bool = False,
) -> Finished:
    """Run ``argv`` in its own session with no input, to the end. ``merge_stderr`` sends its
    stderr to stdout, interleaved as written. Raises OSError (or ValueError, for an argument
    with a NUL byte) when it cannot start, and ``subprocess.TimeoutExpired`` after killing its
    whole process group when it runs past ``timeout`` seconds."""
    with subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        env=None if env is None else dict(env),
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return Finished(
        proc.returncode, out.decode(errors="replace"), (err or b"").decode(errors="replace")
    )


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """The state (field 3) and start time (field 22) of /proc/PID/stat; None when there is
    no such process (or its stat cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = stat[stat.rfind(b")") + 2 :].split()
    try:
        return rest[0].decode(), int(rest[19])
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), so a reused pid is never mistaken;
    None when there is no such process."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def process_running(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``start_time``, and not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X", "x") and stat[1] == start_time
