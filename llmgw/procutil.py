"""Facts about a running process, read from ``/proc``: when it started, and whether it is
still the process that started then.

A pid alone names a process only until it ends: the kernel may give the number to another.
The pair (pid, start time) does not recur, so the agent records it for every engine it
starts, adopts an engine a previous agent left only when the pair still matches, and
``llmgw up`` stops only the engines whose pair matches (:mod:`llmgw.cli.local_cluster`).
"""

from __future__ import annotations

__all__ = ["process_running", "process_start_time"]


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
