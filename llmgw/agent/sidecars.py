"""Sidecars: helper processes a shard needs running, and healthy, before its engine starts.

A shard's sidecars start in the order its StartShard lists them, each a process in its own
session (as an engine is), reading /dev/null and writing to
``<state>/logs/<shard>.<sidecar>.log``, and each healthy before the next starts, so that one
may rely on another: healthy when its ``health_url`` answers 200, or, without one, when it
is still running ``ready_after_s`` after it started. The engine starts only once every
sidecar is healthy; one that exits first, or is not healthy within its ``timeout_s``, fails
the shard (the reason names it and what was waited for) and the others are stopped. They
stop in the reverse order, after the engine.

Sidecars are processes of the node whatever runtime runs the engine, and they see
``LLMGW_SHARD_ID``, ``LLMGW_SIDECAR`` and ``LLMGW_ENGINE_PORT`` (the engine's loopback
port) in their environment. A sandboxed shard's sidecars run in a sandbox each, made like the
engine's (the same model, scratch and extra paths) with their own program's folders
(:mod:`llmgw.agent.sandbox`). Like engines they outlive the agent: the shard's record keeps
their pid and start time, and a restarted agent takes them back (:meth:`SidecarSet.adopt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp

from llmgw.agent.runtimes.base import Handle, Launch, ShardRecord, SidecarRecord
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.errors import ShardError

if TYPE_CHECKING:
    from llmgw.agent.sandbox import Sandboxed
    from llmgw.proto import control_pb2 as pb

__all__ = [
    "DEFAULT_READY_AFTER_S",
    "DEFAULT_TIMEOUT_S",
    "Sidecar",
    "SidecarSet",
    "SidecarSpec",
    "log_tail",
]

DEFAULT_TIMEOUT_S = 120.0
"""How long a sidecar may take to become healthy when the order says 0."""
DEFAULT_READY_AFTER_S = 1.0
"""How long a sidecar without a health URL must keep running when the order says 0."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_POLL_S = 0.05


def log_tail(path: Path, lines: int = 3, limit: int = 400) -> str:
    """The last lines of a log, joined with `` | ``; empty when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read().decode(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return " | ".join(tail)[-limit:]


@dataclass(frozen=True)
class SidecarSpec:
    """One sidecar as ordered; invalid values raise :class:`ShardError`."""

    name: str
    argv: tuple[str, ...]
    health_url: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    ready_after_s: float = DEFAULT_READY_AFTER_S

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ShardError(
                f"sidecar name {self.name!r} must be 1-63 letters, digits, '_', '.' or '-' "
                "(it names the sidecar's log file)"
            )
        if not self.argv or not all(isinstance(a, str) for a in self.argv) or not self.argv[0]:
            raise ShardError(f"sidecar {self.name!r} has no command (argv is empty)")
        if self.health_url and not self.health_url.startswith(("http://", "https://")):
            raise ShardError(
                f"sidecar {self.name!r}: health_url {self.health_url!r} is not an http(s) URL"
            )
        if not self.timeout_s > 0:
            raise ShardError(f"sidecar {self.name!r}: timeout_s must be > 0")
        if not 0 <= self.ready_after_s < self.timeout_s:
            raise ShardError(
                f"sidecar {self.name!r}: ready_after_s ({self.ready_after_s:g}) must be at "
                f"least 0 and below timeout_s ({self.timeout_s:g})"
            )

    @classmethod
    def from_order(cls, order: pb.Sidecar) -> SidecarSpec:
        """The spec of a StartShard's Sidecar; 0 for a duration means its default."""
        return cls(
            name=order.name,
            argv=tuple(order.argv),
            health_url=order.health_url,
            timeout_s=order.timeout_s or DEFAULT_TIMEOUT_S,
            ready_after_s=order.ready_after_s or DEFAULT_READY_AFTER_S,
        )

    @classmethod
    def from_record(cls, record: SidecarRecord) -> SidecarSpec:
        return cls(
            name=record.name,
            argv=record.argv,
            health_url=record.health_url,
            timeout_s=record.timeout_s or DEFAULT_TIMEOUT_S,
            ready_after_s=record.ready_after_s,
        )

    def waits_for(self) -> str:
        """What makes this sidecar healthy, in words."""
        if self.health_url:
            return f"{self.health_url} to answer 200"
        return f"the process to keep running for {self.ready_after_s:g}s"


