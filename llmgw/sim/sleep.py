"""The sim's sleep mode: vLLM's routes (and SGLang's names) with configurable costs.

What each engine does is in :mod:`llmgw.engines.sleep`; the sim plays vLLM's part:
``POST /sleep?level=1|2`` takes ``sleep_s`` and leaves the engine asleep (with
``mode=wait`` once the generation requests it is answering have finished; with vLLM's
default ``abort`` the sim lets them finish too, having nothing to abort them with), ``POST /wake_up``
takes ``wake_s``; after a level-2 sleep the weights are gone, so the engine answers no
generation until ``POST /collective_rpc {"method": "reload_weights"}`` has reloaded them
(``wake_level2_s``, a weights load). ``GET /is_sleeping`` answers vLLM's
``{"is_sleeping": bool}`` plus what the sim alone says: the ``level`` and the
``host_memory_mib`` it holds (the weights at level 1, none at level 2), which the agent
reports. SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` are
level 1. While it is not fully awake every generation route answers 503, as vLLM's sleep
page says its protected endpoints do; ``/health``, ``/v1/models`` and the tokenizer routes
keep answering, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Awaitable, Callable

from aiohttp import web

from llmgw.sim.config import SimConfig
from llmgw.sim.protocol import error_response

__all__ = ["GENERATION_PATHS", "Phase", "SleepMode"]

GENERATION_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/score",
        "/rerank",
        "/score",
    }
)
"""The routes that need the weights: refused while the engine is not awake."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Phase(enum.StrEnum):
    AWAKE = "awake"
    FALLING_ASLEEP = "falling_asleep"
    ASLEEP = "asleep"
    WAKING = "waking"
    NO_WEIGHTS = "no_weights"  # woken from level 2; the weights not reloaded yet


class SleepMode:
    """One engine's sleep state and its routes."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.phase = Phase.AWAKE
        self.level = 0
        self._lock = asyncio.Lock()
        # Generation requests being answered, for a sleep with mode=wait.
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def host_memory_mib(self) -> int:
        """What the sleeping engine holds in host memory: the weights at level 1."""
        asleep = self.phase in (Phase.ASLEEP, Phase.WAKING, Phase.FALLING_ASLEEP)
        return self.cfg.sleep_host_mib if asleep and self.level == 1 else 0

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/sleep", self.sleep),
            web.post("/wake_up", self.wake_up),
            web.get("/is_sleeping", self.is_sleeping),
            web.post("/collective_rpc", self.collective_rpc),
            web.post("/release_memory_occupation", self.release),
            web.post("/resume_memory_occupation", self.resume),
        ]

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse the generation routes unless the engine is awake."""
        if request.path not in GENERATION_PATHS:
            return await handler(request)
        if self.phase is not Phase.AWAKE:
            return error_response(
                503,
                f"the model is sleeping ({self.phase}); POST /wake_up first",
                None,
                "model_sleeping",
            )
        self.inflight += 1
        self._idle.clear()
        try:
            return await handler(request)
        finally:
            self.inflight -= 1
            if not self.inflight:
                self._idle.set()

    async def sleep(self, request: web.Request) -> web.StreamResponse:
        raw = request.query.get("level", "1")
        if raw not in ("1", "2"):
            return error_response(400, f"level must be 1 or 2, got {raw!r}", "level", None)
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return error_response(
                400, f"mode must be abort, wait or keep, got {mode!r}", "mode", None
            )
        return await self._sleep(int(raw), wait=mode == "wait")

    async def _sleep(self, level: int, *, wait: bool = False) -> web.StreamResponse:
        async with self._lock:
            if self.phase is Phase.ASLEEP:
                return web.Response(status=200)  # vLLM: sleeping again is a no-op
            self.phase, self.level = Phase.FALLING_ASLEEP, level
            if wait:
                # New requests are refused from here; those being answered finish first.
                await self._idle.wait()
            await asyncio.sleep(self.cfg.sleep_s)
            self.phase = Phase.ASLEEP
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.StreamResponse:
        return await self._wake()

    async def _wake(self) -> web.StreamResponse:
        async with self._lock:
            if self.phase is not Phase.ASLEEP:
                return web.Response(status=200)  # awake already: nothing to do
            self.phase = Phase.WAKING
            await asyncio.sleep(self.cfg.wake_s)
            self.phase = Phase.NO_WEIGHTS if self.level == 2 else Phase.AWAKE
            if self.phase is Phase.AWAKE:
                self.level = 0
        return web.Response(status=200)

    async def collective_rpc(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            return error_response(400, "the body is not JSON", None, None)
        method = body.get("method") if isinstance(body, dict) else None
        if method != "reload_weights":
            return error_response(
                400, f"the sim knows only reload_weights, not {method!r}", "method", None
            )
        async with self._lock:
            if self.phase in (Phase.ASLEEP, Phase.FALLING_ASLEEP):
                return error_response(400, "the model is sleeping; POST /wake_up first", None, None)
            if self.phase is Phase.NO_WEIGHTS:
                self.phase = Phase.WAKING
                await asyncio.sleep(self.cfg.wake_level2_s)
            self.phase, self.level = Phase.AWAKE, 0
        return web.json_response({"results": [None]})

    async def is_sleeping(self, request: web.Request) -> web.StreamResponse:
        sleeping = self.phase is not Phase.AWAKE
        return web.json_response(
            {"is_sleeping": sleeping, "level": self.level, "host_memory_mib": self.host_memory_mib}
        )

    async def release(self, request: web.Request) -> web.StreamResponse:
        await self._sleep(1)
        return web.json_response({"success": True, "message": ""})

    async def resume(self, request: web.Request) -> web.StreamResponse:
        await self._wake()
        return web.json_response({"success": True, "message": ""})
