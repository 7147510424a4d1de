"""What a program said when the agent ran it to see: a node's tools (``nvidia-smi``, ``ldd``)
and its engines (``--version``), run by :func:`llmgw.procutil.run_to_end`, and their
failures described in operator words."""

from __future__ import annotations

import errno
import os
import platform
import signal

from llmgw.procutil import Finished

__all__ = [
    "c_locale",
    "cannot_run",
    "exit_text",
    "nonempty_lines",
    "summary",
]


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


def summary(result: Finished, limit: int = 3) -> str:
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
