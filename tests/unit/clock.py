"""A clock the test moves by hand: what the server's components take as ``clock=``."""

from __future__ import annotations


class Clock:
    """``clock()`` is ``t`` (seconds) until the test changes it (``advance`` or ``clock.t``)."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float = 1.0) -> None:
        self.t += dt
