"""How ``llmgw ctl onboard`` shows where each host is: one line per host redrawn in place on a
terminal, plain lines (one per step) otherwise, and the summary table at the end.

The onboarding threads report through :meth:`Display.step`; a lock keeps their lines whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from llmgw.cli.ctl.output import table

__all__ = ["STEPS", "Display", "HostResult", "summary"]

STEPS = (
    "connect",
    "hostname",
    "download",
    "verify",
    "install",
    "join",
    "rekey",
    "approve",
    "engines",
    "online",
)
"""The steps of one host, in order (hostname with --set-hostname, rekey instead of join,
engines when the control plane installs some)."""


@dataclass
class HostResult:
    """How one host's onboarding ended: ``online``, ``skipped`` (it was already) or
    ``failed``, with the error's message, the node's fingerprint, the time it took and what
    it warned about."""

    node: str
    destination: str
    result: str = "failed"
    seconds: float = 0.0
    error: str | None = None
    fingerprint: str | None = None
    steps: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return {
            "node": self.node,
            "ssh": self.destination,
            "result": self.result,
            "seconds": round(self.seconds, 1),
            "error": self.error,
            "fingerprint": self.fingerprint,
            "steps": list(self.steps),
            "warnings": list(self.warnings),
        }


class Display:
    """Where the steps go: on a terminal (``live``) one line per host, redrawn in place (ANSI:
    cursor up, clear line) at each step; else one plain line per step, for a log or a pipe
    (``gpu-01  install: ...``). What a host printed is shown without control characters."""

    def __init__(
        self, out: IO[str], nodes: Sequence[str], *, live: bool, columns: int = 100
    ) -> None:
        self.out = out
        self.nodes = list(nodes)
        self.live = live
        self.columns = max(40, columns)
        self.width = max((len(n) for n in nodes), default=4)
        self.lines = {n: "waiting" for n in nodes}
        self.started = {n: time.monotonic() for n in nodes}
        self.drawn = False
        self.lock = threading.Lock()

    def step(self, node: str, step: str, note: str = "") -> None:
        """``node`` is at ``step`` (one of STEPS, or ``online``/``failed``/``skipped``)."""
        text = _printable(step + (f": {note}" if note else ""))
        with self.lock:
            self.lines[node] = text
            if self.live:
                self._redraw()
            else:
                self.out.write(f"{node.ljust(self.width)}  {text}\n")
            self.out.flush()

    def _redraw(self) -> None:
        if self.drawn:
            self.out.write(f"\x1b[{len(self.nodes)}F")
        for name in self.nodes:
            elapsed = time.monotonic() - self.started[name]
            line = f"{name.ljust(self.width)}  {elapsed:5.0f}s  {self.lines[name]}"
            self.out.write("\x1b[2K" + line[: self.columns - 1] + "\n")
        self.drawn = True


def _printable(text: str) -> str:
    """What a remote machine printed, without the control characters that would drive the
    operator's terminal."""
    return "".join(c if c.isprintable() else "?" for c in text)


def summary(results: Sequence[HostResult]) -> str:
    """The table after a run: node, result, time, error."""
    rows = [[r.node, r.result, f"{r.seconds:.0f}s", _printable(r.error or "-")] for r in results]
    return table(["NODE", "RESULT", "TIME", "ERROR"], rows)
