"""What a node may send on its Connect stream, and how much of it.

Every node holds a certificate from the cluster CA, approved or not, so what arrives on the
stream is bounded here before any of it reaches the store:

- **Transport.** The gRPC server refuses any message over :data:`MAX_MESSAGE_BYTES`; gRPC
  ends that stream with ``RESOURCE_EXHAUSTED`` and the agent reconnects.
- **Per kind.** A message over its kind's limit (:data:`KIND_LIMITS`) is dropped. Free text
  that ends up in the store or in events (a shard's reason, an operation's error, an
  update's message) is cut to :data:`MAX_TEXT` characters.
- **Per node.** Token buckets, kept across the node's reconnections: streams opened (each
  Hello carries an inventory: :data:`HELLO_RATE`; one too many is refused with
  ``RESOURCE_EXHAUSTED`` and the agent backs off), inventories (:data:`INVENTORY_RATE`),
  certificate requests
  (a burst of :data:`RENEWAL_BURST`, then one per minute, or per quarter of the certificate
  lifetime when that is shorter), everything else (:data:`MESSAGE_RATE`). What a bucket cannot pay
  for is dropped, with one log line per node per :data:`LOG_EVERY` seconds counting drops.
- **Refused streams** (a revoked certificate, a node id that is not the certificate's) are
  recorded as an event and a log line at :data:`REFUSAL_RATE` per certificate name.
- **Gross abuse.** A node that has more than :data:`ABUSE_DROPS` messages dropped within
  :data:`ABUSE_WINDOW` seconds has its stream closed with ``RESOURCE_EXHAUSTED``.
- **KV cache events** (:func:`kv_events_problem`): from approved nodes only, at most
  :data:`MAX_KV_KEYS` keys stored and removed together, a block size in
  1..:data:`~llmgw.contracts.kvblocks.MAX_BLOCK_SIZE`, a shard id of 1..:data:`MAX_SHARD_ID`
  characters; their own bucket (:data:`KV_EVENTS_RATE`: every kv-events shard sends a batch
  each 50 ms, and a new stream the whole set).
- **Heartbeats** carry each GPU's utilisation; what the session keeps of it (in memory only,
  never stored) is bounded by :func:`heartbeat_utilization`.
- **Pending nodes** (never approved) may send only what approval needs: heartbeats, the
  inventory (kept in memory and summarised, stored only once the node is approved), the
  drain notice, and certificate requests (answered with a refusal). Shard statuses,
  operation results and update statuses of a pending node are dropped: it has no orders.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw.contracts.inventory import MAX_GPU_UUID, MAX_HEARTBEAT_GPUS
from llmgw.contracts.kvblocks import MAX_BLOCK_SIZE
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = [
    "ABUSE_DROPS",
    "HELLO_RATE",
    "KIND_LIMITS",
    "KV_EVENTS_RATE",
    "MAX_HELLO_BYTES",
    "MAX_KV_KEYS",
    "MAX_MESSAGE_BYTES",
    "MAX_PENDING_INVENTORY_BYTES",
    "MAX_SHARD_ID",
    "MAX_TEXT",
    "Intake",
    "TokenBucket",
    "heartbeat_utilization",
    "hello_problem",
    "kv_events_problem",
    "pending_inventory",
    "trim_hello",
]

log = logging.getLogger("llmgw.server.intake")

MAX_MESSAGE_BYTES = 1024 * 1024
"""The gRPC server's max receive message size on :7443."""
MAX_HELLO_BYTES = MAX_MESSAGE_BYTES
MAX_INVENTORY_BYTES = 512 * 1024
"""A real node's inventory (8 GPUs, 8 adapters with their GIDs) is well under 100 KiB."""
MAX_PENDING_INVENTORY_BYTES = 16 * 1024
"""What is stored of a pending node's inventory: enough to judge it before approving."""
MAX_TEXT = 2000
"""Characters of free text (reasons, errors) kept from one message."""
MAX_KV_KEYS = 65536
"""Block keys (stored and removed together) one KvEvents may carry; the agent sends at most
16384 a message."""
MAX_SHARD_ID = 128
"""Characters of a shard id (the scheduler's are ``<replica id>-s<rank>``)."""

KIND_LIMITS: dict[str, int] = {
    "hello": MAX_HELLO_BYTES,
    "inventory": MAX_INVENTORY_BYTES,
    "shard_status": 64 * 1024,
    "op_result": 64 * 1024,
    "update_status": 64 * 1024,
    "cert_request": 16 * 1024,
    # With the GPUs' utilisation by uuid: MAX_HEARTBEAT_GPUS of at most 70 bytes (a uuid of
    # MAX_GPU_UUID characters) is under 4.5 KiB.
    "heartbeat": 8192,
    "draining": 1024,
    # MAX_KV_KEYS fixed64 keys (8 bytes each, packed) and the few other fields.
    "kv_events": MAX_KV_KEYS * 8 + 1024,
}
"""Serialized bytes one message of each kind may have."""

PENDING_KINDS = frozenset({"heartbeat", "inventory", "draining", "cert_request"})
"""What a node that is not approved may send."""

