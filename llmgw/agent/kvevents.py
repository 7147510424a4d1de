"""The KV cache events of this node's engines, re-keyed by llmgw's block keys and forwarded
to the control plane as ``KvEvents`` batches, for the gateway's cache-aware routing.

A shard whose order says ``kv_events`` (a profile with ``routing: kv-events``) gets, before
its engine starts, a ZeroMQ SUB socket of its own bound on ``tcp://127.0.0.1`` at a free port
(:meth:`KvEventsHub.open`); the engine is given ``--kv-events-config`` naming that endpoint
and the shard id as topic (:func:`engine_config`). vLLM's publisher connects to an endpoint
without a wildcard (:func:`llmgw.engines.kvevents.publisher_binds`), so the engine dials the
agent and nothing listens beyond loopback. The port is recorded with the shard
(``shards.json``): an agent that adopts the running engine binds it again, and ZeroMQ's PUB
reconnects by itself; when it cannot, the shard runs on without events (logged). Only
rank 0 of a replica publishes (its scheduler owns the prefix cache).

**Docker.** A container on the bridge network cannot reach the host's loopback, so a
single-node shard of the docker runtime runs without events (one warning per shard); the
shards of multi-node replicas run in the host's network namespace
(:mod:`llmgw.agent.runtimes.containers`), where 127.0.0.1 is the host's, and get them.

**Re-keying.** vLLM keys a block by SHA-256 under a per-process random seed, so the gateway
cannot compute the engine's hashes; but ``BlockStored`` carries the token ids, so each stored
block is keyed :func:`llmgw.contracts.kvblocks.chain` (its parent's key, its tokens), the
parent found by the event's ``parent_block_hash`` in the shard's map engine hash -> key
(:class:`BlockMap`; no parent: ``ROOT``), which also translates ``BlockRemoved``. A block
whose parent the map does not hold cannot be keyed and is counted in ``lost``, as are the
batches a gap in the engine's sequence numbers skipped, bad messages (logged at most once a
minute per shard) and the blocks forgotten when the map is full (:data:`MAX_BLOCKS`, the
oldest first; the index is told they are gone). Events of another medium than the GPU's
(vLLM's CPU offload, ``medium`` "CPU"), and of a LoRA adapter's blocks (llmgw keys a prompt
without one), are ignored. ``AllBlocksCleared`` empties the map and sends ``cleared``.

**Batching.** Changes are coalesced per shard (a block stored then removed within one batch
cancels out) and sent every :data:`FLUSH_EVERY` seconds, or at once at :data:`FLUSH_AT`
pending keys, as one ``AgentMessage(kv_events=...)`` through the stream client's send. While
no stream is up they are dropped: each new stream gets every shard's whole set after its
Hello (:meth:`KvEventsHub.resync`: ``cleared`` first, then the keys, at most
:data:`SNAPSHOT_CHUNK` a message). A shard that stops, fails or restarts has its socket
closed, ``cleared`` sent once, and its map forgotten (:meth:`KvEventsHub.close`).

**Size.** A block costs 8 bytes (a packed ``fixed64``) instead of the engine's 32-byte hash
and 16 token ids (about 100 bytes a block in vLLM's msgpack, 79 after zlib): a twelfth.
General compression would add nothing on top: zlib (levels 1 to 9) makes a message of
16,384 packed random keys 0.04 % larger, not smaller (tests/unit/agent/test_kvevents.py
measures both), as random 64-bit keys do not compress.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq
import zmq.asyncio

from llmgw.contracts.kvblocks import BLOCK_SIZE, MAX_BLOCK_SIZE, ROOT, chain
from llmgw.engines.kvevents import (
    MAX_PAYLOAD,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    decode_batch,
    events_config,
    parse_frames,
)
from llmgw.errors import KvEventError
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = [
    "FLUSH_AT",
    "FLUSH_EVERY",
    "MAX_BLOCKS",
    "SNAPSHOT_CHUNK",
    "BlockMap",
    "KvEventsHub",
    "Pending",
    "engine_config",
    "reaches_loopback",
]

log = logging.getLogger("llmgw.agent.kvevents")

LOOPBACK = "127.0.0.1"
FLUSH_EVERY = 0.05
"""Seconds a change waits for others before it is sent."""
FLUSH_AT = 8192
"""Pending keys (stored and removed) that are sent at once."""
SNAPSHOT_CHUNK = 16384
"""Keys in one message of a shard's whole set (the control plane takes up to 65,536)."""
MAX_BLOCKS = 4 * 1024 * 1024
"""Blocks a shard's map holds; a full GPU cache is far fewer (80 GiB of 16-token blocks of
an 8B model: about 40,000)."""
BAD_LOG_EVERY = 60.0
"""Seconds between two log lines about one shard's bad messages."""
_RCVHWM = 10_000  # batches queued in the socket (an engine step's events are one batch)
_APPLIED_MEDIA = (None, "GPU")


