"""Running a program to see what it says: a node's tools (``nvidia-smi``, ``ldd``) and its
engines (``--version``), each to the end or killed with its helpers after a timeout, and
their failures described in operator words."""

from __future__ import annotations

import contextlib
import errno
import os
import platform
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "ProbeResult",
    "c_locale",
    "cannot_run",
    "exit_text",
    "nonempty_lines",
    "run",
    "summary",
]


@dataclass(frozen=True)
class ProbeResult:
    """How a program ended and what it wrote."""

    returncode: int
    stdout: str
    stderr: str


def run(argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None) -> ProbeResult:
    """Run ``argv`` to the end. Raises OSError when it cannot start, and TimeoutExpired
    after killing its whole process group (a hung engine may have forked helpers)."""
    with subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
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
    return ProbeResult(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"))


def c_locale() -> dict[str, str]:
    # Read the environment now, not at import: PATH may have changed since.
    return {**os.environ, "LC_ALL": "C"}


def exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


def nonempty_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def summary(result: ProbeResult, limit: int = 3) -> str:
    """The lines that say what went wrong: a traceback's last line, else the first few."""
    lines = nonempty_lines(result.stderr) or nonempty_lines(result.stdout)
    if not lines:
        return "(no output)"
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        return lines[-1][:300]
    return "; ".join(line[:300] for line in lines[:limit])


def cannot_run(path: str, exc: OSError) -> str:
    if exc.errno == errno.ENOENT:
        if os.path.lexists(path):
            return (
                f"cannot run {path}: its program interpreter is missing (the '#!' line of a "
                "script, or the ELF loader of a build for another architecture or libc)"
            )
        return f"{path} does not exist"
    if exc.errno == errno.ENOEXEC:
        return (
            f"cannot run {path}: not an executable for this machine ({platform.machine()}); "
            "is it built for another architecture?"
        )
    if exc.errno == errno.EACCES:
        return f"cannot run {path}: permission denied (is it executable? chmod +x)"
    return f"cannot run {path}: {exc.strerror or exc}"
