"""What a shard is on this node: the order it was started from (:class:`ShardSpec`, read
from a StartShard or a record), its state here (:class:`Shard`, as ``shards.json`` keeps
it), and the checks an order passes before anything starts (its shape, its rendezvous port
and a disaggregated shard's role and transfer port, each port inside the node's
``multinode_ports``). :mod:`llmgw.agent.shards` runs them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from llmgw.agent.bootstrap import BootstrapRelay
from llmgw.agent.runtimes import Handle
from llmgw.agent.runtimes.base import ShardRecord, SidecarRecord
from llmgw.agent.sandbox import Sandboxed
from llmgw.agent.shardstate import ShardState
from llmgw.agent.sidecars import SidecarSet, SidecarSpec
from llmgw.contracts.ports import PortRange
from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.engines.disagg import check_role
from llmgw.engines.registry import ENGINES
from llmgw.engines.spec import EngineSpec
from llmgw.errors import ConfigError, EngineError, ShardError
from llmgw.netaddr import parse_hostport

if TYPE_CHECKING:
    from llmgw.proto import control_pb2 as pb


__all__ = ["Shard", "ShardSpec", "check_disagg", "check_rendezvous_port", "check_shape"]


@dataclass(frozen=True)
class ShardSpec:
    """One shard as the control plane ordered it (a StartShard)."""

    shard_id: str
    replica_id: str
    model: str
    engine: str
    rank: int = 0
    params: dict[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    nodes: int = 1
    """Shards in the replica; with more than one, rank 0 binds ``dist_init_addr``."""
    dist_init_addr: str = ""
    gpus: tuple[str, ...] = ()
    source: str = ""
    gpu_memory_mib: int = 0
    sidecars: tuple[SidecarSpec, ...] = ()
    profile: str = ""
    worker_addrs: tuple[str, ...] = ()
    """Rank 0 of an engine that dials its workers (llama.cpp): each worker's endpoint."""
    listen_addr: str = ""
    """A worker of such an engine: the host:port its endpoint binds."""
    source_sha256: str = ""
    """With ``source`` a URL: its SHA-256 (the agent fetches it into cache_root first)."""
    kv_events: bool = False
    """Forward the engine's KV cache events (a profile with ``routing: kv-events``)."""
    kv_events_endpoint: str = ""
    """The ``ipc://`` socket the engine publishes them to (set on the spec a launch is built
    from; "": none)."""
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)
    """What the engine's sandbox sees beyond the agent's own choice (the profile's key)."""
    disagg_role: str = ""
    """Disaggregated serving: the replica's pool, ``prefill`` or ``decode`` ("": aggregated)."""
    transfer_addr: str = ""
    """With a role: the host:port where the engine binds its KV transfer side channel (for
    an SGLang prefill, where the agent's relay to its bootstrap server listens)."""
    bootstrap_port: int = 0
    """An SGLang prefill: the loopback port its bootstrap server binds, which the agent picks
    and relays ``transfer_addr`` to (:mod:`llmgw.agent.bootstrap`); 0 for every other shard
    (an order never sets it)."""

    @classmethod
    def from_order(cls, order: pb.StartShard) -> ShardSpec:
        """The spec of a StartShard; ShardError when a sidecar in it is invalid."""
        return cls(
            shard_id=order.shard_id,
            replica_id=order.replica_id,
            model=order.model,
            engine=order.engine,
            rank=order.rank,
            params=dict(order.params),
            extra_args=tuple(order.extra_args),
            # An order from a control plane that predates multi-node says 0: one node.
            nodes=order.nodes or 1,
            dist_init_addr=order.dist_init_addr,
            gpus=tuple(order.gpus),
            source=order.source,
            gpu_memory_mib=order.gpu_memory_mib,
            sidecars=tuple(SidecarSpec.from_order(s) for s in order.sidecars),
            profile=order.profile,
            worker_addrs=tuple(order.worker_addrs),
            listen_addr=order.listen_addr,
            source_sha256=order.source_sha256,
            kv_events=order.kv_events,
            # An order of a control plane before sandboxes says nothing: sandboxed.
            sandbox=SandboxPolicy.from_order(order.sandbox),
            # An order of a control plane before disaggregation says "": aggregated.
            disagg_role=order.disagg_role,
            transfer_addr=order.transfer_addr,
        )

    @classmethod
    def from_record(cls, record: ShardRecord) -> ShardSpec:
        """The spec a previous agent recorded; ShardError when a sidecar in it is invalid."""
        return cls(
            shard_id=record.shard_id,
            replica_id=record.replica_id,
            model=record.model,
            engine=record.engine,
            rank=record.rank,
            params=dict(record.params),
            extra_args=record.extra_args,
            nodes=record.nodes,
            dist_init_addr=record.dist_init_addr,
            gpus=record.gpus,
            source=record.source,
            gpu_memory_mib=record.gpu_memory_mib,
            sidecars=tuple(SidecarSpec.from_record(r) for r in record.sidecars),
            profile=record.profile,
            worker_addrs=record.worker_addrs,
            listen_addr=record.listen_addr,
            kv_events=record.kv_events,
            sandbox=record.sandbox,
            disagg_role=record.disagg_role,
            transfer_addr=record.transfer_addr,
            bootstrap_port=record.bootstrap_port,
        )

    @property
    def worker(self) -> bool:
        """A worker of a multi-node replica: it serves nothing."""
        return self.nodes > 1 and self.rank > 0


