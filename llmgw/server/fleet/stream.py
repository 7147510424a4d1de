"""The control plane's end of the Connect stream (gRPC over mTLS on :7443).

One ``NodeSession`` per connected agent. A stream is accepted only when the node id its
Hello claims is the CN of the client certificate it presented; otherwise both ends are
told why. The Welcome is followed by the list of every control-plane instance
(``pb.ControlPlanes``), which agents keep to find the cluster again when the instances they
were given are gone, with the certificate serials of the retired ones, which they refuse.
Every message after the Hello passes the session's :class:`Intake` (size and rate limits,
what a pending node may send) first. Orders to the node are queued
on its session and carry the leader's epoch and a fresh op id.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from cryptography import x509
from google.protobuf.message import DecodeError

from llmgw import __version__
from llmgw.contracts.control_planes import (
    ControlPlaneList,
    check_control_planes,
    check_retired_serials,
)
from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.errors import ConfigError, LlmgwError, StoreUnavailable
from llmgw.log import kv
from llmgw.netaddr import format_hostport, parse_hostport
from llmgw.pki import Identity
from llmgw.proto import control_pb2 as pb
from llmgw.proto import control_pb2_grpc as pb_grpc
from llmgw.server.common.tls import StreamCredentials
from llmgw.server.fleet.intake import MAX_MESSAGE_BYTES, Intake, hello_problem, trim_hello
from llmgw.server.store import Store
from llmgw.versions import newer_release

__all__ = [
    "STREAM_OPTIONS",
    "ControlPlaneService",
    "MessageHandler",
    "NodeSession",
    "SessionHandler",
    "UpdateHandler",
    "checked_control_planes",
    "control_planes_message",
    "peer_common_name",
    "start_stream_server",
    "version_refusal",
]

log = logging.getLogger("llmgw.server.stream")

# What one kind of an agent's messages after its Hello is given: the session and the message.
MessageHandler = Callable[["NodeSession", pb.AgentMessage], None]


@dataclass(eq=False)
class NodeSession:
    """A live stream to one agent."""

    node_id: str
    dataplane_addr: str
    epoch: int
    engines: frozenset[str]
    serial: str = ""
    queue: asyncio.Queue[pb.ServerMessage | None] = field(default_factory=asyncio.Queue)
    connected_at: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.monotonic)
    # When it was last heard from, by the store's clock: kept here, stored in batches
    # (llmgw.server.fleet.sessions.Sessions.flush_last_seen), read by the admin API live.
    seen_at: float = field(default_factory=time.time)
    # Reports not stored while the database was away: the session is restarted once it
    # answers, so that the agent's Hello tells them again.
    unstored: int = 0
    inflight: int = 0
    # Each GPU's utilisation (uuid -> percent, None: the GPU cannot tell) from the latest
    # heartbeat, bounded (llmgw.server.fleet.intake.heartbeat_utilization): kept here, never stored
    # (it changes every second), read by the admin API live.
    gpu_utilization: dict[str, int | None] = field(default_factory=dict)
    draining: bool = False
    # Its heartbeats stopped for the loss timeout (as opposed to a stream that closed).
    silent: bool = False
    # Approved by an operator; until then it gets no orders and little of what it sends
    # is kept (llmgw.server.fleet.intake).
    approved: bool = False
    # A pending node's latest full inventory, stored once it is approved.
    held_inventory: pb.Inventory | None = None
    intake: Intake | None = None
    # A message on the stream was not an AgentMessage: the stream ends with this.
    garbage: DecodeError | None = None

    def _meta(self) -> pb.OrderMeta:
        return pb.OrderMeta(epoch=self.epoch, op_id=uuid.uuid4().hex)

    def start_shard(
        self,
        *,
        shard_id: str,
        replica_id: str,
        model: str,
        engine: str,
        rank: int,
        params: dict[str, str],
        extra_args: list[str],
        gpus: list[str] | None = None,
        nodes: int = 1,
        dist_init_addr: str = "",
        source: str = "",
        source_sha256: str = "",
        gpu_memory_mib: int = 0,
        sidecars: list[dict[str, Any]] | None = None,
        profile: str = "",
        worker_addrs: list[str] | None = None,
        listen_addr: str = "",
        kv_events: bool = False,
        sandbox: SandboxPolicy | None = None,
        disagg_role: str = "",
        transfer_addr: str = "",
    ) -> str:
        meta = self._meta()
        self.queue.put_nowait(
            pb.ServerMessage(
                start_shard=pb.StartShard(
                    meta=meta,
                    shard_id=shard_id,
                    replica_id=replica_id,
                    model=model,
                    engine=engine,
                    rank=rank,
                    params=params,
                    extra_args=extra_args,
                    gpus=gpus or [],
                    nodes=nodes,
                    dist_init_addr=dist_init_addr,
                    source=source,
                    source_sha256=source_sha256,
                    gpu_memory_mib=gpu_memory_mib,
                    sidecars=[pb.Sidecar(**sc) for sc in sidecars or []],
                    profile=profile,
                    worker_addrs=worker_addrs or [],
                    listen_addr=listen_addr,
                    kv_events=kv_events,
                    sandbox=(sandbox or SandboxPolicy()).to_order(),
                    disagg_role=disagg_role,
                    transfer_addr=transfer_addr,
                )
            )
        )
        return meta.op_id

    def stop_shard(self, shard_id: str, grace: float = 10.0, drain: float = 0.0) -> str:
        """Order a shard stopped: after its requests in flight ended (``drain`` seconds at
        most; 0: now), SIGTERM, and SIGKILL after ``grace``."""
        meta = self._meta()
        self.queue.put_nowait(
            pb.ServerMessage(
                stop_shard=pb.StopShard(meta=meta, shard_id=shard_id, grace_s=grace, drain_s=drain)
            )
        )
        return meta.op_id

    def sleep_shard(self, shard_id: str, level: int) -> str:
        meta = self._meta()
        order = pb.SleepShard(meta=meta, shard_id=shard_id, level=level)
        self.queue.put_nowait(pb.ServerMessage(sleep_shard=order))
        return meta.op_id

    def wake_shard(self, shard_id: str) -> str:
        meta = self._meta()
        self.queue.put_nowait(
            pb.ServerMessage(wake_shard=pb.WakeShard(meta=meta, shard_id=shard_id))
        )
        return meta.op_id

    def send_control_planes(self, planes: ControlPlaneList | None) -> bool:
        """Tell the agent every current control-plane instance and the retired ones'
        serials (``planes``, as :func:`checked_control_planes` passed them); nothing is sent
        for None or an empty list, and then False."""
        if planes is None or not planes.servers:
            return False
        self.queue.put_nowait(pb.ServerMessage(control_planes=control_planes_message(planes)))
        return True

    def send(self, msg: pb.ServerMessage) -> None:
        self.queue.put_nowait(msg)

    def close(self) -> None:
        self.queue.put_nowait(None)


class SessionHandler(Protocol):
    """What a stream asks of the session life cycle (llmgw.server.fleet.sessions)."""

    def refusal(self, node_id: str, cert: x509.Certificate | None) -> str | None: ...

    def open(self, hello: pb.Hello, peer: str, cert: x509.Certificate) -> NodeSession: ...

    def node_state(self, node_id: str) -> str: ...

    def after_hello(self, session: NodeSession, hello: pb.Hello) -> None: ...

    def close(self, session: NodeSession) -> None: ...


class UpdateHandler(Protocol):
    """What a stream tells the update orders (llmgw.server.fleet.updates)."""

    def on_connect(self, session: NodeSession) -> None: ...


async def _refuse_garbage(
    context: grpc.aio.ServicerContext, peer: str, node: str | None, exc: DecodeError
) -> None:
    """End a stream that sent bytes that are not an AgentMessage: one log line, and a reason
    for the peer that names no Python class."""
    log.warning(
        "refused a stream: a message on it is not an llmgw AgentMessage",
        extra=kv(peer=peer, node=node or "?", error=str(exc)[:200]),
    )
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        "a message on this stream is not an llmgw AgentMessage; connect with an llmgw agent "
        "of the control plane's version",
    )


def version_refusal(agent_version: str, server_version: str) -> str | None:
    """Why the stream of an agent at ``agent_version`` is refused by a control plane at
    ``server_version``, or None. An agent of a newer release than its control plane may
    speak what the control plane does not know, so the control plane is upgraded first
    (llmgw.versions says what a release is: a local or development build of the control
    plane's own release passes)."""
    if not newer_release(agent_version, server_version):
        return None
    return (
        f"this agent is llmgw {agent_version}, newer than the control plane's llmgw "
        f"{server_version}; upgrade the control plane to {agent_version} or later first "
        "(control plane first, then agents), or reinstall this node with the control plane's "
        "bundle; the agent keeps retrying meanwhile"
    )


def checked_control_planes(planes: ControlPlaneList) -> ControlPlaneList | None:
    """The instance list agents are sent, as the agents check it
    (llmgw.contracts.control_planes); None, with a warning naming what is wrong, for a list
    they would refuse (or an empty one): they then keep what they knew."""
    servers = planes.servers
    if not servers:
        return None
    try:
        return ControlPlaneList(
            check_control_planes(servers), check_retired_serials(planes.retired_serials)
        )
    except ConfigError as exc:
        log.warning(
            "not sending agents the list of control planes: they would refuse it",
            extra=kv(error=str(exc), servers=",".join(str(s)[:80] for s in servers[:8])),
        )
        return None


def control_planes_message(planes: ControlPlaneList) -> pb.ControlPlanes:
    """``planes`` as the stream carries them."""
    return pb.ControlPlanes(
        servers=list(planes.servers), retired_serials=list(planes.retired_serials)
    )


def peer_certificate(context: grpc.aio.ServicerContext) -> x509.Certificate | None:
    """The verified client certificate of this stream."""
    pems = list(context.auth_context().get("x509_pem_cert") or [])
    if not pems:
        return None
    try:
        return x509.load_pem_x509_certificate(pems[0])
    except ValueError:
        return None


def peer_common_name(context: grpc.aio.ServicerContext) -> str | None:
    """The CN of the verified client certificate of this stream."""
    auth = context.auth_context()
    names = list(auth.get("x509_common_name") or [])
    if not names:
        return None
    value = names[0]
    return value.decode() if isinstance(value, bytes) else str(value)


# The Connect stream's keep-alive, the same whatever the instance's role: agents ping every
# control plane they dial every 10 s, with or without a call (llmgw.agent.stream's channel
# options), a standby included (before its refusal ends the call, and while the channel
# closes), and a server that takes pings less often answers GOAWAY too_many_pings. And the
# largest message (larger ones end the stream with RESOURCE_EXHAUSTED, llmgw.server.fleet.intake).
STREAM_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # At most every 5 s from a client, with or without a call: half the agents' interval,
    # so that a ping a little early (timers, a busy agent) is no strike.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


async def start_stream_server(
    identity: Identity,
    listen: str,
    servicer: pb_grpc.ControlPlaneServicer,
    *,
    handshake_timeout: float,
    options: Sequence[tuple[str, Any]] = (),
) -> tuple[grpc.aio.Server, int]:
    """Serve ``servicer`` on ``listen`` (host:port; port 0 binds a free one) over mutual TLS:
    ``identity`` is the certificate presented, and every client must present one its CA
    issued, with :data:`STREAM_OPTIONS` (and ``options`` after them) whichever role serves.
    A connection that has not completed its handshake within ``handshake_timeout``
    seconds is closed. Returns the started server and the port bound; ConfigError (key
    ``grpc_listen``) when the address cannot be bound."""
    # Read again when the files change (a CA rotation): llmgw.server.common.tls.
    creds = StreamCredentials(identity).credentials
    server = grpc.aio.server(
        options=[
            *STREAM_OPTIONS,
            *options,
            # A connection that never completes its TLS handshake (and HTTP/2 preface)
            # is closed instead of held (grpc's own default is two minutes).
            ("grpc.server_handshake_timeout_ms", int(handshake_timeout * 1000)),
        ]
    )
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)
    host, port = parse_hostport(listen, allow_zero=True)
    try:
        bound = server.add_secure_port(format_hostport(host, port), creds)
    except RuntimeError as exc:
        raise ConfigError(
            f"cannot listen on {listen}: {exc}; free the port or change grpc_listen",
            key="grpc_listen",
        ) from exc
    await server.start()
    return server, bound