# (burst, refill per second)
MESSAGE_RATE = (256.0, 32.0)
# An operator restarting an agent by hand, or systemd restarting a crashing one (RestartSec=5),
# stays inside this; an agent reconnecting in a tight loop does not.
HELLO_RATE = (20.0, 0.5)
REFUSAL_RATE = (5.0, 1.0 / 30.0)
INVENTORY_RATE = (4.0, 0.2)
# A node of 8 kv-events shards sends 160 batches a second at most (one each 50 ms), and on a
# new stream each shard's whole set (a full cache of 4M blocks in 256 messages).
KV_EVENTS_RATE = (2048.0, 256.0)
RENEWAL_BURST = 3.0
LOG_EVERY = 30.0
ABUSE_WINDOW = 10.0
ABUSE_DROPS = 2000

# Hello fields that end up in the store and events.
MAX_VERSION = 64
MAX_ADDR = 300
MAX_HELLO_SHARDS = 1024


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; :meth:`take` pays one."""

    def __init__(
        self, capacity: float, rate: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self.rate = rate
        self._clock = clock
        self._tokens = capacity
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


def hello_problem(hello: pb.Hello) -> str | None:
    """Why this Hello cannot open a stream (fields that would be stored unbounded), or None."""
    if hello.ByteSize() > MAX_HELLO_BYTES:
        return (
            f"the Hello is {hello.ByteSize()} bytes, over the limit of {MAX_HELLO_BYTES}; "
            "upgrade the agent to match the control plane"
        )
    if len(hello.agent_version) > MAX_VERSION:
        return f"the agent version is over {MAX_VERSION} characters; upgrade the agent"
    if len(hello.dataplane_addr) > MAX_ADDR:
        return (
            f"the data-plane address is over {MAX_ADDR} characters; set 'advertise' in "
            "agent.yaml to this node's host:port"
        )
    if len(hello.shards) > MAX_HELLO_SHARDS:
        return (
            f"the Hello lists {len(hello.shards)} shards, over the limit of "
            f"{MAX_HELLO_SHARDS}; stop the engines the node should not run and restart the agent"
        )
    return None


def kv_events_problem(events: pb.KvEvents) -> str | None:
    """Why a node's KvEvents is refused (over its bounds), or None."""
    if not events.shard_id:
        return "no shard id"
    if len(events.shard_id) > MAX_SHARD_ID:
        return f"shard id over {MAX_SHARD_ID} characters"
    if not 1 <= events.block_size <= MAX_BLOCK_SIZE:
        return f"block size {events.block_size} not in 1..{MAX_BLOCK_SIZE}"
    keys = len(events.stored) + len(events.removed)
    if keys > MAX_KV_KEYS:
        return f"{keys} keys, over {MAX_KV_KEYS}"
    return None


def trim_hello(hello: pb.Hello) -> None:
    """Cut the free text of the shards a Hello reports, as :meth:`Intake.admit` does for
    shard statuses."""
    for status in hello.shards:
        status.reason = _cut(status.reason, MAX_TEXT)


def heartbeat_utilization(heartbeat: pb.Heartbeat) -> dict[str, int | None]:
    """What a node's session keeps of a heartbeat's GPU utilisation: uuid -> percent (None:
    the GPU cannot tell), for the first :data:`MAX_HEARTBEAT_GPUS` GPUs; an entry whose uuid is
    empty or over :data:`MAX_GPU_UUID` characters is no GPU of the inventory's and is left
    out, a percent over 100 is unknown."""
    kept: dict[str, int | None] = {}
    for sample in heartbeat.gpu_utilization[:MAX_HEARTBEAT_GPUS]:
        if not sample.uuid or len(sample.uuid) > MAX_GPU_UUID:
            continue
        known = sample.HasField("percent") and sample.percent <= 100
        kept[sample.uuid] = sample.percent if known else None
    return kept


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def pending_inventory(inv: pb.Inventory) -> pb.Inventory:
    """What is stored of a pending node's inventory: the facts an operator compares before
    approving (host name, architecture, CPUs, memory, GPUs, engines, fabrics), each bounded,
    at most :data:`MAX_PENDING_INVENTORY_BYTES` in all."""
    out = pb.Inventory(
        hostname=_cut(inv.hostname, 253),
        arch=_cut(inv.arch, 32),
        cpus=inv.cpus,
        memory_total_bytes=inv.memory_total_bytes,
        memory_available_bytes=inv.memory_available_bytes,
        gpu_status=_cut(inv.gpu_status, 256),
        driver_version=_cut(inv.driver_version, 64),
        gpu_source=_cut(inv.gpu_source, 32),
        disk_total_bytes=inv.disk_total_bytes,
        disk_free_bytes=inv.disk_free_bytes,
    )
    for gpu in inv.gpus[:16]:
        out.gpus.add(
            index=gpu.index,
            uuid=_cut(gpu.uuid, 64),
            name=_cut(gpu.name, 64),
            memory_total_mib=gpu.memory_total_mib,
            memory_used_mib=gpu.memory_used_mib,
        )
    out.engines.extend(_cut(e, 32) for e in inv.engines[:8])
    for fabric in inv.fabrics[:8]:
        out.fabrics.add(
            name=_cut(fabric.name, 64),
            hcas=[_cut(h, 32) for h in fabric.hcas[:16]],
            healthy=fabric.healthy,
        )
    out.warnings.extend(_cut(w, 256) for w in inv.warnings[:8])
    if out.ByteSize() > MAX_PENDING_INVENTORY_BYTES:  # cannot happen with the cuts above
        del out.gpus[:], out.fabrics[:], out.warnings[:]
    return out