@dataclass
class Shard:
    """One shard on this node: what was ordered, where its engine runs, and its state
    (``reason`` says why it failed or exited)."""

    spec: ShardSpec
    state: ShardState = ShardState.STARTING
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
    startup_s: float = 0.0
    """Seconds from its start to its health check passing (0: not seen here)."""
    sidecars: SidecarSet | None = None
    log_offset: int = 0
    """Where this engine's output starts in the shard's log (appended to across runs)."""
    ready_before: bool = False
    """Adopted from a previous agent that had seen it ready."""
    stop_grace: float = 10.0
    draining: bool = False
    """Retired: new requests are refused while those in flight end, then it stops."""
    fetching: asyncio.Future[Path] | None = None
    """The download of its source, while it runs (stopping the shard cancels it)."""
    kv_events_endpoint: str = ""
    """Where the agent receives its engine's KV cache events ("": it does not)."""
    sandbox: Sandboxed | None = None
    """The sandbox this agent started its engine in (None: none, or adopted)."""
    sandboxed: bool = False
    """Its engine runs under bubblewrap (``pid`` is bwrap's)."""
    sleep_level: int = 0
    """Asleep (or falling asleep, waking): the level it sleeps at."""
    host_memory_mib: int = 0
    """Asleep: the host memory its engine says it holds."""
    transition_ms: int = 0
    """How long its last sleep or wake took."""
    recorded_state: str = ""
    """Adopted: the state the previous agent recorded."""
    relay: BootstrapRelay | None = None
    """An SGLang prefill's relay from its transfer address to its bootstrap server, while
    its engine runs."""

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
            nodes=spec.nodes,
            dist_init_addr=spec.dist_init_addr,
            gpus=spec.gpus,
            source=spec.source,
            gpu_memory_mib=spec.gpu_memory_mib,
            profile=spec.profile,
            sidecars=(
                self.sidecars.records()
                if self.sidecars is not None
                else tuple(_sidecar_record(s) for s in spec.sidecars)
            ),
            worker_addrs=spec.worker_addrs,
            listen_addr=spec.listen_addr,
            log_offset=self.log_offset,
            kv_events=spec.kv_events,
            kv_events_endpoint=self.kv_events_endpoint,
            sandbox=spec.sandbox,
            sandboxed=self.sandboxed,
            sleep_level=self.sleep_level,
            disagg_role=spec.disagg_role,
            transfer_addr=spec.transfer_addr,
            bootstrap_port=spec.bootstrap_port,
        )


def _sidecar_record(spec: SidecarSpec) -> SidecarRecord:
    return SidecarRecord(
        name=spec.name,
        argv=spec.argv,
        health_url=spec.health_url,
        timeout_s=spec.timeout_s,
        ready_after_s=spec.ready_after_s,
    )


