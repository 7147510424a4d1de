"""The ``sim`` engine's step model (``--step-model``): one loop of steps, as a batched engine
runs, so that prefill work and decoding share time and interfere (:class:`StepLoop`).

Every decoding stream advances one token per step. A step lasts ``1/tps`` plus the prefill
work scheduled in it: its uncached prompt tokens times ``prefill_us_per_token``. Prompts
waiting for prefill are taken in arrival order; with ``prefill_chunk`` N > 0 a step takes at
most N of their tokens (vLLM's chunked prefill: a long prompt spreads over several steps),
with 0 every waiting prompt whole. A prompt's first token comes at the end of the step that
finished its prefill (``ttft_ms`` after it, the engine's fixed first-token cost), the next
ones at the end of each later step. So a burst of long prompts on an aggregated replica
stretches the steps, and with them the inter-token latency of every stream on it; on a
decode-only replica (blocks pulled, nothing to prefill) the steps carry no prefill.

One asyncio task runs the loop; a stream waits on a future of its own for each step it
takes part in (no timer per token), so thousands of streams cost one sleep per step. The
loop sleeps while nothing waits for prefill and nothing decodes. The text is the same as
without the step model; only its timing changes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass

__all__ = ["StepLoop", "StepPace"]


@dataclass(slots=True)
class _Prefill:
    left: int  # prompt tokens still to prefill
    done: asyncio.Future[None]


class StepLoop:
    """The step loop of one engine: ``interval_s`` a step (``1/tps``), ``prefill_s`` a
    prefill token, at most ``chunk`` prefill tokens a step (0: no limit)."""

    def __init__(self, interval_s: float, prefill_s: float, chunk: int) -> None:
        self.interval_s = interval_s
        self.prefill_s = prefill_s
        self.chunk = chunk
        self.steps = 0  # steps run, for the tests and /metrics
        self._waiting: deque[_Prefill] = deque()
        self._tick: list[asyncio.Future[None]] = []  # streams waiting for the step under way
        self._decoding = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # ----------------------------------------------------------------- what streams call

    def prefill(self, tokens: int) -> asyncio.Future[None]:
        """Queue a prompt of ``tokens`` uncached tokens; done at the end of the step that
        finishes it (a prompt with none takes part in the next step all the same)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Prefill(tokens, done))
        self._wake.set()
        return done

    def join(self) -> None:
        """A stream decodes from now on: the loop steps until it leaves."""
        self._decoding += 1
        self._wake.set()

    def leave(self) -> None:
        self._decoding -= 1

    def tick(self) -> asyncio.Future[None]:
        """Done at the end of the step under way (the next one when none is)."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._tick.append(done)
        return done

    # ----------------------------------------------------------------- the loop

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting and not self._decoding and not self._tick:
                self._wake.clear()
                await self._wake.wait()
            start = loop.time()
            finished: list[asyncio.Future[None]] = []
            budget = self.chunk or None
            tokens = 0
            waiting = self._waiting
            while waiting and (budget is None or budget > 0 or waiting[0].left == 0):
                job = waiting[0]
                take = job.left if budget is None else min(job.left, budget)
                job.left -= take
                tokens += take
                if budget is not None:
                    budget -= take
                if job.left:
                    break
                waiting.popleft()
                finished.append(job.done)
            delay = start + self.interval_s + tokens * self.prefill_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # a free step still lets the streams run
            self.steps += 1
            # Every stream that asked for a step by now takes part in this one: a stream woken
            # by the last step asks while this one runs, so it gets a token a step.
            tick, self._tick = self._tick, []
            for fut in finished:
                if not fut.done():
                    fut.set_result(None)
            for fut in tick:
                if not fut.done():
                    fut.set_result(None)


class StepPace:
    """When each token of one request is due under the step model: ``token(0)`` waits for
    its prefill of ``tokens`` (and ``ttft_s``), ``token(k)`` for one more step. ``close``
    when the request ends, however it ends."""

    __slots__ = ("_joined", "loop", "tokens", "ttft_s")

    def __init__(self, loop: StepLoop, tokens: int, ttft_s: float) -> None:
        self.loop = loop
        self.tokens = tokens
        self.ttft_s = ttft_s
        self._joined = False

    async def token(self, k: int) -> None:
        if k:
            await self.loop.tick()
            return
        await self.loop.prefill(self.tokens)
        self.loop.join()
        self._joined = True
        if self.ttft_s:
            await asyncio.sleep(self.ttft_s)

    def close(self) -> None:
        if self._joined:
            self._joined = False
            self.loop.leave()
