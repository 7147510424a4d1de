"""The shards an agent runs: start, health-check, watch and stop engine processes.

Each shard is started by a runtime on a loopback port the agent picks, becomes ``ready``
when its ``/health`` answers, and is reported ``failed`` (with its exit code and the tail
of its log) when it ends without having been told to. Every change is handed to a
callback, which the stream turns into ``ShardStatus`` messages, and recorded in
``shards.json`` in the state directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from llmgw.agent.runtimes import Handle, Launch, Runtime
from llmgw.agent.runtimes.process import process_start_time
from llmgw.engines.launch import build_argv
from llmgw.errors import EngineError, LlmgwError, ShardError
from llmgw.log import kv

__all__ = ["EXITED", "FAILED", "READY", "STARTING", "Shard", "ShardManager", "ShardSpec"]

log = logging.getLogger("llmgw.agent.shards")

STARTING, READY, FAILED, EXITED = "starting", "ready", "failed", "exited"


@dataclass(frozen=True)
class ShardSpec:
    shard_id: str
    replica_id: str
    model: str
    engine: str
    rank: int = 0
    params: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()


@dataclass
class Shard:
    spec: ShardSpec
    state: str = STARTING
    port: int = 0
    pid: int = 0
    exit_code: int | None = None
    reason: str = ""
    handle: Handle | None = None
    stopping: bool = False
    task: asyncio.Task[None] | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id


def pick_port(host: str = "127.0.0.1") -> int:
    """A free loopback port for an engine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _log_tail(path: Path, lines: int = 3, limit: int = 400) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read().decode(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return " | ".join(tail)[-limit:]


class ShardManager:
    """Starts and watches shards through one runtime."""

    def __init__(
        self,
        state_dir: Path,
        runtime: Runtime,
        on_status: Callable[[Shard], None],
        *,
        startup_timeout: float = 600.0,
        health_interval: float = 0.05,
    ) -> None:
        self.state_dir = state_dir
        self.runtime = runtime
        self.on_status = on_status
        self.startup_timeout = startup_timeout
        self.health_interval = health_interval
        self.shards: dict[str, Shard] = {}
        self._session: aiohttp.ClientSession | None = None

    @property
    def records_path(self) -> Path:
        return self.state_dir / "shards.json"

    def log_path(self, shard_id: str) -> Path:
        return self.state_dir / "logs" / f"{shard_id}.log"

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=2.0),
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
        )

    async def close(self) -> None:
        for shard in list(self.shards.values()):
            if shard.task is not None:
                shard.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await shard.task
        if self._session is not None:
            await self._session.close()
            self._session = None

    def get(self, shard_id: str) -> Shard | None:
        return self.shards.get(shard_id)

    def snapshot(self) -> list[Shard]:
        return list(self.shards.values())

    def ready_port(self, shard_id: str) -> int | None:
        shard = self.shards.get(shard_id)
        if shard is None or shard.state != READY:
            return None
        return shard.port

    def _emit(self, shard: Shard) -> None:
        self._save_records()
        try:
            self.on_status(shard)
        except Exception:
            log.exception("shard status callback failed", extra=kv(shard=shard.shard_id))

    def _save_records(self) -> None:
        records = {
            s.shard_id: {
                "replica_id": s.spec.replica_id,
                "model": s.spec.model,
                "engine": s.spec.engine,
                "pid": s.pid,
                "start_time": process_start_time(s.pid) if s.pid else None,
                "port": s.port,
                "state": s.state,
            }
            for s in self.shards.values()
        }
        tmp = self.records_path.with_name("shards.json.tmp")
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(records, f)
            os.replace(tmp, self.records_path)
        except OSError as exc:
            log.warning(
                "cannot record shards in the state directory",
                extra=kv(path=str(self.records_path), error=exc.strerror),
            )

    async def start(self, spec: ShardSpec) -> Shard:
        """Start a shard; a shard already starting or ready is left as it is."""
        existing = self.shards.get(spec.shard_id)
        if existing is not None and existing.state in (STARTING, READY) and not existing.stopping:
            return existing
        if existing is not None and existing.task is not None and not existing.task.done():
            await existing.task
        port = pick_port()
        try:
            argv = build_argv(
                spec.engine,
                model=spec.model,
                port=port,
                params=spec.params,
                extra_args=spec.extra_args,
            )
        except EngineError as exc:
            raise ShardError(str(exc)) from exc
        shard = Shard(spec=spec, port=port)
        self.shards[spec.shard_id] = shard
        launch = Launch(
            shard_id=spec.shard_id,
            argv=tuple(argv),
            port=port,
            log_path=self.log_path(spec.shard_id),
        )
        try:
            shard.handle = await self.runtime.start(launch)
        except LlmgwError as exc:
            shard.state, shard.reason = FAILED, str(exc)
            self._emit(shard)
            raise
        shard.pid = shard.handle.pid
        log.info(
            "shard starting",
            extra=kv(
                shard=spec.shard_id, model=spec.model, engine=spec.engine, pid=shard.pid, port=port
            ),
        )
        self._emit(shard)
        shard.task = asyncio.create_task(self._watch(shard), name=f"shard-{spec.shard_id}")
        return shard

    async def _watch(self, shard: Shard) -> None:
        assert shard.handle is not None
        handle = shard.handle
        exit_wait = asyncio.create_task(self.runtime.wait(handle))
        try:
            healthy = await self._wait_healthy(shard, exit_wait)
            if healthy:
                shard.state = READY
                log.info("shard ready", extra=kv(shard=shard.shard_id, port=shard.port))
                self._emit(shard)
            elif not exit_wait.done() and not shard.stopping:
                shard.reason = (
                    f"not healthy after {self.startup_timeout:.0f}s on port {shard.port}; "
                    f"see {self.log_path(shard.shard_id)}"
                )
                await self.runtime.stop(handle, grace=5.0)
            code = await exit_wait
        except asyncio.CancelledError:
            exit_wait.cancel()
            raise
        shard.exit_code = code
        if shard.stopping:
            shard.state = EXITED
            shard.reason = shard.reason or "stopped"
        else:
            shard.state = FAILED
            tail = _log_tail(self.log_path(shard.shard_id))
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            shard.reason = shard.reason or f"engine {how}" + (f"; log: {tail}" if tail else "")
            log.warning(
                "shard failed",
                extra=kv(shard=shard.shard_id, exit_code=code, reason=shard.reason),
            )
        self._emit(shard)

    async def _wait_healthy(self, shard: Shard, exit_wait: asyncio.Task[int]) -> bool:
        assert self._session is not None
        deadline = time.monotonic() + self.startup_timeout
        url = f"http://127.0.0.1:{shard.port}/health"
        while time.monotonic() < deadline and not exit_wait.done() and not shard.stopping:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self._session.get(url) as resp:
                    if resp.status == 200:
                        return True
            await asyncio.wait({exit_wait}, timeout=self.health_interval)
        return False

    async def stop(self, shard_id: str, grace: float = 10.0) -> Shard | None:
        """Stop a shard and forget it; returns the final state, or None if it was unknown."""
        shard = self.shards.get(shard_id)
        if shard is None:
            return None
        shard.stopping = True
        if shard.handle is not None and self.runtime.alive(shard.handle):
            log.info("shard stopping", extra=kv(shard=shard_id, pid=shard.pid))
            await self.runtime.stop(shard.handle, grace)
        if shard.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await shard.task
        if shard.state != EXITED:
            shard.state = EXITED
            shard.reason = shard.reason or "stopped"
            self._emit(shard)
        self.shards.pop(shard_id, None)
        self._save_records()
        return shard

    async def stop_all(self, grace: float = 10.0) -> None:
        await asyncio.gather(
            *(self.stop(sid, grace) for sid in list(self.shards)), return_exceptions=True
        )