def engine_config(shard_id: str, port: int) -> str:
    """The ``--kv-events-config`` that makes a shard's engine publish to the agent's socket
    on loopback ``port`` under its shard id; "" (none) when ``port`` is 0."""
    return events_config(f"tcp://{LOOPBACK}:{port}", shard_id) if port else ""


def reaches_loopback(runtime: str, nodes: int) -> bool:
    """Whether an engine run by ``runtime`` can dial the agent's 127.0.0.1: not from a
    container on docker's bridge network (a single-node shard of the docker runtime)."""
    return runtime != "docker" or nodes > 1


class Pending:
    """One shard's changes not sent yet, coalesced: a key stored then removed (or removed
    then stored) before they are sent is no change at all."""

    def __init__(self) -> None:
        self.cleared = False
        self.stored: dict[int, None] = {}
        self.removed: dict[int, None] = {}
        self.lost = 0

    def _reset(self) -> None:
        self.cleared, self.stored, self.removed, self.lost = False, {}, {}, 0

    @property
    def keys(self) -> int:
        return len(self.stored) + len(self.removed)

    def __bool__(self) -> bool:
        return self.cleared or bool(self.stored) or bool(self.removed) or self.lost > 0

    def store(self, key: int) -> None:
        if key in self.removed:
            del self.removed[key]  # the index has it still
        else:
            self.stored[key] = None

    def remove(self, key: int) -> None:
        if key in self.stored:
            del self.stored[key]  # the index never had it
        else:
            self.removed[key] = None

    def clear(self) -> None:
        """Every block gone: what was pending goes with them."""
        self.cleared = True
        self.stored.clear()
        self.removed.clear()

    def take(self, shard_id: str, block_size: int) -> list[pb.KvEvents]:
        """The messages of what is pending (none when nothing is), at most
        :data:`SNAPSHOT_CHUNK` keys each; pending is empty after."""
        if not self:
            return []
        keys = [(k, True) for k in self.stored] + [(k, False) for k in self.removed]
        out: list[pb.KvEvents] = []
        for at in range(0, max(len(keys), 1), SNAPSHOT_CHUNK):
            chunk = keys[at : at + SNAPSHOT_CHUNK]
            out.append(
                pb.KvEvents(
                    shard_id=shard_id,
                    block_size=block_size,
                    cleared=self.cleared and at == 0,
                    stored=[k for k, stored in chunk if stored],
                    removed=[k for k, stored in chunk if not stored],
                    lost=self.lost if at == 0 else 0,
                )
            )
        self._reset()
        return out


