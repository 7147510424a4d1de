"""The agent's end of the Connect stream: dial, say Hello, carry out orders, reconnect.

The agent tries each control plane it knows in turn (agent.yaml's, then those the leader
named: :class:`~llmgw.agent.servers.KnownServers`) with jittered exponential backoff; a
standby's refusal that names the leader sends it there next.
Every order is checked against the operation log first: an order from a lower epoch is
rejected and reported, an op id already applied is acknowledged without being applied.
Orders are carried out by the parts the service hands in: shard starts and stops by the
shard supervisor, engine installs by ``installer``, signed updates by ``updater``; one order
at a time per shard, and each answered with an ``OperationResult``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import grpc

from llmgw import __version__
from llmgw.agent.oplog import OperationLog
from llmgw.agent.servers import KnownServers
from llmgw.agent.shards import Shard, ShardManager, ShardSpec, ShardState
from llmgw.errors import EngineError, LlmgwError, StaleEpoch, StreamError, UpdateError
from llmgw.log import kv
from llmgw.netaddr import CONTROL_PLANE_NAME
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.versions import MINORS_SUPPORTED, too_old

__all__ = [
    "Backoff",
    "Credentials",
    "StreamClient",
    "StreamState",
    "shard_status",
    "silence_limit",
]

log = logging.getLogger("llmgw.agent.stream")

StreamState = Literal["connected", "disconnected"]
"""What ``on_state`` is told: a control plane welcomed this node, or the stream to it ended."""

_STATE_TO_PB = {
    ShardState.STARTING: pb.SHARD_STARTING,
    ShardState.READY: pb.SHARD_READY,
    ShardState.FAILED: pb.SHARD_FAILED,
    ShardState.EXITED: pb.SHARD_EXITED,
    ShardState.FALLING_ASLEEP: pb.SHARD_FALLING_ASLEEP,
    ShardState.ASLEEP: pb.SHARD_ASLEEP,
    ShardState.WAKING: pb.SHARD_WAKING,
}


def shard_status(shard: Shard) -> pb.ShardStatus:
    return pb.ShardStatus(
        shard_id=shard.shard_id,
        replica_id=shard.spec.replica_id,
        model=shard.spec.model,
        state=_STATE_TO_PB[shard.state],
        port=shard.port,
        reason=shard.reason,
        exit_code=shard.exit_code or 0,
        has_exit_code=shard.exit_code is not None,
        pid=shard.pid,
        startup_s=shard.startup_s,
        sleep_level=shard.sleep_level,
        host_memory_mib=shard.host_memory_mib,
        transition_ms=shard.transition_ms,
    )


SILENCE_FLOOR = 3.0  # seconds: never judged silent sooner, however short the interval
# Heartbeat intervals without a word from the control plane after which it is judged gone
# (paused or cut off): every heartbeat is answered at once, so two intervals of silence are a
# whole heartbeat unanswered for an interval. With the default 5 s and the default lease
# (8 s, renewed every 2 s) a paused leader is noticed 5-10 s after the pause, when its lease
# has lapsed or is about to: the agents are on its successor within 15 s.
SILENCE_BEATS = 2


def silence_limit(interval: float) -> float:
    """Seconds of silence on a stream whose heartbeats go every *interval* that end it."""
    return max(SILENCE_BEATS * interval, SILENCE_FLOOR)


CONNECT_TIMEOUT = 5.0  # seconds for TCP and TLS to a control plane
STANDBY_PACE_FOR = 60.0  # seconds after a standby's refusal that retries stay short
# Seconds during which a standby's refusal naming the control plane that just fell silent is
# not followed: its lease has not lapsed yet, so standbys still name it, and dialling a
# paused process costs CONNECT_TIMEOUT; the others are tried first (it stays in the rotation).
SUSPECT_FOR = 30.0


@dataclass
class Backoff:
    """Full-jitter exponential backoff: sleep uniform(0, min(cap, base * 2**attempt))."""

    base: float = 0.5
    cap: float = 30.0
    attempt: int = 0

    def next_delay(self) -> float:
        delay = random.uniform(0, min(self.cap, self.base * (2**self.attempt)))
        self.attempt = min(self.attempt + 1, 16)
        return max(delay, 0.05)

    def reset(self) -> None:
        self.attempt = 0


@dataclass(frozen=True)
class Credentials:
    cert: bytes
    key: bytes
    ca: bytes


_CHANNEL_OPTIONS = (
    # Whatever address we dial, only a certificate naming CONTROL_PLANE_NAME passes
    # the handshake: control-plane certificates carry it, a node's never can (its id
    # may equal the host name we dial). Nothing is read from the stream before that,
    # so no epoch or order from anyone else ever reaches the operation log.
    ("grpc.ssl_target_name_override", CONTROL_PLANE_NAME),
    # A retired instance's server certificate (KnownServers.is_retired) is not
    # refused here, unlike its client certificate on the data plane: gRPC Python
    # shows a client neither the server's certificate nor its auth context (a
    # Call has no auth_context(), the credentials take no verify callback). The
    # leader stops naming a retired instance, and its id and certificates are
    # refused at start, so reaching one takes an agent.yaml seed that still names
    # it and its files run outside the cluster's database.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


class StreamClient:
    """Keeps one Connect stream to the first control plane that accepts this node."""

    def __init__(
        self,
        *,
        node_id: str,
        servers: KnownServers,
        credentials: Callable[[], Credentials],
        shards: ShardManager,
        oplog: OperationLog,
        inventory: Callable[[], pb.Inventory],
        dataplane_addr: Callable[[str], str],
        inflight: Callable[[], int] = lambda: 0,
        gpu_utilization: Callable[[], Sequence[pb.GpuUtilization]] = lambda: (),
        on_state: Callable[[StreamState, str | None], None] = lambda state, server: None,
        on_renewal_answer: Callable[[pb.RenewCertificate], None] = lambda msg: None,
        on_trust_bundle: Callable[[pb.TrustBundle], object] = lambda msg: None,
        installer: Callable[[pb.InstallEngine], Awaitable[None]] | None = None,
        updater: Callable[[pb.UpdateOrder], Awaitable[None]] | None = None,
        on_warm: Callable[[list[tuple[str, str]]], None] = lambda sources: None,
    ) -> None:
        self.node_id = node_id
        self.servers = servers
        self.creds = credentials
        self.shards = shards
        self.oplog = oplog
        self.inventory = inventory
        self.dataplane_addr = dataplane_addr
        self.inflight = inflight
        # The GPUs' latest utilisation (llmgw.agent.gpu_sampler), carried by each heartbeat.
        self.gpu_utilization = gpu_utilization
        self.on_state = on_state
        self.on_renewal_answer = on_renewal_answer
        # The CA rotation's trust bundle (llmgw.agent.renewal.Renewer.trust).
        self.on_trust_bundle = on_trust_bundle
        self.installer = installer or _no_installer
        self.updater = updater or _no_updater
        # The sources to keep in the page cache, as each HeartbeatAck names them
        # (llmgw.agent.warming.Warmer.want).
        self.on_warm = on_warm
        self.node_state = "unknown"
        self.cluster_id = ""
        self.backoff = Backoff()
        self.connected_to: str | None = None
        self._queue: asyncio.Queue[pb.AgentMessage | None] | None = None
        self._shard_locks: dict[str, asyncio.Lock] = {}
        self._order_tasks: set[asyncio.Task[None]] = set()
        self._heartbeat_interval = 5.0
        self._heard = 0.0  # time.monotonic() of the last message from the control plane
        self._silent = 0.0  # seconds of silence that ended the stream (0: it did not)
        self._standby_seen = -STANDBY_PACE_FOR  # time.monotonic() of a standby's last refusal
        # The control plane that last fell silent and when (time.monotonic()); None once
        # another has welcomed this node.
        self._suspect: tuple[str, float] | None = None
        # Whether the last dial completed its TLS handshake (the channel was ready): a
        # connection closed after that was lost, not refused for this node's certificate.
        self._established = False

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats: the control plane's Welcome says, 5 before one."""
        return self._heartbeat_interval

    # -- outgoing -----------------------------------------------------------------------

    def send(self, msg: pb.AgentMessage) -> bool:
        """Queue a message on the live stream; False when there is none (Hello will catch up)."""
        if self._queue is None:
            return False
        self._queue.put_nowait(msg)
        return True

    async def flushed(self, timeout: float) -> None:
        """Wait until the messages queued so far have been handed to gRPC (or timeout)."""
        queue = self._queue
        if queue is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not queue.empty() and loop.time() < deadline:  # noqa: ASYNC110 - bounded poll
            await asyncio.sleep(0.01)

    def report_shard(self, shard: Shard) -> None:
        self.send(pb.AgentMessage(shard_status=shard_status(shard)))

    async def _outgoing(
        self, queue: asyncio.Queue[pb.AgentMessage | None]
    ) -> AsyncIterator[pb.AgentMessage]:
        while True:
            msg = await queue.get()
            if msg is None:
                return
            yield msg

    # -- the connection loop ---------------------------------------------------------------

    async def run(self) -> None:
        """Connect forever, moving through the known servers (or to a named leader); returns
        only when cancelled. The list is read again before each dial: what the leader named
        on one stream is tried on the next."""
        index = 0
        named_leader: str | None = None
        while True:
            if named_leader is not None:
                server, named_leader = named_leader, None
            else:
                rotation = self.servers.rotation()
                server = rotation[index % len(rotation)]
                index += 1
            started = time.monotonic()
            refused = False
            try:
                await self._session(server)
                reason = "stream closed by the control plane"
            except Refused as exc:
                refused = True
                reason = f"{server} refused: {exc.message}"
                if exc.leader and exc.leader != server and self._suspected(exc.leader):
                    log.warning(
                        "control plane is a standby naming the leader that fell silent (its "
                        "lease not lapsed yet); trying the others first",
                        extra=kv(server=server, leader=exc.leader),
                    )
                elif exc.leader and exc.leader != server:
                    named_leader = exc.leader
                    log.warning(
                        "control plane is a standby; moving to the leader it names",
                        extra=kv(server=server, leader=exc.leader),
                    )
            except StaleEpoch as exc:
                reason = str(exc)
            except grpc.aio.AioRpcError as exc:
                reason = _describe_rpc_error(exc, server, established=self._established)
            except (OSError, LlmgwError) as exc:
                reason = str(exc)
            finally:
                self._queue = None
                if self.connected_to is not None:
                    self.connected_to = None
                    self.on_state("disconnected", server)
            if time.monotonic() - started > 30:
                self.backoff.reset()
            if refused:
                self._standby_seen = time.monotonic()
            if time.monotonic() - self._standby_seen < STANDBY_PACE_FOR:
                # A live standby answered lately: a leader is there or about to be (a
                # take-over takes seconds), so keep looking at a short, jittered pace (at
                # most 2 s), the leader it named being gone included.
                self.backoff.attempt = min(self.backoff.attempt, 2)
            delay = self.backoff.next_delay()
            rotation = self.servers.rotation()
            upcoming = named_leader or rotation[index % len(rotation)]
            log.warning(
                "control plane stream ended; reconnecting",
                extra=kv(server=server, reason=reason, next=upcoming, retry_in=f"{delay:.2f}s"),
            )
            await asyncio.sleep(delay)

    async def _session(self, server: str) -> None:
        # Read at every connection: a renewal, a rekey or a CA rotation's trust bundle
        # replaces the files under us (tls.ca may hold several CAs, current first).
        current = self.creds()
        creds = grpc.ssl_channel_credentials(
            root_certificates=current.ca,
            private_key=current.key,
            certificate_chain=current.cert,
        )
        self._established = False
        async with grpc.aio.secure_channel(server, creds, options=_CHANNEL_OPTIONS) as channel:
            self._established = await _connected(channel, server)
            stub = pb_grpc.ControlPlaneStub(channel)
            queue: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
            call = stub.Connect(self._outgoing(queue))
            queue.put_nowait(pb.AgentMessage(hello=self._hello(server)))
            self._queue = queue
            heartbeat: asyncio.Task[None] | None = None
            self._heard = time.monotonic()
            self._silent = 0.0
            try:
                async for msg in call:
                    self._heard = time.monotonic()
                    if self._on_message(msg, server) and heartbeat is None:
                        heartbeat = asyncio.create_task(self._heartbeats(queue, call))
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                task = asyncio.current_task()
                if self._silent and not (task is not None and task.cancelling()):
                    self._suspect = (server, time.monotonic())
                    raise StreamError(
                        f"{server} sent nothing for {self._silent:.0f} s, not even the answer "
                        "to a heartbeat (a paused or cut-off control plane); looking for the "
                        "leader elsewhere"
                    ) from None
                raise
            finally:
                self._queue = None
                queue.put_nowait(None)
                if heartbeat is not None:
                    heartbeat.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await heartbeat

    def _suspected(self, server: str) -> bool:
        """Whether *server* fell silent on this node within SUSPECT_FOR seconds."""
        return (
            self._suspect is not None
            and self._suspect[0] == server
            and time.monotonic() - self._suspect[1] < SUSPECT_FOR
        )

    def _on_message(self, msg: pb.ServerMessage, server: str) -> bool:
        """Act on one message of the control plane's; True for its welcome (after which the
        heartbeats start). A refusal ends the stream (Refused)."""
        kind = msg.WhichOneof("msg")
        if kind == "refuse":
            raise Refused(msg.refuse.leader, msg.refuse.message)
        if kind == "welcome":
            self._welcome(msg.welcome, server)
            return True
        elif kind == "node_state":
            self._set_node_state(msg.node_state.state, msg.node_state.message)
        elif kind == "renew_certificate":
            self.on_renewal_answer(msg.renew_certificate)
        elif kind == "trust_bundle":
            self.on_trust_bundle(msg.trust_bundle)
        elif kind == "control_planes":
            self._control_planes(msg.control_planes, server)
        elif kind == "heartbeat_ack":
            # Heard; and, from a leader that says it, the set of sources to keep warm (the
            # welcoming leader's only: no ack comes before the heartbeats it starts).
            ack = msg.heartbeat_ack
            if ack.HasField("warm") and self.connected_to == server:
                self.on_warm([(w.source, w.sha256) for w in ack.warm.sources])
        elif kind == "start_shard":
            self._spawn_order(
                msg.start_shard.meta,
                msg.start_shard.shard_id,
                self._start(msg.start_shard),
            )
        elif kind == "install_engine":
            install = msg.install_engine
            self._spawn_order(install.meta, f"install:{install.engine}", self.installer(install))
        elif kind == "update_order":
            update = msg.update_order
            self._spawn_order(update.meta, "update", self.updater(update))
        elif kind == "stop_shard":
            self._spawn_order(
                msg.stop_shard.meta, msg.stop_shard.shard_id, self._stop(msg.stop_shard)
            )
        elif kind == "sleep_shard":
            order = msg.sleep_shard
            self._spawn_order(
                order.meta, order.shard_id, self.shards.sleep(order.shard_id, order.level)
            )
        elif kind == "wake_shard":
            self._spawn_order(
                msg.wake_shard.meta,
                msg.wake_shard.shard_id,
                self.shards.wake(msg.wake_shard.shard_id),
            )
        else:
            log.warning(
                "ignoring an unknown message from the control plane",
                extra=kv(kind=kind),
            )
        return False

    def _hello(self, server: str) -> pb.Hello:
        return pb.Hello(
            node_id=self.node_id,
            agent_version=__version__,
            inventory=self.inventory(),
            shards=[shard_status(s) for s in self.shards.snapshot()],
            max_epoch=self.oplog.max_epoch,
            dataplane_addr=self.dataplane_addr(server),
        )

    def _welcome(self, welcome: pb.Welcome, server: str) -> None:
        self.oplog.observe_epoch(welcome.epoch)
        self.cluster_id = welcome.cluster_id
        self._heartbeat_interval = welcome.heartbeat_interval_s or 5.0
        self.connected_to = server
        self.backoff.reset()
        self._suspect = None
        log.info(
            "connected to the control plane",
            extra=kv(
                server=server,
                cluster=welcome.cluster_id,
                epoch=welcome.epoch,
                version=welcome.server_version or "?",
            ),
        )
        if too_old(__version__, welcome.server_version):
            log.warning(
                f"this agent is more than {MINORS_SUPPORTED} minor releases behind the control "
                "plane; upgrade it",
                extra=kv(
                    version=__version__,
                    server_version=welcome.server_version,
                    hint=f"llmgw ctl update {self.node_id} --version {welcome.server_version}",
                ),
            )
        self.on_state("connected", server)
        self._set_node_state(welcome.node_state or "approved", "")

    def _control_planes(self, msg: pb.ControlPlanes, server: str) -> None:
        # Only the leader that welcomed us (its epoch checked) may say where the cluster
        # is; the refusal of a standby names the leader in a Refuse, never in this.
        if self.connected_to != server:
            log.warning(
                "ignoring a list of control planes sent before the Welcome",
                extra=kv(server=server, entries=len(msg.servers)),
            )
            return
        self.servers.learn(msg.servers, source=server, retired_serials=msg.retired_serials)

    def _set_node_state(self, state: str, message: str) -> None:
        if state == self.node_state:
            return
        self.node_state = state
        if state == "pending":
            log.warning(
                "this node is waiting for an operator's approval; it gets no work until then",
                extra=kv(
                    node=self.node_id, hint=f"llmgw ctl approve {self.node_id} --fingerprint ..."
                ),
            )
        else:
            log.info(
                "node state changed", extra=kv(node=self.node_id, state=state, message=message)
            )

    async def _heartbeats(
        self, queue: asyncio.Queue[pb.AgentMessage | None], call: grpc.aio.Call
    ) -> None:
        """Send a heartbeat each interval; end the stream when the control plane has said
        nothing (each heartbeat is answered) for :func:`silence_limit`. It wakes at whichever
        comes first, the next heartbeat or the moment the silence reaches the limit, so a
        paused control plane is noticed at the limit, not up to an interval later."""
        seq = 0
        interval = self._heartbeat_interval
        limit = silence_limit(interval)
        beat_at = time.monotonic() + interval
        while True:
            await asyncio.sleep(max(0.0, min(beat_at, self._heard + limit) - time.monotonic()))
            now = time.monotonic()
            silent = now - self._heard
            if silent >= limit:
                self._silent = silent
                call.cancel()
                return
            if now < beat_at:
                continue  # woken for the silence, which a message has ended since
            beat_at = now + interval
            seq += 1
            queue.put_nowait(
                pb.AgentMessage(
                    heartbeat=pb.Heartbeat(
                        seq=seq,
                        inflight=self.inflight(),
                        gpu_utilization=self.gpu_utilization(),
                    )
                )
            )

    # -- orders -----------------------------------------------------------------------------

    def _spawn_order(self, meta: pb.OrderMeta, shard_id: str, action: object) -> None:
        task = asyncio.create_task(self._order(meta, shard_id, action))
        self._order_tasks.add(task)
        task.add_done_callback(self._order_tasks.discard)

    async def _order(self, meta: pb.OrderMeta, shard_id: str, action: object) -> None:
        assert asyncio.iscoroutine(action)
        lock = self._shard_locks.setdefault(shard_id, asyncio.Lock())
        async with lock:
            try:
                decision = self.oplog.check(meta.epoch, meta.op_id)
            except StaleEpoch as exc:
                action.close()
                log.warning(
                    "rejected an order", extra=kv(op=meta.op_id, shard=shard_id, reason=str(exc))
                )
                self._result(meta, ok=False, error=str(exc))
                return
            if not decision.apply:
                action.close()
                log.info(
                    "order already applied; acknowledging", extra=kv(op=meta.op_id, shard=shard_id)
                )
                self._result(meta, ok=True, duplicate=True)
                return
            try:
                await action
            except LlmgwError as exc:
                self.oplog.record(meta.epoch, meta.op_id)
                log.warning("order failed", extra=kv(op=meta.op_id, shard=shard_id, error=str(exc)))
                self._result(meta, ok=False, error=str(exc))
                return
            self.oplog.record(meta.epoch, meta.op_id)
            self._result(meta, ok=True)

    def _result(
        self, meta: pb.OrderMeta, *, ok: bool, error: str = "", duplicate: bool = False
    ) -> None:
        self.send(
            pb.AgentMessage(
                op_result=pb.OperationResult(
                    op_id=meta.op_id, ok=ok, error=error, epoch=meta.epoch, duplicate=duplicate
                )
            )
        )

    async def _start(self, order: pb.StartShard) -> None:
        await self.shards.start(ShardSpec.from_order(order))

    async def _stop(self, order: pb.StopShard) -> None:
        shard = await self.shards.stop(
            order.shard_id, grace=order.grace_s or 10.0, drain=max(0.0, order.drain_s)
        )
        if shard is None:
            # Unknown here: tell the control plane it is gone so it can forget it.
            self.send(
                pb.AgentMessage(
                    shard_status=pb.ShardStatus(
                        shard_id=order.shard_id,
                        state=pb.SHARD_EXITED,
                        reason="not running on this node",
                    )
                )
            )

    async def close(self) -> None:
        for task in list(self._order_tasks):
            task.cancel()
        await asyncio.gather(*self._order_tasks, return_exceptions=True)