@dataclass
class Sidecar:
    """One sidecar of a shard and its process."""

    spec: SidecarSpec
    log_path: Path
    handle: Handle | None = None
    pid: int = 0
    start_time: int | None = None
    started_at: float | None = None
    """When its process was started (``time.time()``)."""
    healthy_at: float | None = None
    """When it was first seen healthy (``time.time()``)."""
    exit_code: int | None = None
    gone: bool = False
    """Its process has ended (or was not found by a restarted agent)."""
    sandboxed: bool = False
    """Its process is the bubblewrap its sidecar runs under."""

    @property
    def name(self) -> str:
        return self.spec.name

    def record(self) -> SidecarRecord:
        spec = self.spec
        return SidecarRecord(
            name=spec.name,
            argv=spec.argv,
            health_url=spec.health_url,
            timeout_s=spec.timeout_s,
            ready_after_s=spec.ready_after_s,
            pid=self.pid,
            start_time=self.start_time,
            sandboxed=self.sandboxed,
        )

    def describe_exit(self, context: str = "") -> str:
        """Why this sidecar is gone (``context`` follows the how), with its log's tail."""
        code = self.exit_code
        if self.handle is None:
            how = "exited while the agent was down"
        elif code is None:
            how = "exited (exit code unknown to a new agent)"
        elif code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        tail = log_tail(self.log_path)
        return f"sidecar {self.name!r} {how}{context}" + (f"; log: {tail}" if tail else "")


