"""systemd notifications (READY=1, STATUS=, WATCHDOG=1, STOPPING=1); silent outside systemd."""

from __future__ import annotations

import asyncio
import os

import sdnotify

__all__ = ["Notifier"]


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._n = sdnotify.SystemdNotifier() if self.enabled else None

    def _send(self, line: str) -> None:
        if self._n is not None:
            self._n.notify(line)

    def ready(self) -> None:
        self._send("READY=1")

    def status(self, text: str) -> None:
        self._send(f"STATUS={text}")

    def stopping(self) -> None:
        self._send("STOPPING=1")

    async def watchdog_loop(self) -> None:
        """Ping the watchdog at half the unit's WatchdogSec, when it set one."""
        usec = os.environ.get("WATCHDOG_USEC")
        if not self.enabled or not usec or not usec.isdigit():
            return
        interval = int(usec) / 1e6 / 2
        while True:
            self._send("WATCHDOG=1")
            await asyncio.sleep(interval)
