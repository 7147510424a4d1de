"""A ``sim`` engine served on its own loop in a thread, for tests that drive it with
blocking clients (the official OpenAI client, urllib)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from llmgw.sim.config import SimConfig
from llmgw.sim.server import serve

__all__ = ["running"]


@contextlib.contextmanager
def running(cfg: SimConfig) -> Iterator[str]:
    """Run ``serve(cfg)`` on its own loop in a thread; yield the base URL."""
    loop = asyncio.new_event_loop()
    bound = threading.Event()
    port: list[int] = []
    failure: list[BaseException] = []
    task: list[asyncio.Task[None]] = []

    def on_bound(p: int) -> None:
        port.append(p)
        bound.set()

    def main() -> None:
        asyncio.set_event_loop(loop)
        task.append(loop.create_task(serve(cfg, on_bound=on_bound)))
        try:
            loop.run_until_complete(task[0])
        except asyncio.CancelledError:
            pass
        except BaseException as e:
            failure.append(e)
            bound.set()
        finally:
            loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert bound.wait(10), "sim engine did not bind within 10s"
    if failure:
        raise failure[0]
    try:
        yield f"http://127.0.0.1:{port[0]}"
    finally:
        loop.call_soon_threadsafe(task[0].cancel)
        thread.join(15)
        assert not thread.is_alive(), "sim engine did not stop within 15s"
    if failure:
        raise failure[0]