class SidecarSet:
    """The sidecars of one shard, in order."""

    def __init__(
        self,
        shard_id: str,
        specs: Sequence[SidecarSpec],
        log_dir: Path,
        *,
        env: Mapping[str, str] | None = None,
        poll_s: float = _POLL_S,
        sandbox: Sandboxed | None = None,
    ) -> None:
        names = [s.name for s in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ShardError(
                f"shard {shard_id}: sidecar name(s) {', '.join(twice)} appear more than once; "
                "each sidecar needs a name of its own (it names its log file)"
            )
        self.shard_id = shard_id
        self.env = dict(env or {})
        self.poll_s = poll_s
        # The shard's sandbox; each sidecar runs in it with its own program's folders too.
        self.sandbox = sandbox
        self.runtime = ProcessRuntime()
        self.sidecars = [Sidecar(spec, log_dir / f"{shard_id}.{spec.name}.log") for spec in specs]

    def __len__(self) -> int:
        return len(self.sidecars)

    def records(self) -> tuple[SidecarRecord, ...]:
        return tuple(s.record() for s in self.sidecars)

    async def start(
        self,
        session: aiohttp.ClientSession,
        *,
        stopping: Callable[[], bool] = lambda: False,
        on_started: Callable[[Sidecar], None] = lambda sidecar: None,
    ) -> bool:
        """Start the sidecars in order, each healthy before the next.

        Returns True once all are healthy, False when ``stopping()`` turned true first (the
        ones started are left to :meth:`stop`). Raises :class:`ShardError` naming the
        sidecar and what was waited for when one cannot start, ends, or is not healthy in
        time; every sidecar started is stopped first. ``on_started`` is called as each
        process starts (to record its pid).
        """
        for sidecar in self.sidecars:
            if stopping():
                return False
            try:
                await self._start_one(sidecar)
                on_started(sidecar)
                healthy = await self._wait_healthy(sidecar, session, stopping)
            except ShardError:
                await self.stop(grace=5.0)
                raise
            if not healthy:
                return False
        return True

    async def _start_one(self, sidecar: Sidecar) -> None:
        env = {
            **self.env,
            "LLMGW_SHARD_ID": self.shard_id,
            "LLMGW_SIDECAR": sidecar.name,
        }
        launch = Launch(
            shard_id=f"{self.shard_id}.{sidecar.name}",
            argv=sidecar.spec.argv,
            port=0,
            log_path=sidecar.log_path,
            env=env,
        )
        if self.sandbox is not None:
            launch = self.sandbox.for_program(sidecar.spec.argv[0]).launch(launch)
        try:
            handle = await self.runtime.start(launch)
        except ShardError as exc:
            raise ShardError(
                f"sidecar {sidecar.name!r} of shard {self.shard_id} did not start: {exc}; "
                "the engine was not started"
            ) from exc
        sidecar.handle = handle
        sidecar.pid = handle.pid
        sidecar.start_time = handle.start_time
        sidecar.sandboxed = handle.sandboxed
        sidecar.started_at = time.time()

    async def _wait_healthy(
        self, sidecar: Sidecar, session: aiohttp.ClientSession, stopping: Callable[[], bool]
    ) -> bool:
        assert sidecar.handle is not None
        spec = sidecar.spec
        begun = time.monotonic()
        deadline = begun + spec.timeout_s
        last = "no answer yet"
        exit_wait = asyncio.create_task(self.runtime.wait(sidecar.handle))
        try:
            while True:
                if exit_wait.done():
                    sidecar.exit_code, sidecar.gone = exit_wait.result(), True
                    raise ShardError(
                        sidecar.describe_exit(
                            f" before it was healthy (waited for {spec.waits_for()}); "
                            "the engine was not started"
                        )
                    )
                if stopping():
                    return False
                if spec.health_url:
                    try:
                        async with session.get(spec.health_url) as resp:
                            if resp.status == 200:
                                break
                            last = f"HTTP {resp.status}"
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        last = str(exc) or type(exc).__name__
                elif time.monotonic() - begun >= spec.ready_after_s:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    detail = f" (last: {last})" if spec.health_url else ""
                    raise ShardError(
                        f"sidecar {sidecar.name!r} of shard {self.shard_id} not healthy after "
                        f"{spec.timeout_s:g}s: waited for {spec.waits_for()}{detail}; the "
                        f"engine was not started; see {sidecar.log_path}"
                    )
                await asyncio.wait({exit_wait}, timeout=min(self.poll_s, remaining))
        finally:
            exit_wait.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exit_wait
        sidecar.healthy_at = time.time()
        return True

    async def first_exit(self) -> Sidecar:
        """Wait until one of the sidecars ends and return it (``exit_code`` set when known);
        at once for one that a restarted agent did not find."""
        for sidecar in self.sidecars:
            if sidecar.handle is None or sidecar.gone:
                return sidecar
        waits = {
            asyncio.create_task(self._wait_one(sidecar), name=f"sidecar-{sidecar.name}"): sidecar
            for sidecar in self.sidecars
        }
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return waits[next(iter(done))]
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    async def _wait_one(self, sidecar: Sidecar) -> None:
        assert sidecar.handle is not None
        sidecar.exit_code = await self.runtime.wait(sidecar.handle)
        sidecar.gone = True

    async def stop(self, grace: float) -> None:
        """Stop every sidecar still running, the last one first."""
        for sidecar in reversed(self.sidecars):
            if sidecar.handle is not None and self.runtime.alive(sidecar.handle):
                await self.runtime.stop(sidecar.handle, grace)
                sidecar.gone = True

    @classmethod
    async def adopt(
        cls, shard_id: str, records: Sequence[SidecarRecord], log_dir: Path
    ) -> SidecarSet:
        """The sidecars a previous agent started, taken back by pid and start time; those
        not found are marked gone (their ``handle`` is None)."""
        sidecars = cls(shard_id, [SidecarSpec.from_record(r) for r in records], log_dir)
        for sidecar, record in zip(sidecars.sidecars, records, strict=True):
            sidecar.pid, sidecar.start_time = record.pid, record.start_time
            sidecar.sandboxed = record.sandboxed
            found = ShardRecord(
                shard_id=f"{shard_id}.{record.name}",
                replica_id="",
                model="",
                engine="",
                pid=record.pid,
                start_time=record.start_time,
                sandboxed=record.sandboxed,
            )
            sidecar.handle = await sidecars.runtime.adopt(found)
            sidecar.gone = sidecar.handle is None
        return sidecars
