"""The KV cache events of this node's engines, re-keyed by llmgw's block keys and forwarded
to the control plane as ``KvEvents`` batches, for the gateway's cache-aware routing.

**The channel.** A shard whose order says ``kv_events`` (a profile with ``routing:
kv-events``) gets, before its engine starts, a directory of its own that only the agent's
user may enter, ``STATE/kv/<digest>/`` (:mod:`llmgw.agent.kvsockets`), and its engine is
given ``--kv-events-config`` naming ``ipc://`` a socket there and the shard id as topic
(:func:`engine_config`). vLLM's publisher binds an ``ipc://`` endpoint
(:func:`llmgw.engines.kvevents.publisher_binds`), so the engine makes the socket and the
agent's SUB socket dials it (:meth:`KvEventsHub.open`); no other local user can read the
token ids in it, forge or clear a shard's blocks, or take the endpoint over while no agent
runs. The endpoint is recorded with the shard (``shards.json``): an agent that adopts the
running engine dials it again, after checking that it is still as private as it was made
(:meth:`KvEventsHub.adopt`); when it is not, or when the record is an older agent's (a
loopback TCP port its engine dials, which anyone may bind), the shard is restarted rather
than left without events or talking to whoever took the port (:mod:`llmgw.agent.shards`).
Only rank 0 of a replica publishes (its scheduler owns the prefix cache).

**Bounds.** The socket holds at most :data:`RCVHWM` batches, and ZeroMQ drops one over
:data:`~llmgw.engines.kvevents.MAX_PAYLOAD` bytes before the agent holds it (the engine's
connection is dialled again; the gap in its sequence counts the batch lost, logged at most
once a minute). Each message is decoded within bounds and applied to the shard's map in a
worker thread, one at a time (:class:`_Feed`): whatever an engine sends, the event loop,
which also carries the stream's heartbeats, is never held for it.

**Docker.** A container cannot reach the agent's socket directory (llmgw-docker-proxy mounts
nothing writable into one), so shards of the docker runtime run without events (one warning
per shard): the single-node ones on the bridge network, and the multi-node ones in the host's
network namespace alike.

**Re-keying.** Each stored block is keyed by llmgw's chain of its token ids in the shard's
map (:class:`~llmgw.agent.kvmap.BlockMap`), which counts in ``lost`` what it cannot key;
so are the batches a gap in the engine's sequence numbers skipped, and bad messages (each
logged at most once a minute per shard).

**Batching.** Changes are coalesced per shard (a block stored then removed within one batch
cancels out) and sent every :data:`FLUSH_EVERY` seconds, or at once at :data:`FLUSH_AT`
pending keys, as one ``AgentMessage(kv_events=...)`` through the stream client's send. While
no stream is up they are dropped: each new stream gets every shard's whole set after its
Hello (:meth:`KvEventsHub.resync`: ``cleared`` first, then the keys, at most
:data:`~llmgw.agent.kvmap.SNAPSHOT_CHUNK` a message). A shard that stops, fails or restarts
has its socket closed, its directory removed, ``cleared`` sent once, and its map forgotten
(:meth:`KvEventsHub.close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import zmq
import zmq.asyncio

from llmgw.agent.kvmap import MAX_BLOCKS, SNAPSHOT_CHUNK, BlockMap, Pending
from llmgw.agent.kvsockets import (
    check_socket_dir,
    check_state_dir,
    prepare_socket_dir,
    prune_socket_dirs,
    remove_socket_dir,
)
from llmgw.contracts.kvblocks import BLOCK_SIZE, MAX_BLOCK_SIZE
from llmgw.engines.kvevents import (
    MAX_PAYLOAD,
    BlockStored,
    EventBatch,
    decode_batch,
    events_config,
    parse_frames,
)
from llmgw.errors import KvEventError, ShardError
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = [
    "FLUSH_AT",
    "FLUSH_EVERY",
    "RCVHWM",
    "KvEventsHub",
    "engine_config",
]

log = logging.getLogger("llmgw.agent.kvevents")

FLUSH_EVERY = 0.05
"""Seconds a change waits for others before it is sent."""
FLUSH_AT = 8192
"""Pending keys (stored and removed) that are sent at once."""
BAD_LOG_EVERY = 60.0
"""Seconds between two log lines about one shard's bad messages (or lost batches)."""
RCVHWM = 16
"""Batches queued for the agent in its socket (an engine step's events are one batch): at
most 64 MiB of the largest, and a slow agent makes the engine drop, not queue."""
_RECONNECT_MS = 20