class BlockMap:
    """One shard's blocks: the engine's hash of each -> its llmgw key (oldest first, at most
    ``limit``), and how many engine blocks hold each key (two engine blocks may share one:
    vLLM's hash covers extra keys that llmgw's does not)."""

    def __init__(self, limit: int = MAX_BLOCKS) -> None:
        self.limit = limit
        self.keys: OrderedDict[BlockHash, int] = OrderedDict()
        self.refs: dict[int, int] = {}
        self.forgotten = 0
        self.ignored = 0

    def __len__(self) -> int:
        return len(self.keys)

    def held(self) -> list[int]:
        """Every key the shard holds now."""
        return list(self.refs)

    def clear(self) -> None:
        self.keys.clear()
        self.refs.clear()

    def apply(self, event: Event, pending: Pending) -> None:
        """Apply one engine event to the map, its changes to ``pending``."""
        if isinstance(event, AllBlocksCleared):
            self.clear()
            pending.clear()
        elif isinstance(event, BlockRemoved):
            if event.medium not in _APPLIED_MEDIA:
                self.ignored += len(event.block_hashes)
                return
            for block in event.block_hashes:
                key = self.keys.pop(block, None)
                if key is not None:
                    self._unref(key, pending)
        else:
            self._stored(event, pending)

    def _stored(self, event: BlockStored, pending: Pending) -> None:
        if event.medium not in _APPLIED_MEDIA or event.lora_id is not None:
            self.ignored += len(event.block_hashes)
            return
        size = event.block_size
        if event.parent_block_hash is None:
            parent: int | None = ROOT
        else:
            parent = self.keys.get(event.parent_block_hash)
        if parent is None or not 1 <= size <= MAX_BLOCK_SIZE:
            pending.lost += len(event.block_hashes)
            return
        for i, block in enumerate(event.block_hashes):
            known = self.keys.get(block)
            if known is not None:  # stored again: the same block
                self.keys.move_to_end(block)
                parent = known
                continue
            try:
                parent = chain(parent, event.token_ids[i * size : (i + 1) * size])
            except ValueError:  # a token id outside 0..2**32-1
                pending.lost += len(event.block_hashes) - i
                return
            self.keys[block] = parent
            count = self.refs.get(parent, 0) + 1
            self.refs[parent] = count
            if count == 1:
                pending.store(parent)
        while len(self.keys) > self.limit:
            _, old = self.keys.popitem(last=False)
            self._unref(old, pending)
            self.forgotten += 1
            pending.lost += 1

    def _unref(self, key: int, pending: Pending) -> None:
        count = self.refs[key] - 1
        if count:
            self.refs[key] = count
        else:
            del self.refs[key]
            pending.remove(key)


class _Feed:
    """One shard's subscription: its socket, the sequence it expects next, its map and
    what is pending."""

    def __init__(
        self,
        hub: KvEventsHub,
        shard_id: str,
        sock: zmq.asyncio.Socket,
        port: int,
        *,
        adopted: bool,
    ) -> None:
        self.hub = hub
        self.shard_id = shard_id
        self.socket = sock
        self.port = port
        # A fresh engine's first batch is seq 0; an adopted one's is wherever it is now.
        self.expected: int | None = None if adopted else 0
        self.blocks = BlockMap(hub.map_limit)
        self.pending = Pending()
        self.block_size = BLOCK_SIZE
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._bad_logged_at = float("-inf")
        self._bad_unlogged = 0

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
            self.handle(frames)

    def handle(self, frames: Sequence[bytes]) -> None:
        """One message of the engine's publisher: checked, applied, maybe flushed."""
        try:
            message = parse_frames(frames)
        except KvEventError as exc:
            self._bad(str(exc))
            return
        if message.topic != self.shard_id:
            self._bad(f"topic {message.topic!r} is not this shard's")
            return
        self._sequence(message.seq)
        try:
            batch = decode_batch(message.payload)
        except KvEventError as exc:
            self._bad(str(exc))
            return
        self.apply(batch)

    def _sequence(self, seq: int) -> None:
        expected = self.expected
        if expected is not None and seq > expected:
            self.pending.lost += seq - expected  # batches the socket never got
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
                        self.flush()  # one block size a message
                    self.block_size = event.block_size
            self.blocks.apply(event, self.pending)
            if self.pending.keys >= FLUSH_AT:
                self.flush()
        if self.blocks.ignored != ignored:
            log.debug(
                "ignored KV events of another medium or of a LoRA adapter",
                extra=kv(shard=self.shard_id, blocks=self.blocks.ignored - ignored),
            )
        if self.pending:
            self._schedule()

    def _bad(self, problem: str) -> None:
        self.pending.lost += 1
        self._bad_unlogged += 1
        now = self.hub.clock()
        if now - self._bad_logged_at >= BAD_LOG_EVERY:
            log.warning(
                "bad KV cache event message from an engine; counted as lost",
                extra=kv(
                    shard=self.shard_id,
                    problem=problem,
                    bad=self._bad_unlogged,
                    every=f"{BAD_LOG_EVERY:g}s",
                ),
            )
            self._bad_logged_at, self._bad_unlogged = now, 0
        self._schedule()

    def _schedule(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_EVERY, self.flush)

    def flush(self) -> None:
        """Send what is pending (dropped when no stream is up: the next one resyncs)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for msg in self.pending.take(self.shard_id, self.block_size):
            if not self.hub.send(pb.AgentMessage(kv_events=msg)):
                # No stream: the next one's snapshot covers the changes, not what was lost.
                self.pending.lost += msg.lost
                return

    def snapshot(self) -> None:
        """The shard's whole set: cleared first, then every key it holds."""
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
        if self.task is not None:
            self.task.cancel()
        self.socket.close(linger=0)


