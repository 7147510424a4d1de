"""The shards an agent runs: start, health-check, watch and stop engine processes.

Each shard is started by a runtime on a loopback port the agent picks, becomes ``ready``
when its ``/health`` answers, and is reported ``failed`` (with its exit code and the tail
of its log) when it ends without having been told to. Every change is handed to a
callback, which the stream turns into ``ShardStatus`` messages, and recorded in
``shards.json`` in the state directory.

Engines outlive the agent: stopping the agent (or killing it) leaves them running, and the
next agent adopts them from ``shards.json`` (:meth:`ShardManager.adopt_all`); those that
ended meanwhile are reported failed so that the control plane starts them again.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from llmgw.agent.runtimes import Handle, Launch, Runtime
from llmgw.agent.runtimes.base import ShardRecord
from llmgw.engines.launch import build_argv
from llmgw.errors import EngineError, LlmgwError, ShardError
from llmgw.log import kv

__all__ = [
    "DIED_WHILE_DOWN",
    "EXITED",
    "EXITED_WHILE_ADOPTED",
    "FAILED",
    "READY",
    "STARTING",
    "Shard",
    "ShardManager",
    "ShardSpec",
]

log = logging.getLogger("llmgw.agent.shards")

STARTING, READY, FAILED, EXITED = "starting", "ready", "failed", "exited"

DIED_WHILE_DOWN = "engine exited while the agent was down"
EXITED_WHILE_ADOPTED = "engine exited while adopted (exit code unknown to a new agent)"


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
    start_time: int | None = None
    container_id: str | None = None
    exit_code: int | None = None
    reason: str = ""
    handle: Handle | None = None
    stopping: bool = False
    task: asyncio.Task[None] | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def shard_id(self) -> str:
        return self.spec.shard_id

    def record(self) -> ShardRecord:
        spec = self.spec
        return ShardRecord(
            shard_id=spec.shard_id,
            replica_id=spec.replica_id,
            model=spec.model,
            engine=spec.engine,
            rank=spec.rank,
            params=dict(spec.params),
            extra_args=spec.extra_args,
            pid=self.pid,
            start_time=self.start_time,
            port=self.port,
            container_id=self.container_id,
            state=self.state,
        )


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


_MISSING: Any = object()


def _get(obj: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any = _MISSING) -> Any:
    if key not in obj:
        if default is _MISSING:
            raise ValueError(f"no {key!r}")
        return default
    value = obj[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"{key!r} is a {type(value).__name__}")
    return value


def _parse_record(shard_id: str, obj: object) -> ShardRecord:
    """One entry of shards.json; ValueError when it is not what :meth:`Shard.record` wrote."""
    try:
        if not isinstance(obj, dict):
            raise ValueError(f"a {type(obj).__name__}, not an object")
        params = _get(obj, "params", (dict,), {})
        extra_args = _get(obj, "extra_args", (list,), [])
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise ValueError("'params' is not a map of strings")
        if not all(isinstance(a, str) for a in extra_args):
            raise ValueError("'extra_args' is not a list of strings")
        return ShardRecord(
            shard_id=shard_id,
            replica_id=_get(obj, "replica_id", (str,)),
            model=_get(obj, "model", (str,)),
            engine=_get(obj, "engine", (str,)),
            rank=_get(obj, "rank", (int,), 0),
            params=params,
            extra_args=tuple(extra_args),
            pid=_get(obj, "pid", (int,)),
            start_time=_get(obj, "start_time", (int, type(None)), None),
            port=_get(obj, "port", (int,)),
            container_id=_get(obj, "container_id", (str, type(None)), None),
            state=_get(obj, "state", (str,)),
        )
    except ValueError as exc:
        raise ValueError(f"shard {shard_id!r}: {exc}") from None


def _record_json(record: ShardRecord) -> dict[str, Any]:
    data = asdict(record)
    del data["shard_id"]
    data["extra_args"] = list(record.extra_args)
    if record.container_id is None:
        del data["container_id"]
    return data


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
        make_launch: Callable[[ShardSpec, int, Path], Launch] | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.make_launch = make_launch or self._process_launch
        self.runtime = runtime
        self.on_status = on_status
        self.startup_timeout = startup_timeout
        self.health_interval = health_interval
        self.shards: dict[str, Shard] = {}
        self._session: aiohttp.ClientSession | None = None

    @staticmethod
    def _process_launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
        """An engine as a child process on 127.0.0.1:port."""
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
        return Launch(shard_id=spec.shard_id, argv=tuple(argv), port=port, log_path=log_path)

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
        self._notify(shard)

    def _notify(self, shard: Shard) -> None:
        try:
            self.on_status(shard)
        except Exception:
            log.exception("shard status callback failed", extra=kv(shard=shard.shard_id))

    def _save_records(self) -> None:
        records = {s.shard_id: _record_json(s.record()) for s in self.shards.values()}
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
        launch = self.make_launch(spec, port, self.log_path(spec.shard_id))
        shard = Shard(spec=spec, port=port)
        self.shards[spec.shard_id] = shard
        try:
            shard.handle = await self.runtime.start(launch)
        except LlmgwError as exc:
            shard.state, shard.reason = FAILED, str(exc)
            self._emit(shard)
            raise
        shard.pid = shard.handle.pid
        shard.start_time = shard.handle.start_time
        shard.container_id = shard.handle.container_id
        log.info(
            "shard starting",
            extra=kv(
                shard=spec.shard_id, model=spec.model, engine=spec.engine, pid=shard.pid, port=port
            ),
        )
        self._emit(shard)
        shard.task = asyncio.create_task(self._watch(shard), name=f"shard-{spec.shard_id}")
        return shard

    def _load_records(self) -> list[ShardRecord]:
        """The records a previous agent left; a file that cannot be read is moved aside."""
        path = self.records_path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning(
                "cannot read the shard records; adopting nothing",
                extra=kv(path=str(path), error=exc.strerror),
            )
            return []
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError(f"a {type(data).__name__}, not an object")
            return [_parse_record(str(sid), obj) for sid, obj in data.items()]
        except ValueError as exc:
            aside = path.with_name(
                f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
            )
            try:
                os.replace(path, aside)
            except OSError as move_exc:
                log.warning(
                    "shard records are corrupt and cannot be moved aside; adopting nothing",
                    extra=kv(path=str(path), error=str(exc), move_error=move_exc.strerror),
                )
            else:
                log.warning(
                    "shard records are corrupt; moved them aside and adopting nothing",
                    extra=kv(path=str(path), moved_to=str(aside), error=str(exc)),
                )
            return []

    async def adopt_all(self) -> tuple[list[Shard], list[ShardRecord]]:
        """Take over the engines a previous agent left running; call it after :meth:`open`.

        Returns the shards adopted (starting, then ready once healthy, as after a fresh
        start) and the records whose engine ended while no agent watched it. Those stay here
        as failed shards, so the next Hello reports them and the control plane starts them
        again; nothing is started here. Records of exited or failed shards are dropped.
        """
        adopted: list[Shard] = []
        dead: list[ShardRecord] = []
        for record in self._load_records():
            if record.state not in (STARTING, READY) or record.shard_id in self.shards:
                continue
            spec = ShardSpec(
                shard_id=record.shard_id,
                replica_id=record.replica_id,
                model=record.model,
                engine=record.engine,
                rank=record.rank,
                params=dict(record.params),
                extra_args=record.extra_args,
            )
            shard = Shard(
                spec=spec,
                port=record.port,
                pid=record.pid,
                start_time=record.start_time,
                container_id=record.container_id,
            )
            self.shards[spec.shard_id] = shard
            try:
                handle = await self.runtime.adopt(record)
            except LlmgwError as exc:
                handle = None
                shard.reason = f"engine could not be adopted after an agent restart: {exc}"
            if handle is None:
                shard.state = FAILED
                shard.reason = shard.reason or DIED_WHILE_DOWN
                log.warning(
                    "shard not adopted",
                    extra=kv(shard=spec.shard_id, pid=record.pid, reason=shard.reason),
                )
                dead.append(record)
                self._notify(shard)
                continue
            shard.handle = handle
            shard.pid = handle.pid
            shard.start_time = handle.start_time
            shard.container_id = handle.container_id
            log.info(
                "shard adopted",
                extra=kv(shard=spec.shard_id, model=spec.model, pid=shard.pid, port=shard.port),
            )
            self._notify(shard)
            adopted.append(shard)
        # Saved once all are known: a save in between (a watcher's) would drop the records
        # not yet read if this agent died before the end.
        self._save_records()
        for shard in adopted:
            shard.task = asyncio.create_task(self._watch(shard), name=f"shard-{shard.shard_id}")
        return adopted, dead

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
            if code is None:
                how = EXITED_WHILE_ADOPTED
            elif code < 0:
                how = f"engine killed by signal {-code}"
            else:
                how = f"engine exited with code {code}"
            shard.reason = shard.reason or how + (f"; log: {tail}" if tail else "")
            log.warning(
                "shard failed",
                extra=kv(shard=shard.shard_id, exit_code=code, reason=shard.reason),
            )
        self._emit(shard)

    async def _wait_healthy(self, shard: Shard, exit_wait: asyncio.Task[int | None]) -> bool:
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