def engine_config(shard_id: str, endpoint: str) -> str:
    """The ``--kv-events-config`` that makes a shard's engine publish to ``endpoint`` (the
    ``ipc://`` socket :meth:`KvEventsHub.open` made) under its shard id; "" (none) when
    ``endpoint`` is ""."""
    return events_config(endpoint, shard_id) if endpoint else ""


class _Throttle:
    """A log line at most once every :data:`BAD_LOG_EVERY` seconds, telling how many times
    it happened meanwhile."""

    def __init__(self, clock: Callable[[], float], message: str) -> None:
        self.clock = clock
        self.message = message
        self.logged_at = float("-inf")
        self.unlogged = 0

    def __call__(self, shard_id: str, count: int, **fields: object) -> None:
        self.unlogged += count
        now = self.clock()
        if now - self.logged_at < BAD_LOG_EVERY:
            return
        log.warning(
            self.message,
            extra=kv(shard=shard_id, count=self.unlogged, every=f"{BAD_LOG_EVERY:g}s", **fields),
        )
        self.logged_at, self.unlogged = now, 0


class _Feed:
    """One shard's subscription: its socket, the sequence it expects next, its map and
    what is pending.

    Each message is checked, decoded and applied to the map in a worker thread
    (:meth:`handle`), one at a time; until that returns, the map, ``pending``, ``expected``
    and ``block_size`` are the worker's alone, and the loop's flush and snapshot wait for it
    (``_busy``). What the worker must send (a full ``pending``, or one cut by a change of
    block size) it leaves in ``_ready`` for the loop."""

    def __init__(
        self,
        hub: KvEventsHub,
        shard_id: str,
        sock: zmq.asyncio.Socket,
        endpoint: str,
        *,
        adopted: bool,
    ) -> None:
        self.hub = hub
        self.shard_id = shard_id
        self.socket = sock
        self.endpoint = endpoint
        # A fresh engine's first batch is seq 0; an adopted one's is wherever it is now.
        self.expected: int | None = None if adopted else 0
        self.blocks = BlockMap(hub.map_limit)
        self.pending = Pending()
        self.block_size = BLOCK_SIZE
        self.task: asyncio.Task[None] | None = None
        self.redialer: asyncio.Task[None] | None = None
        self.monitor: zmq.asyncio.Socket | None = None
        self.closed = False
        self.handled = 0
        """Messages handled (applied or refused) and settled back on the loop."""
        self._timer: asyncio.TimerHandle | None = None
        self._busy = False
        self._resync = False
        self._ready: list[pb.KvEvents] = []
        self._missing = 0
        self._bad_log = _Throttle(
            hub.clock, "bad KV cache event message from an engine; counted as lost"
        )
        self._gap_log = _Throttle(
            hub.clock,
            "KV cache event batches never reached the agent (over "
            f"{MAX_PAYLOAD} bytes, or its queue was full); counted as lost",
        )

    async def receive(self) -> None:
        while True:
            try:
                frames = await self.socket.recv_multipart()
            except zmq.ZMQError as exc:
                if self.closed:
                    return
                log.warning(
                    "cannot read the engine's KV cache events; the shard goes on without them",
                    extra=kv(shard=self.shard_id, error=str(exc)),
                )
                return
            self._busy = True
            try:
                problem = await asyncio.to_thread(self.handle, frames)
            finally:
                self._busy = False
            if not self.closed:
                self._settle(problem)
                self.handled += 1

    async def redial(self, monitor: zmq.asyncio.Socket) -> None:
        """Dial the engine again whenever its connection drops (``monitor`` reports that):
        ZeroMQ dials again by itself after a connection error, but not after a protocol
        error, which a batch over MAXMSGSIZE is, and the shard would have no events again."""
        while True:
            try:
                await monitor.recv_multipart()  # only EVENT_DISCONNECTED is watched
            except zmq.ZMQError:
                return
            if self.closed:
                return
            log.debug("dialling the engine's KV event socket again", extra=kv(shard=self.shard_id))
            with contextlib.suppress(zmq.ZMQError):  # ZeroMQ may have forgotten it already
                self.socket.disconnect(self.endpoint)
            self.socket.connect(self.endpoint)

    def handle(self, frames: Sequence[bytes]) -> str:
        """One message of the engine's publisher: checked, decoded, applied (in the worker);
        what is wrong with it, or "" when nothing is."""
        try:
            message = parse_frames(frames)
        except KvEventError as exc:
            return str(exc)
        if message.topic != self.shard_id:
            return f"topic {message.topic!r} is not this shard's"
        self._sequence(message.seq)
        try:
            batch = decode_batch(message.payload)
        except KvEventError as exc:
            return str(exc)
        self.apply(batch)
        return ""

    def _settle(self, problem: str) -> None:
        """Back on the loop after a message: log, send what the worker left, schedule."""
        if problem:
            self.pending.lost += 1
            self._bad_log(self.shard_id, 1, problem=problem)
        if self._missing:
            self._gap_log(self.shard_id, self._missing)
            self._missing = 0
        ready, self._ready = self._ready, []
        self._send(ready)
        if self._resync:
            self._resync = False
            self.snapshot()
        elif self.pending:
            self._schedule()

    def _sequence(self, seq: int) -> None:
        expected = self.expected
        if expected is not None and seq > expected:
            self.pending.lost += seq - expected  # batches the socket never got
            self._missing += seq - expected
        elif expected is not None and seq < expected:
            # Numbered from 0 again: a new publisher (the engine restarted), an empty cache.
            log.info(
                "the engine's KV event sequence began again; its cache is empty",
                extra=kv(shard=self.shard_id, seq=seq, expected=expected),
            )
            self.blocks.clear()
            self.pending.clear()
        self.expected = seq + 1

    def apply(self, batch: EventBatch) -> None:
        ignored = self.blocks.ignored
        for event in batch.events:
            if isinstance(event, BlockStored) and event.block_size != self.block_size:
                if 1 <= event.block_size <= MAX_BLOCK_SIZE:
                    if self.pending.keys:
                        self._cut()  # one block size a message
                    self.block_size = event.block_size
            self.blocks.apply(event, self.pending)
            if self.pending.keys >= FLUSH_AT:
                self._cut()
        if self.blocks.ignored != ignored:
            log.debug(
                "ignored KV events of another medium or of a LoRA adapter",
                extra=kv(shard=self.shard_id, blocks=self.blocks.ignored - ignored),
            )

    def _cut(self) -> None:
        """What is pending made into messages now, for the loop to send."""
        self._ready += self.pending.take(self.shard_id, self.block_size)

    def _schedule(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_EVERY, self.flush)

    def _send(self, messages: list[pb.KvEvents]) -> bool:
        for at, msg in enumerate(messages):
            if not self.hub.send(pb.AgentMessage(kv_events=msg)):
                # No stream: the next one's snapshot covers the changes, not what was lost.
                self.pending.lost += sum(m.lost for m in messages[at:])
                return False
        return True

    def flush(self) -> None:
        """Send what is pending (dropped when no stream is up: the next one resyncs)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._busy:
            return  # the worker has it; the loop flushes once it is back
        self._send(self.pending.take(self.shard_id, self.block_size))

    def snapshot(self) -> None:
        """The shard's whole set: cleared first, then every key it holds (once the worker is
        back, when it is busy with a message)."""
        if self._busy:
            self._resync = True
            return
        lost = self.pending.lost
        self.pending = Pending()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        head = pb.KvEvents(
            shard_id=self.shard_id, block_size=self.block_size, cleared=True, lost=lost
        )
        if not self.hub.send(pb.AgentMessage(kv_events=head)):
            return
        held = self.blocks.held()
        for at in range(0, len(held), SNAPSHOT_CHUNK):
            chunk = pb.KvEvents(
                shard_id=self.shard_id,
                block_size=self.block_size,
                stored=held[at : at + SNAPSHOT_CHUNK],
            )
            if not self.hub.send(pb.AgentMessage(kv_events=chunk)):
                return

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in (self.task, self.redialer):
            if task is not None:
                task.cancel()
        self.socket.disable_monitor()
        if self.monitor is not None:
            self.monitor.close(linger=0)
        self.socket.close(linger=0)


class KvEventsHub:
    """This agent's subscriptions to its engines' KV cache events, one per kv-events shard;
    ``send`` is the stream client's (False when no stream is up), ``state_dir`` holds the
    engines' sockets (:mod:`llmgw.agent.kvsockets`), ``runtime`` is the name of the shard
    runtime (a docker container cannot reach them)."""

    def __init__(
        self,
        send: Callable[[pb.AgentMessage], bool],
        *,
        state_dir: Path,
        runtime: str = "process",
        map_limit: int = MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.send = send
        self.state_dir = state_dir
        self.runtime = runtime
        self.map_limit = map_limit
        self.clock = clock
        self.feeds: dict[str, _Feed] = {}
        self._context: zmq.asyncio.Context | None = None
        self._warned: set[str] = set()
        try:
            check_state_dir(state_dir)
        except ShardError as exc:  # said once at start; each kv-events shard refuses with it
            log.warning("kv-events shards cannot start here", extra=kv(error=exc.message))

    def open(self, shard_id: str, *, nodes: int = 1, rank: int = 0) -> str:
        """Make the shard's private socket directory and dial the socket its engine will
        bind there; the endpoint to hand the engine, or "" when the shard runs without events
        (a worker, a docker container). ShardError (nothing opened) when the directory cannot
        be made private."""
        self.close(shard_id)  # a restart: the old engine's blocks are gone
        if not self._publishes(shard_id, nodes, rank):
            return ""
        endpoint = prepare_socket_dir(self.state_dir, shard_id)
        self._subscribe(shard_id, endpoint, adopted=False)
        return endpoint

    def adopt(
        self, shard_id: str, endpoint: str, *, nodes: int = 1, rank: int = 0, ready: bool = False
    ) -> str:
        """Dial again the socket of an engine a previous agent started (``ready``: it had
        been seen ready, so its publisher is up); the endpoint, or "" for a shard without
        events. ShardError when it cannot be, as private as it was made: the shard must be
        restarted (:func:`~llmgw.agent.kvsockets.check_socket_dir` says why)."""
        self.close(shard_id)
        if not self._publishes(shard_id, nodes, rank):
            return ""
        check_socket_dir(self.state_dir, shard_id, endpoint, bound=ready)
        self._subscribe(shard_id, endpoint, adopted=True)
        return endpoint

    def _publishes(self, shard_id: str, nodes: int, rank: int) -> bool:
        """Whether the shard's engine publishes to this agent: not a worker (rank 0 owns the
        prefix cache), not a container (see the module's docstring)."""
        if nodes > 1 and rank > 0:
            return False
        if self.runtime == "docker":
            if shard_id not in self._warned:
                self._warned.add(shard_id)
                log.warning(
                    "a docker container cannot reach the agent's private socket directory; "
                    "the shard runs without KV cache events (cache-aware routing falls back "
                    "to load)",
                    extra=kv(shard=shard_id, runtime=self.runtime),
                )
            return False
        return True

    def _subscribe(self, shard_id: str, endpoint: str, *, adopted: bool) -> None:
        if self._context is None:
            self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # the topic is checked per message
        # Few and bounded messages held for the agent: ZeroMQ drops a message over the
        # largest batch read before the agent holds it (the engine's connection is dropped
        # and dialled again; the gap in its sequence counts the batch lost), and the engine
        # drops what would go over the high-water mark (a gap too).
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD)
        sock.setsockopt(zmq.LINGER, 0)
        # The engine binds only once it is up: dial often, so that its first batch (sent
        # when the first request is cached) finds the subscription there.
        sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        monitor.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        feed = _Feed(self, shard_id, sock, endpoint, adopted=adopted)
        feed.task = asyncio.create_task(feed.receive(), name=f"kv-events-{shard_id}")
        feed.monitor = monitor
        feed.redialer = asyncio.create_task(
            feed.redial(monitor), name=f"kv-events-redial-{shard_id}"
        )
        self.feeds[shard_id] = feed
        log.info(
            "subscribed to the engine's KV cache events",
            extra=kv(shard=shard_id, endpoint=endpoint),
        )

    def close(self, shard_id: str) -> None:
        """The shard stopped, failed or restarts: its socket closed, its directory removed,
        ``cleared`` sent once, its map forgotten. Nothing for a shard without a subscription."""
        feed = self.feeds.pop(shard_id, None)
        if feed is None:
            return
        feed.close()
        remove_socket_dir(self.state_dir, shard_id)
        self.send(
            pb.AgentMessage(
                kv_events=pb.KvEvents(shard_id=shard_id, block_size=feed.block_size, cleared=True)
            )
        )

    def prune(self) -> None:
        """Remove the socket directories of shards this agent does not subscribe to (their
        engines ended while no agent ran); call it once the shards are adopted."""
        for gone in prune_socket_dirs(self.state_dir, self.feeds):
            log.info(
                "removed the KV event socket directory of a shard gone", extra=kv(path=str(gone))
            )

    def resync(self) -> None:
        """A new stream: every shard's whole set (call it after the Hello)."""
        for feed in list(self.feeds.values()):
            feed.snapshot()

    async def aclose(self) -> None:
        """The agent stops: every socket closed (the engines run on, their directories
        stay for the next agent; nothing is sent)."""
        feeds = list(self.feeds.values())
        self.feeds.clear()
        for feed in feeds:
            feed.close()
        for feed in feeds:
            for task in (feed.task, feed.redialer):
                if task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if self._context is not None:
            self._context.term()
            self._context = None