class KvEventsHub:
    """This agent's subscriptions to its engines' KV cache events, one per kv-events shard;
    ``send`` is the stream client's (False when no stream is up), ``runtime`` the name of
    the shard runtime (docker's bridge network cannot reach loopback)."""

    def __init__(
        self,
        send: Callable[[pb.AgentMessage], bool],
        *,
        runtime: str = "process",
        map_limit: int = MAX_BLOCKS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.send = send
        self.runtime = runtime
        self.map_limit = map_limit
        self.clock = clock
        self.feeds: dict[str, _Feed] = {}
        self._context: zmq.asyncio.Context | None = None
        self._warned: set[str] = set()

    def open(self, shard_id: str, *, nodes: int = 1, rank: int = 0, port: int = 0) -> int:
        """Bind the shard's socket (on ``port``: an adopted shard's; 0: a free one) and
        start reading it; the port bound, or 0 when the shard runs without events (a
        worker, a container on the bridge network, a port that cannot be bound again)."""
        self.close(shard_id)  # a restart: the old engine's blocks are gone
        if nodes > 1 and rank > 0:
            return 0
        if not reaches_loopback(self.runtime, nodes):
            if shard_id not in self._warned:
                self._warned.add(shard_id)
                log.warning(
                    "a container on docker's bridge network cannot reach the agent's "
                    "loopback; the shard runs without KV cache events (cache-aware routing "
                    "falls back to load)",
                    extra=kv(shard=shard_id, runtime=self.runtime),
                )
            return 0
        if self._context is None:
            self._context = zmq.asyncio.Context()
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")  # the topic is checked per message
        sock.setsockopt(zmq.RCVHWM, _RCVHWM)
        # A peer sending a message over the largest batch read is disconnected by ZeroMQ
        # before the agent holds it (any local process may connect to a loopback port).
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                sock.bind(f"tcp://{LOOPBACK}:{port}")
                bound = port
            else:
                bound = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            log.warning(
                "cannot bind the socket for the engine's KV cache events; the shard runs "
                "without them",
                extra=kv(shard=shard_id, port=port, error=str(exc)),
            )
            return 0
        feed = _Feed(self, shard_id, sock, bound, adopted=bool(port))
        feed.task = asyncio.create_task(feed.receive(), name=f"kv-events-{shard_id}")
        self.feeds[shard_id] = feed
        log.info("subscribed to the engine's KV cache events", extra=kv(shard=shard_id, port=bound))
        return bound

    def close(self, shard_id: str) -> None:
        """The shard stopped, failed or restarts: its socket closed, ``cleared`` sent once,
        its map forgotten. Nothing for a shard without a subscription."""
        feed = self.feeds.pop(shard_id, None)
        if feed is None:
            return
        feed.close()
        self.send(
            pb.AgentMessage(
                kv_events=pb.KvEvents(shard_id=shard_id, block_size=feed.block_size, cleared=True)
            )
        )

    def resync(self) -> None:
        """A new stream: every shard's whole set (call it after the Hello)."""
        for feed in list(self.feeds.values()):
            feed.snapshot()

    async def aclose(self) -> None:
        """The agent stops: every socket closed (the engines run on; nothing is sent)."""
        feeds = list(self.feeds.values())
        self.feeds.clear()
        for feed in feeds:
            feed.close()
        for feed in feeds:
            if feed.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await feed.task
        if self._context is not None:
            self._context.term()
            self._context = None