async def _no_installer(order: pb.InstallEngine) -> None:
    raise EngineError(
        f"this agent cannot install engines (asked for {order.engine} {order.version})"
    )


async def _no_updater(order: pb.UpdateOrder) -> None:
    raise UpdateError("this agent cannot update itself (no update spool configured)")


async def _connected(channel: grpc.aio.Channel, server: str) -> bool:
    """Wait until *channel* is connected (True: its TLS handshake completed) or has failed
    (False: a stopped control plane, a TLS refusal; the call then fails at once, saying why);
    one that never completes (a paused control plane: its kernel takes the TCP connection, its
    TLS never comes) fails after CONNECT_TIMEOUT. Either way the next control plane is tried
    instead of gRPC's retries."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_TIMEOUT
    # Polled, not awaited with wait_for_state_change: a cancelled state watcher can keep the
    # channel from closing (an agent asked to stop while it dials).
    while True:
        state = channel.get_state(try_to_connect=True)
        if state is grpc.ChannelConnectivity.READY:
            return True
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return False  # the call fails at once, saying why
        if loop.time() >= deadline:
            raise StreamError(
                f"{server} did not complete a connection within {CONNECT_TIMEOUT:g} s "
                "(paused or unreachable); trying the next control plane"
            )
        await asyncio.sleep(0.02)


class Refused(Exception):
    """A standby control plane refused the stream and named the leader."""

    def __init__(self, leader: str, message: str) -> None:
        super().__init__(message)
        self.leader = leader
        self.message = message


def _describe_rpc_error(exc: grpc.aio.AioRpcError, server: str, *, established: bool) -> str:
    """Why the stream to *server* ended, with what to check; *established*: the connection
    had completed its TLS handshake (then a closed socket is a lost connection, never a
    refused certificate)."""
    code = exc.code()
    details = exc.details() or ""
    if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
        # The control plane's own words (a revoked certificate, an agent newer than it):
        # they say what to do; the agent retries with backoff meanwhile.
        return f"refused by {server}: {details}"
    if code == grpc.StatusCode.UNAVAILABLE:
        lowered = details.lower()
        # gRPC's words for a certificate without the name we pin (older and newer releases)
        if "hostname verification" in lowered or "not in peer certificate" in lowered:
            return (
                f"{server} is not the control plane: its TLS certificate, though issued by the "
                f"cluster CA, does not carry the name {CONTROL_PLANE_NAME} that every "
                "control-plane certificate does (a node's certificate, or a control plane not "
                "yet restarted on this version, which reissues it); check that the address in "
                "agent.yaml is the control plane's"
            )
        if (
            "certificate" in details.lower()
            or "handshake" in details.lower()
            or "ssl" in details.lower()
        ):
            return (
                f"TLS with {server} failed ({details}); check that tls.ca in agent.yaml is the "
                "cluster CA and that the node certificate was issued by it"
            )
        closed = "socket closed" in lowered or "connection reset" in lowered
        if closed and established:
            return (
                f"the connection to {server} was lost ({details}): the control plane stopped "
                "or the network between failed; looking for the leader among the control planes"
            )
        if closed:
            return (
                f"{server} closed the connection during the TLS handshake ({details}); it most "
                "likely refused this node's certificate: check that tls.cert in agent.yaml was "
                "issued by the cluster CA"
            )
        return f"{server} unavailable ({details}); is the control plane running?"
    return f"{code.name}: {details}"