def check_shape(spec: ShardSpec) -> None:
    """The replica shape of ``spec`` makes sense; ShardError naming the field when not."""
    if spec.nodes < 1:
        raise ShardError(f"shard {spec.shard_id}: nodes must be at least 1, got {spec.nodes}")
    if spec.nodes == 1:
        return
    if not 0 <= spec.rank < spec.nodes:
        raise ShardError(
            f"shard {spec.shard_id}: rank {spec.rank} is out of range for a replica of "
            f"{spec.nodes} nodes (0..{spec.nodes - 1})"
        )
    try:
        parse_hostport(spec.dist_init_addr)
    except ConfigError as exc:
        raise ShardError(
            f"shard {spec.shard_id}: a replica of {spec.nodes} nodes needs dist_init_addr "
            f"HOST:PORT (rank 0 binds it, workers dial it): {exc}"
        ) from None


def check_rendezvous_port(spec: ShardSpec, ports: PortRange) -> None:
    """The port ``spec`` binds for its replica's rendezvous lies in this node's
    ``multinode_ports``; ShardError naming the address, the range and the fix when not.

    Rank 0 binds ``dist_init_addr`` where the workers dial it (sim, vLLM, SGLang); where rank
    0 dials its workers (llama.cpp), a worker binds its ``listen_addr`` (or, without one, its
    entry of ``worker_addrs``, as the builder reads it). The others bind nothing there. An
    address that is not host:port is left to the builder, which says what is missing."""
    engine = ENGINES.get(spec.engine)
    if spec.nodes < 2 or engine is None:
        return  # one node meets no one; an unknown engine is refused by the launcher
    if engine.dials_workers:
        if spec.rank == 0:
            return
        addr = spec.listen_addr
        if not addr and len(spec.worker_addrs) == spec.nodes - 1:
            addr = spec.worker_addrs[spec.rank - 1]
        what = "its rpc-server endpoint (listen_addr)"
    else:
        if spec.rank != 0:
            return
        addr, what = spec.dist_init_addr, "its dist-init address (dist_init_addr)"
    _check_port_in_range(spec, what, addr, ports)


def check_disagg(spec: ShardSpec, ports: PortRange) -> None:
    """A disaggregated shard's order makes sense: a role llmgw knows, on an engine that can
    disaggregate, a single-node replica, a ``transfer_addr`` with the role (and none
    without), its port inside this node's ``multinode_ports`` (peers on the fabric dial it,
    like a rendezvous); ShardError saying what is wrong and what to do when not. An unknown
    engine is left to the launcher, which names the known ones."""
    engine = ENGINES.get(spec.engine)
    if engine is None:
        return
    shape = EngineSpec(
        engine=spec.engine,
        model=spec.model,
        port=1,
        nodes=spec.nodes,
        rank=spec.rank,
        disagg_role=spec.disagg_role,
        transfer_addr=spec.transfer_addr,
    )
    try:
        check_role(spec.engine, engine.disagg_handover, shape)
    except EngineError as exc:
        raise ShardError(f"shard {spec.shard_id}: {exc.message}") from None
    if spec.disagg_role:
        what = f"its KV transfer address (transfer_addr, a {spec.disagg_role} shard's)"
        _check_port_in_range(spec, what, spec.transfer_addr, ports)


def _check_port_in_range(spec: ShardSpec, what: str, addr: str, ports: PortRange) -> None:
    """The port of ``addr`` (host:port) lies in ``ports``; an address that is not host:port
    is left to the builder, which says what is missing."""
    try:
        port = parse_hostport(addr)[1]
    except ConfigError:
        return
    if port not in ports:
        raise ShardError(
            f"shard {spec.shard_id}: {what} {addr} is outside this node's multinode_ports "
            f"{ports}, the only ports its firewall opens to the fabric's peers; the control "
            "plane places inside the range a node reports, so restart the agent if agent.yaml "
            "changed since it started (or upgrade a control plane that predates the range), "
            "or widen multinode_ports in agent.yaml to hold it and re-run install-agent.sh so "
            "that the firewall follows"
        )