@dataclass
class Intake:
    """One node's allowance on its stream. :meth:`admit` says whether a message may be
    handled (and trims its free text); :attr:`abuse` is set when the stream must close."""

    node_id: str
    # Seconds between two certificate requests once the burst is spent.
    renewal_interval: float = 60.0
    clock: Callable[[], float] = time.monotonic
    dropped: int = 0
    abuse: str | None = None
    _buckets: dict[str, TokenBucket] = field(default_factory=dict)
    _unlogged: dict[str, int] = field(default_factory=dict)
    _logged_at: float = float("-inf")
    _window_start: float = float("-inf")
    _window_drops: int = 0

    def __post_init__(self) -> None:
        for name, (burst, rate) in (
            ("hello", HELLO_RATE),
            ("refusal", REFUSAL_RATE),
            ("message", MESSAGE_RATE),
            ("inventory", INVENTORY_RATE),
            ("kv_events", KV_EVENTS_RATE),
            ("renewal", (RENEWAL_BURST, 1.0 / max(self.renewal_interval, 0.001))),
        ):
            self._buckets[name] = TokenBucket(burst, rate, clock=self.clock)

    def admit_stream(self) -> str | None:
        """A new stream of this node: None when it may open (a fresh abuse window starts; the
        buckets carry over), else why not (logged with the drops, rate-limited)."""
        if self._buckets["hello"].take():
            self.abuse = None
            self._window_start, self._window_drops = float("-inf"), 0
            return None
        self._count("hello (reconnecting too often)")
        burst, rate = HELLO_RATE
        return (
            f"node {self.node_id} opened over {burst:g} streams in a row (then one per "
            f"{1 / rate:g} s is allowed); the agent retries by itself, check why it reconnects "
            "so often (its log)"
        )

    def record_refusal(self) -> bool:
        """Whether a refused stream of this certificate's holder is worth an event and a log
        line (:data:`REFUSAL_RATE`); the others are only counted, so that a node retrying with
        a revoked certificate cannot flush the event log."""
        if self._buckets["refusal"].take():
            return True
        self._count("hello (refused)")
        return False

    def admit(self, msg: pb.AgentMessage, *, approved: bool) -> bool:
        kind = msg.WhichOneof("msg") or "empty"
        if not approved and kind not in PENDING_KINDS:
            return self._drop(kind, "not approved")
        limit = KIND_LIMITS.get(kind)
        if limit is None or kind == "hello":
            return self._drop(kind, "not expected here")
        if msg.ByteSize() > limit:
            return self._drop(kind, f"over {limit} bytes")
        if kind == "kv_events":
            problem = kv_events_problem(msg.kv_events)
            if problem is not None:
                return self._drop(kind, problem)
        bucket = {"inventory": "inventory", "cert_request": "renewal", "kv_events": "kv_events"}
        if not self._buckets[bucket.get(kind, "message")].take():
            return self._drop(kind, "rate limit")
        _trim_text(msg)
        return True

    def _drop(self, kind: str, why: str) -> bool:
        self.dropped += 1
        now = self.clock()
        if now - self._window_start > ABUSE_WINDOW:
            self._window_start, self._window_drops = now, 0
        self._window_drops += 1
        if self._window_drops > ABUSE_DROPS and self.abuse is None:
            self.abuse = (
                f"node {self.node_id} sent over {ABUSE_DROPS} messages in {ABUSE_WINDOW:g} s "
                "that were dropped (over their size or rate limits, or not allowed before "
                "approval); the stream is closed; check the agent's version and its host"
            )
        self._count(f"{kind} ({why})")
        return False

    def _count(self, key: str) -> None:
        """Count a refusal; log the counts at most once per LOG_EVERY seconds."""
        self._unlogged[key] = self._unlogged.get(key, 0) + 1
        now = self.clock()
        if now - self._logged_at >= LOG_EVERY:
            self._logged_at = now
            log.warning(
                "dropped messages from a node",
                extra=kv(
                    node=self.node_id,
                    dropped=", ".join(f"{k}: {n}" for k, n in sorted(self._unlogged.items())),
                    every=f"{LOG_EVERY:g}s",
                ),
            )
            self._unlogged.clear()


def _trim_text(msg: pb.AgentMessage) -> None:
    kind = msg.WhichOneof("msg")
    if kind == "shard_status":
        msg.shard_status.reason = _cut(msg.shard_status.reason, MAX_TEXT)
    elif kind == "op_result":
        msg.op_result.error = _cut(msg.op_result.error, MAX_TEXT)
    elif kind == "update_status":
        msg.update_status.message = _cut(msg.update_status.message, MAX_TEXT)
