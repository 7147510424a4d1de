"""The shard supervisor: start, health-check, watch, stop and adopt the engines an agent runs.

Each shard is started by a runtime on a loopback port the agent picks, becomes ``ready``
when its ``/health`` answers, and is reported ``failed`` (with its exit code and the tail
of its log) when it ends without having been told to. Every change is handed to a
callback, which the stream turns into ``ShardStatus`` messages, and recorded in
``shards.json`` in the state directory (:mod:`llmgw.agent.records`).

One concept, a shard's life on this node, with the spec and states it is about; it runs
past 600 lines because its steps (sidecars, engine, readiness, watch, adoption) share the
shard's state and must be read together to see that every path ends in one final report.

A shard's model source is found under models_root (or in the cache) before anything starts,
and a shard whose source is a URL not fetched yet is ``starting`` while the agent downloads
it (:mod:`llmgw.agent.models_dir`); a source that is missing, leads outside models_root or
cannot be fetched fails the shard without its engine ever being started.

Sidecars (:mod:`llmgw.agent.sidecars`) start before the engine, in order, each healthy
before the next; the engine starts only once all are. A sidecar that fails to get healthy
fails the shard without its engine ever being started; one that dies while the engine runs
fails the shard and the engine is stopped. Sidecars stop after the engine, whenever the
shard ends.

Multi-node replicas: rank 0 is an ordinary shard whose engine opens its port only once
every worker has joined (so ``ready`` means the whole replica is). A worker (rank > 0 of
several nodes) serves nothing: it is reported with port 0, :meth:`ShardManager.ready_port`
gives None for it, and it is ``ready`` once it has joined: for ``sim``, once its log shows
the line it writes when rank 0 welcomed it (``... joined rank 0 at HOST:PORT``, looked for
only in what this run wrote); for other engines, which write no such line we know, once its
process has been running for ``worker_grace`` seconds. An adopted worker that was ready is
ready again at once (a worker that lost rank 0 exits). Where rank 0 dials its workers
(llama.cpp's ``rpc-server``), the order names the endpoints: ``worker_addrs`` for rank 0,
``listen_addr`` for a worker. The port a shard binds for its replica (rank 0's
``dist_init_addr`` where the workers dial it, a llama.cpp worker's ``listen_addr``) must lie
in the node's ``multinode_ports``, the range its firewall opens to the fabric's peers: an
order outside it is refused before anything starts.

Disaggregated serving: a shard ordered with a ``disagg_role`` (``prefill`` or ``decode``)
runs its engine with its KV transfer side channel at the order's ``transfer_addr``, whose
port must lie in ``multinode_ports`` too, over the adapters of agent.yaml's ``fabrics``
(:mod:`llmgw.engines.disagg`); a role on an engine that cannot disaggregate, on a multi-node
shard, or without a transfer address is refused before anything starts
(:func:`~llmgw.agent.shardspec.check_disagg`). An SGLang prefill's engine listens on loopback
only, its bootstrap server at a second port the agent picks: the agent listens on the
transfer address itself and relays each connection to that port
(:mod:`llmgw.agent.bootstrap`), from just before the engine starts (a relay that cannot
listen fails the shard with nothing started) until the shard ends.

Engines outlive the agent: stopping the agent (or killing it) leaves them running, and the
next agent adopts them from ``shards.json`` (:meth:`ShardManager.adopt_all`); those that
ended meanwhile are reported failed so that the control plane starts them again. An engine
put to sleep (:mod:`llmgw.agent.sleeping`) is adopted asleep. Sidecars
are adopted with their shard by pid and start time; a sidecar that ended while the agent
was down fails its shard (engine stopped), and the sidecars of a shard whose engine is gone
are stopped. A kv-events shard whose engine's event socket cannot be dialled again as
privately as it was made (or that an older agent had publish to a loopback TCP port) is
stopped and reported failed with the reason, so that the control plane starts it again on a
fresh socket (:mod:`llmgw.agent.kvevents`); so is an adopted SGLang prefill whose relay
cannot listen again, or whose record is an older agent's (its HTTP API on every address).
The relays end with the agent and are opened again by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from llmgw.agent import bootstrap
from llmgw.agent.bootstrap import relayed
from llmgw.agent.kvevents import KvEventsHub, engine_config
from llmgw.agent.models_dir import Located, SourceStore
from llmgw.agent.records import ShardRecords
from llmgw.agent.runtimes import Launch, Runtime
from llmgw.agent.runtimes.base import ShardRecord
from llmgw.agent.sandbox import Sandboxed, Sandboxes, hidden_path_reason
from llmgw.agent.shardspec import (
    Shard,
    ShardSpec,
    check_disagg,
    check_rendezvous_port,
    check_shape,
)
from llmgw.agent.shardstate import ShardState
from llmgw.agent.sidecars import SidecarSet, log_tail
from llmgw.agent.sleeping import adopted_state, put_to_sleep, wake
from llmgw.agent.traffic import ShardTraffic
from llmgw.contracts.model_sources import SourceSpec
from llmgw.contracts.ports import DEFAULT_MULTINODE_PORTS, PortRange
from llmgw.engines.launch import build_command
from llmgw.engines.registry import get_engine
from llmgw.engines.spec import EngineSpec
from llmgw.errors import EngineError, LlmgwError, ShardError
from llmgw.log import kv
from llmgw.sim.rendezvous import JOINED

if TYPE_CHECKING:
    pass

__all__ = [
    "DIED_WHILE_DOWN",
    "EXITED_WHILE_ADOPTED",
    "KV_EVENTS_RESTART",
    "NEVER_STARTED",
    "RELAY_RESTART",
    "Shard",
    "ShardManager",
    "ShardSpec",
    "ShardState",
]

log = logging.getLogger("llmgw.agent.shards")


ALIVE = (
    ShardState.STARTING,
    ShardState.READY,
    ShardState.FALLING_ASLEEP,
    ShardState.ASLEEP,
    ShardState.WAKING,
)
"""The states of a shard whose engine runs (or is being started): what an agent adopts."""


DIED_WHILE_DOWN = "engine exited while the agent was down"
EXITED_WHILE_ADOPTED = "engine exited while adopted (exit code unknown to a new agent)"
NEVER_STARTED = (
    "the agent stopped while the shard's sidecars were starting; the engine was never started"
)
RELAY_RESTART = (
    "stopped after an agent restart so that it starts again: its bootstrap server cannot be "
    "relayed to again"
)
KV_EVENTS_RESTART = (
    "stopped after an agent restart so that it starts again on a private KV event socket: "
    "its events cannot be received again as they were"
)


def pick_port(host: str = "127.0.0.1") -> int:
    """A free loopback port for an engine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class ShardManager:
    """Starts, watches, stops and adopts the shards of this node through one runtime, and
    keeps their records (:class:`~llmgw.agent.records.ShardRecords`) up to date."""

    def __init__(
        self,
        state_dir: Path,
        runtime: Runtime,
        on_status: Callable[[Shard], None],
        *,
        startup_timeout: float = 600.0,
        health_interval: float = 0.05,
        make_launch: Callable[[ShardSpec, int, Path], Launch] | None = None,
        worker_grace: float = 1.0,
        sources: SourceStore | None = None,
        multinode_ports: PortRange = DEFAULT_MULTINODE_PORTS,
        kv_events: KvEventsHub | None = None,
        sandboxes: Sandboxes | None = None,
        traffic: ShardTraffic | None = None,
        fabric_devices: tuple[str, ...] = (),
    ) -> None:
        self.state_dir = state_dir
        # The requests in flight on each shard, as the data plane relays them: what a
        # drained stop waits on.
        self.traffic = traffic if traffic is not None else ShardTraffic()
        # Process engines' sandboxes (None: engines run as they are: docker, tests).
        self.sandboxes = sandboxes
        # The engines' KV cache events, for shards ordered with kv_events (None: ignored).
        self.kv_events = kv_events
        # agent.yaml's range: where a shard may bind its replica's rendezvous port.
        self.multinode_ports = multinode_ports
        # agent.yaml's fabrics' adapters: what a disaggregated shard moves its KV cache over.
        self.fabric_devices = fabric_devices
        # models_root and cache_root; None (tests): a source is handed to the engine as is.
        self.sources = sources
        self.records = ShardRecords(state_dir)
        self.make_launch = make_launch or self._process_launch
        # Where the node's engines are (discovery found them; "" = the default name on PATH).
        self.binary_of: Callable[[str], str] = lambda engine: ""
        self.runtime = runtime
        self.on_status = on_status
        self.startup_timeout = startup_timeout
        self.health_interval = health_interval
        self.worker_grace = worker_grace
        self.shards: dict[str, Shard] = {}
        self._session: aiohttp.ClientSession | None = None

    def _process_launch(self, spec: ShardSpec, port: int, log_path: Path) -> Launch:
        """An engine as a child process on 127.0.0.1:port (a worker binds no port), with
        the replica's rendezvous and the shard's GPUs."""
        try:
            command = build_command(
                EngineSpec(
                    engine=spec.engine,
                    model=spec.model,
                    port=port,
                    binary="" if get_engine(spec.engine).builtin else self.binary_of(spec.engine),
                    source=spec.source,
                    gpus=spec.gpus,
                    nodes=spec.nodes,
                    rank=spec.rank if spec.nodes > 1 else 0,
                    dist_init_addr=spec.dist_init_addr,
                    params=spec.params,
                    extra_args=spec.extra_args,
                    peers=spec.worker_addrs,
                    listen_addr=spec.listen_addr,
                    kv_events_config=engine_config(spec.shard_id, spec.kv_events_endpoint),
                    disagg_role=spec.disagg_role,
                    transfer_addr=spec.transfer_addr,
                    fabric_devices=self.fabric_devices if spec.disagg_role else (),
                    bootstrap_port=spec.bootstrap_port,
                )
            )
        except EngineError as exc:
            raise ShardError(str(exc)) from exc
        return Launch(
            shard_id=spec.shard_id,
            argv=tuple(command.argv),
            port=port,
            log_path=log_path,
            env=command.env,
        )

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    def log_path(self, shard_id: str) -> Path:
        return self.log_dir / f"{shard_id}.log"

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
            # The engine runs on; its relay ends with this agent (the next one opens it again).
            await _close_relay(shard)
        if self._session is not None:
            await self._session.close()
            self._session = None

    def get(self, shard_id: str) -> Shard | None:
        return self.shards.get(shard_id)

    def snapshot(self) -> list[Shard]:
        return list(self.shards.values())

    def ready_port(self, shard_id: str) -> int | None:
        """The loopback port of a ready shard that serves; None for a worker (it serves
        nothing), or a shard not ready or unknown."""
        shard = self.shards.get(shard_id)
        if shard is None or shard.state != ShardState.READY or shard.spec.worker:
            return None
        if shard.draining:
            return None  # retired: its requests in flight end, new ones go elsewhere
        return shard.port

    def _emit(self, shard: Shard) -> None:
        self._save_records()
        self._notify(shard)

    def _notify(self, shard: Shard) -> None:
        if self.kv_events is not None and shard.state in (ShardState.FAILED, ShardState.EXITED):
            self.kv_events.close(shard.shard_id)
        try:
            self.on_status(shard)
        except Exception:
            log.exception("shard status callback failed", extra=kv(shard=shard.shard_id))

    def _save_records(self) -> None:
        self.records.save(s.record() for s in self.shards.values())

    async def start(self, spec: ShardSpec) -> Shard:
        """Start a shard; a shard already starting or ready is left as it is.

        Raises :class:`ShardError`, having started nothing, when the spec cannot be run.
        Without sidecars the engine is started before this returns (and an engine that
        cannot be started raises); with sidecars this returns once the shard is
        ``starting``, and the sidecars, then the engine, start in the background (a failure
        there is reported as a ``failed`` shard).
        """
        existing = self.shards.get(spec.shard_id)
        if (
            existing is not None
            and existing.state in (ShardState.STARTING, ShardState.READY)
            and not existing.stopping
        ):
            return existing
        if existing is not None and existing.task is not None and not existing.task.done():
            await existing.task
        check_shape(spec)
        check_rendezvous_port(spec, self.multinode_ports)
        check_disagg(spec, self.multinode_ports)
        if relayed(spec.engine, spec.disagg_role):
            # Its bootstrap server's loopback port, recorded: an adopting agent relays to it.
            spec = dataclasses.replace(spec, bootstrap_port=pick_port())
        located = self._locate_source(spec)
        launched = spec
        if located is not None:
            launched = dataclasses.replace(spec, source=str(located.path))
        port = pick_port()
        log_path = self.log_path(spec.shard_id)
        sidecars = (
            SidecarSet(
                spec.shard_id,
                spec.sidecars,
                self.log_dir,
                env={"LLMGW_ENGINE_PORT": str(port)},
                poll_s=self.health_interval,
            )
            if spec.sidecars
            else None
        )
        # The engine's private socket directory, made before it starts (it binds there).
        events = self._subscribe(spec)
        if events:
            launched = dataclasses.replace(launched, kv_events_endpoint=events)
        try:
            launch = self.make_launch(launched, port, log_path)
            sandboxed = await self._sandbox(launched, located, launch.argv[0])
            if sandboxed is not None:
                launch = sandboxed.launch(launch)
                if sidecars is not None:
                    sidecars.sandbox = sandboxed
        except LlmgwError:
            if events and self.kv_events is not None:
                self.kv_events.close(spec.shard_id)
            raise
        # A worker serves nothing: it has no port to report.
        shard = Shard(
            spec=spec, port=0 if spec.worker else port, sidecars=sidecars, sandbox=sandboxed
        )
        shard.kv_events_endpoint = events
        shard.log_offset = _log_size(log_path)
        self.shards[spec.shard_id] = shard
        fetch = located.fetch if located is not None else None
        if sidecars is not None or fetch is not None:
            if sidecars is not None:
                log.info(
                    "shard starting its sidecars",
                    extra=kv(shard=spec.shard_id, sidecars=",".join(s.name for s in spec.sidecars)),
                )
            self._emit(shard)
            shard.task = asyncio.create_task(
                self._bring_up(shard, launch, fetch), name=f"shard-{spec.shard_id}"
            )
            return shard
        try:
            await self._start_engine(shard, launch)
        except LlmgwError as exc:
            shard.state, shard.reason = ShardState.FAILED, str(exc)
            self._emit(shard)
            raise
        shard.task = asyncio.create_task(self._watch(shard), name=f"shard-{spec.shard_id}")
        return shard

    async def _sandbox(
        self, spec: ShardSpec, located: Located | None, program: str
    ) -> Sandboxed | None:
        """The sandbox of ``spec``'s engine, ``program`` (its command's first word); None
        without sandboxes. Its weights: the located source (perhaps not fetched yet), else
        a model_path parameter that names a file or folder of this node."""
        if self.sandboxes is None:
            return None
        # The one folder of the agent's state the engine sees: its KV events' socket's.
        events = spec.kv_events_endpoint
        sockets = (
            [Path(events.removeprefix("ipc://")).parent] if events.startswith("ipc://") else []
        )
        return await self.sandboxes.prepare(
            spec.shard_id,
            spec.sandbox,
            program=None if get_engine(spec.engine).builtin else program,
            model=_weights(spec, located),
            # The fabric's adapters (/dev/infiniband): a multi-node replica's collectives, and
            # a disaggregated pool's KV transfers (UCX, mooncake), go over them.
            multi_node=spec.nodes > 1 or bool(spec.disagg_role),
            shard_rw=sockets,
        )

    def _subscribe(self, spec: ShardSpec) -> str:
        """The endpoint of the shard's socket for its engine's KV cache events, or "" when it
        has none; ShardError when its directory cannot be made private."""
        if not spec.kv_events or self.kv_events is None:
            return ""
        return self.kv_events.open(spec.shard_id, nodes=spec.nodes, rank=spec.rank)

    def _resubscribe(self, spec: ShardSpec, record: ShardRecord) -> str:
        """Dial an adopted engine's KV event socket again; ShardError when it cannot be, as
        privately as it was made (the shard must be restarted)."""
        if not spec.kv_events or self.kv_events is None:
            return ""
        if record.kv_events_port and not record.kv_events_endpoint:
            raise ShardError(
                f"its engine publishes them to loopback TCP port {record.kv_events_port}, as "
                "an older agent had it do, where any local user may listen"
            )
        return self.kv_events.adopt(
            spec.shard_id,
            record.kv_events_endpoint,
            nodes=spec.nodes,
            rank=spec.rank,
            ready=record.state == ShardState.READY,
        )

    async def _restart_adopted(self, shard: Shard, reason: str) -> None:
        """An adopted engine that cannot run on as it was started: its KV cache events
        cannot be received again as privately as they were, or its bootstrap server cannot
        be relayed to again. Stopped and reported failed with ``reason``, so that the
        control plane starts it again afresh, rather than running on without events (or
        publishing them to a port anyone may take), or unreachable from its decode pool."""
        assert shard.handle is not None
        shard.reason = reason
        log.warning("shard restarted", extra=kv(shard=shard.shard_id, reason=shard.reason))
        try:
            await self.runtime.stop(shard.handle, shard.stop_grace)
        except LlmgwError as exc:  # reported failed all the same: the control plane decides
            log.warning("cannot stop the engine", extra=kv(shard=shard.shard_id, error=str(exc)))
        if shard.sidecars is not None:
            await shard.sidecars.stop(5.0)
        shard.state = ShardState.FAILED
        self._notify(shard)

    async def _start_engine(self, shard: Shard, launch: Launch) -> None:
        spec = shard.spec
        # Before the engine: a relay that cannot listen fails the shard with nothing started.
        shard.relay = await bootstrap.open_relay(spec)
        try:
            shard.handle = await self.runtime.start(launch)
        except BaseException:
            await _close_relay(shard)
            raise
        shard.pid = shard.handle.pid
        shard.start_time = shard.handle.start_time
        shard.container_id = shard.handle.container_id
        shard.sandboxed = shard.handle.sandboxed
        log.info(
            "shard starting",
            extra=kv(
                shard=spec.shard_id,
                model=spec.model,
                engine=spec.engine,
                pid=shard.pid,
                port=shard.port,
                rank=spec.rank,
                nodes=spec.nodes,
            ),
        )
        self._emit(shard)

    async def _bring_up(
        self, shard: Shard, launch: Launch, fetch: SourceSpec | None = None
    ) -> None:
        """The source fetched (when it must be), sidecars next, each healthy, then the
        engine, then watch it."""
        if fetch is not None and not await self._fetch_source(shard, fetch):
            return
        sidecars = shard.sidecars
        assert self._session is not None
        if sidecars is not None:
            try:
                up = await sidecars.start(
                    self._session,
                    stopping=lambda: shard.stopping,
                    on_started=lambda sidecar: self._save_records(),
                )
            except ShardError as exc:
                shard.state, shard.reason = ShardState.FAILED, str(exc)
                log.warning("shard failed", extra=kv(shard=shard.shard_id, reason=shard.reason))
                self._emit(shard)
                return
            if not up or shard.stopping:
                await sidecars.stop(shard.stop_grace)
                shard.state, shard.reason = ShardState.EXITED, shard.reason or "stopped"
                self._emit(shard)
                return
            log.info("shard sidecars healthy", extra=kv(shard=shard.shard_id))
        elif shard.stopping:
            shard.state, shard.reason = ShardState.EXITED, shard.reason or "stopped"
            self._emit(shard)
            return
        try:
            await self._start_engine(shard, launch)
        except LlmgwError as exc:
            if sidecars is not None:
                await sidecars.stop(5.0)
            shard.state, shard.reason = ShardState.FAILED, str(exc)
            log.warning("shard failed", extra=kv(shard=shard.shard_id, reason=shard.reason))
            self._emit(shard)
            return
        assert shard.handle is not None
        if shard.stopping:
            # stop() came while the engine was being started, and found nothing to stop.
            await self.runtime.stop(shard.handle, shard.stop_grace)
        await self._watch(shard)

    # -- the model source ----------------------------------------------------------------------

    def _locate_source(self, spec: ShardSpec) -> Located | None:
        """Where the shard's source is on this node (ShardError when it is not there, leads
        out of models_root or cannot be fetched); None with no source or no store."""
        if self.sources is None or not spec.source:
            return None
        return self.sources.locate(spec.source, spec.source_sha256)

    async def _fetch_source(self, shard: Shard, source: SourceSpec) -> bool:
        """Download the shard's source into the cache. False, the shard reported failed
        (or exited, when it was stopped meanwhile), when the engine must not start."""
        assert self.sources is not None
        log.info("shard fetching its source", extra=kv(shard=shard.shard_id))
        fetch = asyncio.ensure_future(self.sources.fetch(source))
        shard.fetching = fetch
        try:
            await asyncio.wait({fetch})
        finally:
            if not fetch.done():  # this task is cancelled: the agent stops
                fetch.cancel()
                await asyncio.wait({fetch})
            shard.fetching = None
        if fetch.cancelled() or shard.stopping:
            shard.state, shard.reason = ShardState.EXITED, shard.reason or "stopped"
            self._emit(shard)
            return False
        error = fetch.exception()
        if error is not None:
            shard.state, shard.reason = ShardState.FAILED, str(error)
            log.warning("shard failed", extra=kv(shard=shard.shard_id, reason=shard.reason))
            self._emit(shard)
            return False
        return True

    async def adopt_all(self) -> tuple[list[Shard], list[ShardRecord]]:
        """Take over the engines a previous agent left running; call it after :meth:`open`.

        Returns the shards adopted (starting, then ready once healthy, as after a fresh
        start) and the records whose engine ended while no agent watched it, or was stopped
        here because its KV cache events could not be received again as privately as they
        were, or its bootstrap server could not be relayed to again (:meth:`_restart_adopted`).
        Those stay here as failed shards, so the next Hello reports them and the control
        plane starts them again; nothing is started here. Records of exited or failed shards
        are dropped.
        """
        adopted: list[Shard] = []
        dead: list[ShardRecord] = []
        restart: list[tuple[Shard, str]] = []
        for record in self.records.load():
            if record.state not in ALIVE or record.shard_id in self.shards:
                continue
            spec = ShardSpec.from_record(record)
            shard = Shard(
                spec=spec,
                port=record.port,
                pid=record.pid,
                start_time=record.start_time,
                container_id=record.container_id,
                log_offset=record.log_offset,
                ready_before=record.state not in (ShardState.STARTING, ""),
                sleep_level=record.sleep_level,
                recorded_state=record.state,
            )
            self.shards[spec.shard_id] = shard
            if record.sidecars:
                shard.sidecars = await SidecarSet.adopt(
                    spec.shard_id, record.sidecars, self.log_dir
                )
            try:
                handle = await self.runtime.adopt(record)
            except LlmgwError as exc:
                handle = None
                shard.reason = f"engine could not be adopted after an agent restart: {exc}"
            if handle is None:
                shard.state = ShardState.FAILED
                never_started = record.pid <= 0 and record.container_id is None
                shard.reason = shard.reason or (NEVER_STARTED if never_started else DIED_WHILE_DOWN)
                if shard.sidecars is not None:
                    # Its engine is gone: nothing would stop the sidecars it left.
                    await shard.sidecars.stop(5.0)
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
            try:
                shard.kv_events_endpoint = self._resubscribe(spec, record)
            except ShardError as exc:
                restart.append((shard, f"{KV_EVENTS_RESTART}: {exc}"))
                dead.append(record)
                continue
            try:
                shard.relay = await bootstrap.adopt_relay(spec)
            except ShardError as exc:
                restart.append((shard, f"{RELAY_RESTART}: {exc}"))
                dead.append(record)
                continue
            shard.sandboxed = handle.sandboxed
            log.info(
                "shard adopted",
                extra=kv(shard=spec.shard_id, model=spec.model, pid=shard.pid, port=shard.port),
            )
            self._notify(shard)
            adopted.append(shard)
        await asyncio.gather(*(self._restart_adopted(s, why) for s, why in restart))
        if self.kv_events is not None:
            self.kv_events.prune()
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
        sidecar_exit = asyncio.create_task(shard.sidecars.first_exit()) if shard.sidecars else None
        watched: set[asyncio.Task[Any]] = {exit_wait}
        if sidecar_exit is not None:
            watched.add(sidecar_exit)
        try:
            ready = await self._wait_ready(shard, watched)
            if ready:
                shard.state = ShardState.READY
                shard.startup_s = max(0.0, time.time() - shard.started_at)
                if shard.recorded_state and self._session is not None:
                    # Adopted: an engine left asleep answers its health check asleep.
                    shard.state = await adopted_state(shard, shard.recorded_state, self._session)
                log.info(
                    f"shard {shard.state}",
                    extra=kv(
                        shard=shard.shard_id, port=shard.port, startup_s=round(shard.startup_s, 3)
                    ),
                )
                self._emit(shard)
            elif not any(t.done() for t in watched) and not shard.stopping:
                shard.reason = self._not_ready_reason(shard)
                await self.runtime.stop(handle, grace=5.0)
            if sidecar_exit is not None:
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if sidecar_exit.done() and not exit_wait.done() and not shard.stopping:
                    shard.reason = sidecar_exit.result().describe_exit("; engine stopped")
                    log.warning(
                        "sidecar died; stopping the engine",
                        extra=kv(shard=shard.shard_id, reason=shard.reason),
                    )
                    await self.runtime.stop(handle, grace=5.0)
            code = await exit_wait
        except asyncio.CancelledError:
            exit_wait.cancel()
            if sidecar_exit is not None:
                sidecar_exit.cancel()
            raise
        if sidecar_exit is not None and not sidecar_exit.done():
            sidecar_exit.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sidecar_exit
        shard.exit_code = code
        if shard.stopping:
            shard.state = ShardState.EXITED
            shard.reason = shard.reason or "stopped"
        else:
            shard.state = ShardState.FAILED
            tail = log_tail(self.log_path(shard.shard_id))
            if code is None:
                how = EXITED_WHILE_ADOPTED
            elif code < 0:
                how = f"engine killed by signal {-code}"
            else:
                how = f"engine exited with code {code}"
            hidden = self._hidden_path(shard)
            if hidden:
                how = f"{hidden}; {how}"
            shard.reason = shard.reason or how + (f"; log: {tail}" if tail else "")
            log.warning(
                "shard failed",
                extra=kv(shard=shard.shard_id, exit_code=code, reason=shard.reason),
            )
        await _close_relay(shard)
        if shard.sidecars is not None:
            # After the engine, whatever ended it: a restart must find their ports free.
            await shard.sidecars.stop(shard.stop_grace)
        self._emit(shard)

    def _hidden_path(self, shard: Shard) -> str:
        """What the failed engine could not open because its sandbox hides it ("": none)."""
        if shard.sandbox is None:
            return ""
        try:
            with open(self.log_path(shard.shard_id), "rb") as f:
                f.seek(max(shard.log_offset, f.seek(0, 2) - 16384))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return hidden_path_reason(shard.sandbox.plan, text)

    def _not_ready_reason(self, shard: Shard) -> str:
        where = f"see {self.log_path(shard.shard_id)}"
        if shard.spec.worker:
            return (
                f"worker rank {shard.spec.rank} did not join rank 0 at "
                f"{shard.spec.dist_init_addr} within {self.startup_timeout:.0f}s; {where}"
            )
        return f"not healthy after {self.startup_timeout:.0f}s on port {shard.port}; {where}"

    async def _wait_ready(self, shard: Shard, watched: set[asyncio.Task[Any]]) -> bool:
        """Poll the shard's readiness until it is ready (True), or the startup timeout
        passes, a watched task ends or the shard is being stopped (False)."""
        deadline = time.monotonic() + self.startup_timeout
        ready = self._readiness(shard)
        while (
            time.monotonic() < deadline
            and not any(t.done() for t in watched)
            and not shard.stopping
        ):
            if await ready():
                return True
            await asyncio.wait(watched, timeout=self.health_interval)
        return False

    def _readiness(self, shard: Shard) -> Callable[[], Awaitable[bool]]:
        """The check that tells this shard is ready; see the module's docstring."""
        if not shard.spec.worker:
            return functools.partial(self._healthy, f"http://127.0.0.1:{shard.port}/health")
        if shard.ready_before:
            return _always
        if get_engine(shard.spec.engine).builtin:  # llmgw's own worker logs when it joined
            return _LogWatch(self.log_path(shard.shard_id), shard.log_offset, JOINED).seen
        began = time.monotonic()

        async def after_grace() -> bool:
            return time.monotonic() - began >= self.worker_grace

        return after_grace

    async def _healthy(self, url: str) -> bool:
        assert self._session is not None
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self._session.get(url) as resp:
                return resp.status == 200
        return False

    async def sleep(self, shard_id: str, level: int) -> Shard:
        """Put a ready shard's engine to sleep at ``level`` (:mod:`llmgw.agent.sleeping`);
        ShardError says why it cannot."""
        shard = self._known(shard_id)
        assert self._session is not None
        await put_to_sleep(shard, level, self._session, self._emit)
        return shard

    async def wake(self, shard_id: str) -> Shard:
        """Wake an asleep shard's engine; ShardError says why it cannot."""
        shard = self._known(shard_id)
        assert self._session is not None
        await wake(shard, self._session, self._emit, self.startup_timeout)
        return shard

    def _known(self, shard_id: str) -> Shard:
        shard = self.shards.get(shard_id)
        if shard is None:
            raise ShardError(f"shard {shard_id} is not running on this node")
        return shard

    async def stop(self, shard_id: str, grace: float = 10.0, drain: float = 0.0) -> Shard | None:
        """Stop a shard and forget it; returns the final state, or None if it was unknown.
        ``drain``: first refuse new requests for it (the data plane answers them as not
        taken) and wait up to that many seconds for those in flight to end."""
        shard = self.shards.get(shard_id)
        if shard is None:
            return None
        if drain > 0 and not shard.stopping:
            shard.draining = True
            began = time.monotonic()
            idle = await self.traffic.idle(shard_id, drain)
            log.info(
                "shard drained" if idle else "shard drain timed out; stopping it with requests",
                extra=kv(
                    shard=shard_id,
                    waited=round(time.monotonic() - began, 3),
                    inflight=self.traffic.inflight(shard_id),
                ),
            )
            if self.shards.get(shard_id) is not shard:
                return shard  # stopped meanwhile by another order
        shard.stopping = True
        shard.stop_grace = grace
        if shard.fetching is not None:
            shard.fetching.cancel()
        if shard.handle is not None and self.runtime.alive(shard.handle):
            log.info("shard stopping", extra=kv(shard=shard_id, pid=shard.pid))
            await self.runtime.stop(shard.handle, grace)
        if shard.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await shard.task
        if shard.state != ShardState.EXITED:
            shard.state = ShardState.EXITED
            shard.reason = shard.reason or "stopped"
            self._emit(shard)
        self.shards.pop(shard_id, None)
        self._save_records()
        if self.sandboxes is not None:
            self.sandboxes.forget(shard_id)
        return shard

    async def stop_all(self, grace: float = 10.0) -> None:
        await asyncio.gather(
            *(self.stop(sid, grace) for sid in list(self.shards)), return_exceptions=True
        )


def _weights(spec: ShardSpec, located: Located | None) -> Path | None:
    """The shard's weights on this node: its located source (perhaps not fetched yet), else
    a model_path parameter that names a file or folder here."""
    if located is not None:
        return located.path
    weights = spec.params.get("model_path", "")
    return Path(weights) if weights.startswith("/") and os.path.exists(weights) else None


async def _close_relay(shard: Shard) -> None:
    """Close the shard's bootstrap relay (:mod:`llmgw.agent.bootstrap`), if it has one."""
    relay, shard.relay = shard.relay, None
    if relay is not None:
        await relay.close()


async def _always() -> bool:
    return True


class _LogWatch:
    """Reads what a log gains from ``offset`` on, looking for ``words`` on a line."""

    def __init__(self, path: Path, offset: int, words: str) -> None:
        self.path = path
        self.offset = offset
        self.words = words.encode()
        self._carry = b""

    async def seen(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(1 << 20)
        except OSError:
            return False
        self.offset += len(data)
        text = self._carry + data
        if self.words in text:
            return True
        # Keep enough to find the words when a read cuts them in two.
        self._carry = text[-len(self.words) :]
        return False