class ControlPlaneService(pb_grpc.ControlPlaneServicer):
    """Accepts agent streams: their Hello to the session life cycle, then each message to
    its kind's handler in one table (``messages``, llmgw.server.fleet.reports.agent_messages)."""

    def __init__(
        self,
        store: Store,
        sessions: SessionHandler,
        updates: UpdateHandler,
        *,
        messages: Mapping[str, MessageHandler],
        cluster_id: str,
        epoch: int,
        heartbeat_interval: float,
        cert_lifetime: float,
        server_version: str = __version__,
        control_planes: Callable[[], ControlPlaneList] = lambda: ControlPlaneList(()),
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.updates = updates
        self.messages = messages
        self.cluster_id = cluster_id
        self.epoch = epoch
        self.heartbeat_interval = heartbeat_interval
        self.cert_lifetime = cert_lifetime
        self.server_version = server_version
        # host:port of every current instance's stream, as agents dial them, and the
        # certificate serials of the retired ones.
        self.control_planes = control_planes
        # Per node, across its reconnections (llmgw.server.fleet.intake).
        self._intakes: dict[str, Intake] = {}

    def _intake(self, node_id: str) -> Intake:
        intake = self._intakes.get(node_id)
        if intake is None:
            lifetime = float(self.cert_lifetime)
            intake = Intake(node_id, renewal_interval=min(60.0, lifetime / 4))
            self._intakes[node_id] = intake
        return intake

    async def Connect(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        try:
            await self._connect(context, peer)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except LlmgwError as exc:
            # The store refused what the node sent (or is unavailable): one line, and the
            # agent is told why, never with a Python class name.
            log.warning("stream ended", extra=kv(peer=peer, error=str(exc)[:300]))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{exc}; the agent reconnects")
        except Exception:
            log.exception("stream handler failed", extra=kv(peer=peer))  # a bug: keep the trace
            await context.abort(
                grpc.StatusCode.INTERNAL,
                "the control plane failed on this stream; its operator finds why in its log",
            )

    async def _connect(self, context: grpc.aio.ServicerContext, peer: str) -> None:
        try:
            first = await context.read()
        except DecodeError as exc:
            await _refuse_garbage(context, peer, None, exc)
            return
        if first is grpc.aio.EOF or not isinstance(first, pb.AgentMessage):
            return
        if first.WhichOneof("msg") != "hello":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the first message on a stream must be Hello; upgrade the agent to match the control plane",
            )
        hello = first.hello
        cert = await self._admit(context, peer, hello)
        intake = self._intake(hello.node_id)
        too_often = intake.admit_stream()
        if too_often is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, too_often)
        session = self.sessions.open(hello, peer, cert)
        session.intake = intake
        await self._greet(context, session)
        self.sessions.after_hello(session, hello)
        # An update ordered while the node was away goes out now (unless it expired).
        self.updates.on_connect(session)
        reader = asyncio.create_task(self._read(context, session), name=f"read-{session.node_id}")
        try:
            while True:
                msg = await session.queue.get()
                if msg is None:
                    break
                await context.write(msg)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            self.sessions.close(session)
        if session.intake is not None and session.intake.abuse is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, session.intake.abuse)
        if session.garbage is not None:
            await _refuse_garbage(context, peer, session.node_id, session.garbage)

    async def _admit(
        self, context: grpc.aio.ServicerContext, peer: str, hello: pb.Hello
    ) -> x509.Certificate:
        """The certificate of a stream whose Hello may open a session: its id the
        certificate's, its fields within bounds, the node neither refused nor newer than
        this control plane. Anything else aborts the call (and is logged, rate-limited)."""
        cn = peer_common_name(context)
        if cn != hello.node_id:
            claimed = hello.node_id[:253]
            message = (
                f"stream claims node id {claimed!r} but its certificate is for {cn!r}; "
                f"set node_id in agent.yaml to {cn!r} or join the node under its own id"
            )
            if self._intake(cn or "?").record_refusal():
                log.warning("refused a stream", extra=kv(peer=peer, claimed=claimed, cert_cn=cn))
                self.store.add_event("stream_refused", claimed or "?", message)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, message)
        problem = hello_problem(hello)
        if problem is not None:
            if self._intake(hello.node_id).record_refusal():
                log.warning("refused a stream", extra=kv(peer=peer, node=cn, reason=problem))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        trim_hello(hello)
        cert = peer_certificate(context)
        refusal = self.sessions.refusal(hello.node_id, cert)
        if refusal is not None:
            if self._intake(hello.node_id).record_refusal():
                log.warning(
                    "refused a stream", extra=kv(peer=peer, node=hello.node_id, reason=refusal)
                )
                self.store.add_event("stream_refused", hello.node_id, refusal)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        too_new = version_refusal(hello.agent_version, self.server_version)
        if too_new is not None:
            if self._intake(hello.node_id).record_refusal():
                log.warning(
                    "refused a stream: the agent is newer than this control plane",
                    extra=kv(
                        peer=peer,
                        node=hello.node_id,
                        agent_version=hello.agent_version,
                        version=self.server_version,
                    ),
                )
                self.store.add_event("stream_refused", hello.node_id, too_new)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, too_new)
        assert cert is not None
        return cert

    async def _greet(self, context: grpc.aio.ServicerContext, session: NodeSession) -> None:
        """The Welcome, then the list of control planes (second on the stream, whatever was
        queued meanwhile)."""
        await context.write(
            pb.ServerMessage(
                welcome=pb.Welcome(
                    cluster_id=self.cluster_id,
                    epoch=self.epoch,
                    heartbeat_interval_s=self.heartbeat_interval,
                    node_id=session.node_id,
                    node_state=self.sessions.node_state(session.node_id),
                    server_version=self.server_version,
                )
            )
        )
        planes = self._control_planes(session)
        if planes is not None:
            await context.write(pb.ServerMessage(control_planes=control_planes_message(planes)))

    def _control_planes(self, session: NodeSession) -> ControlPlaneList | None:
        # A list that cannot be had now costs the agent only this connection's copy (it
        # keeps the one it has), never the stream.
        try:
            return checked_control_planes(self.control_planes())
        except LlmgwError as exc:
            log.warning(
                "cannot list the control planes for an agent",
                extra=kv(node=session.node_id, error=str(exc)[:300]),
            )
            return None

    async def _read(self, context: grpc.aio.ServicerContext, session: NodeSession) -> None:
        intake = session.intake = session.intake or self._intake(session.node_id)
        try:
            while True:
                try:
                    msg = await context.read()
                except DecodeError as exc:
                    session.garbage = exc
                    break
                if msg is grpc.aio.EOF:
                    break
                assert isinstance(msg, pb.AgentMessage)
                if not intake.admit(msg, approved=session.approved):
                    if intake.abuse is not None:
                        log.warning(
                            "closing a stream", extra=kv(node=session.node_id, reason=intake.abuse)
                        )
                        self.store.add_event("stream_closed", session.node_id, intake.abuse)
                        break
                    continue
                kind = msg.WhichOneof("msg") or ""
                handler = self.messages.get(kind)
                if handler is None:
                    log.warning(
                        "unexpected message on a stream", extra=kv(node=session.node_id, kind=kind)
                    )
                    continue
                try:
                    handler(session, msg)
                except StoreUnavailable as exc:
                    # The database is away (a restart, a fail-over): the stream stays, so the
                    # gateway keeps its routes; what the message said is asked for again by
                    # reconnecting the agent once the database answers (its Hello).
                    if kind != "heartbeat":
                        session.unstored += 1
                    if session.unstored in (0, 1):
                        log.warning(
                            "cannot store what a node reports: the database is away",
                            extra=kv(node=session.node_id, error=str(exc)),
                        )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("stream read ended", extra=kv(node=session.node_id, error=str(exc)))
        finally:
            session.close()
