"""The event loop every long-running llmgw process runs its asyncio main on: uvloop where it
is installed, else asyncio's own; ``LLMGW_EVENT_LOOP`` chooses (``asyncio`` to debug).

uvloop (libuv and its TLS layer, in C) takes about a quarter off the CPU a relayed request
costs the agent, and less off the gateway's, whose own Python work is larger
(``bench/gateway.py``). It is a dependency on Linux; elsewhere, or where it is missing,
asyncio's loop runs. Each process logs the loop it runs as one line at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from llmgw.errors import ConfigError
from llmgw.log import kv

__all__ = ["ENV", "LOOPS", "EventLoop", "choose", "run"]

log = logging.getLogger("llmgw.loop")

T = TypeVar("T")

ENV = "LLMGW_EVENT_LOOP"
"""The environment variable that chooses the loop: one of :data:`LOOPS`."""
LOOPS = ("auto", "uvloop", "asyncio")
"""``auto`` (the default): uvloop when it can be imported, else asyncio's."""


@dataclass(frozen=True)
class EventLoop:
    """The loop chosen: its name, its version, why, and what makes one (None: asyncio's)."""

    name: str
    version: str
    reason: str
    factory: Callable[[], asyncio.AbstractEventLoop] | None


def choose(setting: str | None = None) -> EventLoop:
    """The loop ``setting`` (default: ``$LLMGW_EVENT_LOOP``, else ``auto``) asks for.

    Raises :class:`ConfigError` for an unknown setting, and for ``uvloop`` where uvloop
    cannot be imported."""
    if setting is None:
        setting = os.environ.get(ENV, "")
    wanted = setting.strip().lower() or "auto"
    if wanted not in LOOPS:
        raise ConfigError(
            f"unknown event loop {setting!r}; set it to one of {', '.join(LOOPS)} "
            "(asyncio to debug with asyncio's own loop), or unset it",
            key=ENV,
        )
    if wanted == "asyncio":
        return EventLoop("asyncio", platform.python_version(), f"{ENV}=asyncio", None)
    try:
        import uvloop
    except ImportError as exc:
        if wanted == "uvloop":
            raise ConfigError(
                f"uvloop is asked for but cannot be imported ({exc}); install it "
                "('pip install uvloop', Linux and macOS only), or unset the variable",
                key=ENV,
            ) from exc
        return EventLoop("asyncio", platform.python_version(), "uvloop is not installed", None)
    reason = f"{ENV}=uvloop" if wanted == "uvloop" else "installed"
    return EventLoop("uvloop", str(uvloop.__version__), reason, uvloop.new_event_loop)


def run(main: Coroutine[Any, Any, T], *, process: str, setting: str | None = None) -> T:
    """Run ``main`` to its end on the loop :func:`choose` picks, as :func:`asyncio.run`
    would, after one log line naming the loop and ``process`` (``server``, ``agent``, ...)."""
    try:
        loop = choose(setting)
    except BaseException:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    log.info(
        f"event loop: {loop.name}",
        extra=kv(process=process, loop=loop.name, version=loop.version, reason=loop.reason),
    )
    with asyncio.Runner(loop_factory=loop.factory) as runner:
        return runner.run(main)
