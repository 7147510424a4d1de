"""Cache-aware routing: which ready replica of a model takes a request, weighing what each
already holds of the prompt's prefix against the work already queued on it.

The two prefix policies (:mod:`llmgw.server.gateway.policies` holds them all):

- ``prefix-approx``: for engines that publish nothing of their cache (llama.cpp), the
  gateway remembers which replica it sent each prefix to: the prompt text cut into chunks of
  :data:`APPROX_CHUNK` bytes, each chunk's key chained to the one before (a prefix tree kept
  flat, as the engines keep theirs), per replica an LRU of at most its capacity estimate of
  chunks, each forgotten :data:`APPROX_TTL` after its last use;
- ``kv-events``: the replicas' engines say what they hold (vLLM's KV events, forwarded by
  the agents, :class:`PrefixRouting.apply`), keyed by :mod:`llmgw.contracts.kvblocks` from
  token ids, and the gateway keys the prompt the same way (the model's tokenizer,
  :mod:`llmgw.server.gateway.tokenizing`).

The prefix policies choose the replica with the least estimated work before the request's
first token, in tokens: its own uncached prompt tokens plus the uncached tokens of the
requests sent to that replica that have not had their first token yet (:attr:`Endpoint.
pending`). A replica holding the whole prefix therefore keeps taking the conversation until
the prefill queued on it exceeds a full prefill elsewhere, and a hot prefix spreads to a
second replica instead of piling up; a replica at its max_concurrency is not a candidate at
all. Ties go to the session's replica, then the fewest in flight, then in turn.

Both indexes are one :class:`BlockIndex` per model: block key -> a bit mask of the replicas
holding it (each replica a bit), so that a lookup is one dict probe per block, whatever the
size of the index, and the leading run of every candidate is found in the same pass. The
index is bounded (:data:`MAX_INDEX_BLOCKS` keys per model; the oldest forgotten first); each
key costs about 170 bytes with its replica's set (``bench/routing.py`` measures it).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice, repeat
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from llmgw.contracts.kvblocks import BLOCK_SIZE
from llmgw.log import kv

if TYPE_CHECKING:
    from llmgw.proto import control_pb2 as pb

__all__ = [
    "APPROX_CHUNK",
    "APPROX_TTL",
    "MAX_INDEX_BLOCKS",
    "BlockIndex",
    "PrefixRouting",
    "Replica",
    "text_keys",
    "text_of",
]

log = logging.getLogger("llmgw.server.prefixes")

APPROX_CHUNK = 64
"""Bytes of prompt text per key of the approximate index (about 16 tokens)."""
APPROX_TTL = 600.0
"""Seconds after its last use that the approximate index forgets a replica's chunk."""
APPROX_CAPACITY = 16384
"""A replica's capacity estimate in chunks (about 1 MiB of prompt text) when its profile
gives no better one (llama.cpp's ``ctx_size``)."""
MAX_APPROX_TEXT = 4 * 1024 * 1024

MAX_INDEX_BLOCKS = 2_000_000
"""The most block keys one model's index keeps (about 340 MB)."""
_SWEEP_CHUNK = 20_000


class Replica(Protocol):
    """What the choice reads of a ready replica (:class:`llmgw.server.gateway.routing.Endpoint`)."""

    shard_id: str
    inflight: int
    pending: int


Endpoint = TypeVar("Endpoint", bound=Replica)


class Hint(Protocol):
    """What the prefix choice reads of a request (:class:`llmgw.server.gateway.policies.RouteHint`)
    and what it sets: the leading blocks its replica holds."""

    keys: Sequence[int]
    tokens: int
    unit: int
    matched: int


class BlockIndex:
    """Block key -> the replicas holding it, as a bit mask (one bit per replica)."""

    def __init__(self, max_blocks: int = MAX_INDEX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.blocks: dict[int, int] = {}
        self.bits: dict[str, int] = {}  # shard id -> its bit
        self.held: dict[str, set[int]] = {}  # shard id -> its keys
        self._owner: dict[int, str] = {}  # bit -> shard id
        self._retiring = 0  # bits being swept out; reused once clean
        self.live = 0
        self.evicted = 0

    def bit(self, shard_id: str) -> int:
        bit = self.bits.get(shard_id)
        if bit is None:
            taken = self.live | self._retiring
            bit = 1
            while taken & bit:
                bit <<= 1
            self.bits[shard_id] = bit
            self.held[shard_id] = set()
            self._owner[bit] = shard_id
            self.live |= bit
        return bit

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, shard_id: str, keys: Iterable[int]) -> None:
        bit = self.bit(shard_id)
        held = self.held[shard_id]
        blocks = self.blocks
        for key in keys:
            blocks[key] = blocks.get(key, 0) | bit
            held.add(key)
        if len(blocks) > self.max_blocks:
            self._evict(len(blocks) - self.max_blocks + self.max_blocks // 16)

    def discard(self, shard_id: str, keys: Iterable[int]) -> None:
        bit = self.bits.get(shard_id)
        if bit is None:
            return
        held = self.held[shard_id]
        blocks = self.blocks
        for key in keys:
            mask = blocks.get(key)
            if mask is None:
                continue
            held.discard(key)
            mask &= ~bit
            if mask:
                blocks[key] = mask
            else:
                del blocks[key]

    def drop(self, shard_id: str) -> None:
        """Forget every block of ``shard_id``: at once for lookups (its bit leaves ``live``),
        its entries swept out in chunks after, so that a big replica's loss does not stall
        the gateway."""
        bit = self.bits.pop(shard_id, None)
        if bit is None:
            return
        keys = self.held.pop(shard_id)
        self.live &= ~bit
        self._retiring |= bit
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or len(keys) <= _SWEEP_CHUNK:
            self._sweep(bit, iter(list(keys)), None)
        else:
            self._sweep(bit, iter(list(keys)), loop)

    def _sweep(self, bit: int, keys: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        blocks = self.blocks
        clear = ~bit
        for key in islice(keys, None if loop is None else _SWEEP_CHUNK):
            mask = blocks.get(key)
            if mask is None:
                continue
            mask &= clear
            if mask:
                blocks[key] = mask
            else:
                del blocks[key]
        if loop is not None and keys.__length_hint__():
            loop.call_soon(self._sweep, bit, keys, loop)
            return
        self._retiring &= ~bit
        self._owner.pop(bit, None)

    def _evict(self, count: int) -> None:
        """Forget the ``count`` oldest keys (the first stored)."""
        blocks = self.blocks
        owner = self._owner
        for key in list(islice(blocks, count)):
            mask = blocks.pop(key)
            while mask:
                low = mask & -mask
                shard = owner.get(low)
                if shard is not None and shard in self.held:
                    self.held[shard].discard(key)
                mask ^= low
        self.evicted += count

    def depths(self, keys: Sequence[int], want: int) -> dict[int, int]:
        """For each bit of ``want`` (and live), how many of ``keys`` from the first its
        replica holds in a row."""
        alive = want & self.live
        out: dict[int, int] = {}
        if not alive:
            return out
        if len(keys) > _BISECT_FROM:
            return self._bisect(keys, alive)
        if (self.live | self._retiring) < 256:
            # Eight bits or fewer in use: every mask is a byte, so the probes run in C (one
            # dict lookup a key) and each replica's run is one translate and find.
            masks = bytes(map(self.blocks.get, keys, repeat(0)))
            n = len(masks)
            while alive:
                low = alive & -alive
                at = masks.translate(_HAS[low]).find(0)
                out[low] = n if at < 0 else at
                alive ^= low
            return out
        get = self.blocks.get
        for at, key in enumerate(keys):
            mask = get(key, 0) & alive
            if mask != alive:
                gone = alive & ~mask
                while gone:
                    low = gone & -gone
                    out[low] = at
                    gone ^= low
                alive = mask
                if not alive:
                    return out
        while alive:
            low = alive & -alive
            out[low] = len(keys)
            alive ^= low
        return out

    def _bisect(self, keys: Sequence[int], alive: int) -> dict[int, int]:
        """:meth:`depths` of a long prompt in a few probes: each replica's run ends where
        its bit leaves the masks, found by bisection for all replicas at once (the replicas
        whose runs end inside a range are split at its middle). It takes a replica that holds
        a block to hold its parents too, as the engines keep them: vLLM frees a request's
        blocks tail first (its free queue's order), so the tail of a chain goes before its
        head. A replica holding a chain with a hole in it may be credited past the hole."""
        get = self.blocks.get
        out: dict[int, int] = {}
        first = get(keys[0], 0)
        gone = alive & ~first
        while gone:
            low = gone & -gone
            out[low] = 0
            gone ^= low
        alive &= first
        last = len(keys) - 1
        if alive:
            full = alive & get(keys[last], 0)
            rest = alive & ~full
            while full:
                low = full & -full
                out[low] = len(keys)
                full ^= low
            # Each range (lo, hi, bits): the bits hold keys[lo] and not keys[hi].
            ranges = [(0, last, rest)] if rest else []
            while ranges:
                lo, hi, bits = ranges.pop()
                if hi - lo == 1:
                    while bits:
                        low = bits & -bits
                        out[low] = hi
                        bits ^= low
                    continue
                mid = (lo + hi) // 2
                held = bits & get(keys[mid], 0)
                if held:
                    ranges.append((mid, hi, held))
                if bits & ~held:
                    ranges.append((lo, mid, bits & ~held))
        return out


_BISECT_FROM = 64
"""Prompts of more blocks than this are matched by bisection (:meth:`BlockIndex._bisect`)."""

# For each of the eight low bits: a byte table mapping a mask to 1 when it has the bit, to 0
# when it does not.
_HAS = {1 << b: bytes(1 if m & (1 << b) else 0 for m in range(256)) for b in range(8)}


class _Approx:
    """The approximate index of one model: what the gateway sent where, per replica an LRU
    of at most ``capacity`` keys, each forgotten ``ttl`` seconds after its last use."""

    def __init__(self, capacity: int, ttl: float, clock: Callable[[], float]) -> None:
        self.index = BlockIndex()
        self.capacity = capacity
        self.ttl = ttl
        self.clock = clock
        self.lru: dict[str, OrderedDict[int, float]] = {}

    def expire(self, shard_id: str, now: float) -> None:
        lru = self.lru.get(shard_id)
        if not lru:
            return
        stale: list[int] = []
        for key, at in lru.items():
            if at > now:
                break
            stale.append(key)
        if stale:
            for key in stale:
                del lru[key]
            self.index.discard(shard_id, stale)

    def record(self, shard_id: str, keys: Sequence[int]) -> None:
        now = self.clock()
        lru = self.lru.get(shard_id)
        if lru is None:
            lru = self.lru[shard_id] = OrderedDict()
        until = now + self.ttl
        for key in keys:
            lru[key] = until
            lru.move_to_end(key)
        self.index.add(shard_id, keys)
        over = len(lru) - self.capacity
        if over > 0:
            old = [key for key, _ in islice(lru.items(), over)]
            for key in old:
                del lru[key]
            self.index.discard(shard_id, old)

    def drop(self, shard_id: str) -> None:
        self.lru.pop(shard_id, None)
        self.index.drop(shard_id)


class PrefixRouting:
    """The prefix indexes of every model, and the choice they make."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        approx_ttl: float = APPROX_TTL,
        max_blocks: int = MAX_INDEX_BLOCKS,
    ) -> None:
        self.clock = clock
        self.approx_ttl = approx_ttl
        self.max_blocks = max_blocks
        self.events: dict[str, BlockIndex] = {}  # model -> what its engines report
        self.block_size: dict[str, int] = {}  # model -> tokens per block, as reported
        self.approx: dict[str, _Approx] = {}
        self.capacity: dict[str, int] = {}  # model -> a replica's capacity estimate
        self.lost: dict[str, int] = {}  # model -> events the agents could not place
        self.refused = 0  # messages for a shard this node does not run

    # ----------------------------------------------------------------- the indexes

    def apply(self, node_id: str, msg: pb.KvEvents, where: tuple[str, str] | None) -> None:
        """One batch of a shard's engine's cache changes, from its agent; ``where``: the
        model and node of that shard's ready replica as the router has it (None: no such
        shard is ready), which the router passes (Router.kv_events)."""
        if where is None or where[1] != node_id:
            self.refused += 1
            return
        model = where[0]
        index = self.events.get(model)
        if index is None:
            index = self.events[model] = BlockIndex(self.max_blocks)
        size = self.block_size.setdefault(model, msg.block_size or BLOCK_SIZE)
        if msg.block_size and msg.block_size != size:
            log.warning(
                "a replica reports another block size than the model's others; its blocks "
                "are not indexed (give every replica of a model the same block size)",
                extra=kv(model=model, shard=msg.shard_id, block_size=msg.block_size, want=size),
            )
            return
        if msg.cleared:
            index.drop(msg.shard_id)
        if msg.removed:
            index.discard(msg.shard_id, msg.removed)
        if msg.stored:
            index.add(msg.shard_id, msg.stored)
        else:
            index.bit(msg.shard_id)  # a shard that holds nothing yet is still heard from
        if msg.lost:
            self.lost[model] = self.lost.get(model, 0) + msg.lost

    def drop_shard(self, shard_id: str, model: str) -> None:
        """A replica stopped, failed or lost its node: nothing of it is held any more."""
        index = self.events.get(model)
        if index is not None:
            index.drop(shard_id)
            if not index.bits:
                self.events.pop(model, None)
                self.block_size.pop(model, None)
        approx = self.approx.get(model)
        if approx is not None:
            approx.drop(shard_id)

    def set_capacity(self, model: str, blocks: int) -> None:
        """A replica of ``model`` holds about ``blocks`` chunks of the approximate index."""
        blocks = max(1, blocks)
        if self.capacity.get(model) == blocks:
            return
        self.capacity[model] = blocks
        approx = self.approx.get(model)
        if approx is not None:
            approx.capacity = self.capacity[model]

    def clear_events(self) -> None:
        """Forget every model's KV events (a standby about to be sent the leader's whole
        index again, :mod:`llmgw.server.ha.kvrelay`)."""
        self.events.clear()
        self.block_size.clear()

    def has_events(self, model: str) -> bool:
        index = self.events.get(model)
        return index is not None and bool(index.live)

    def indexed_blocks(self) -> dict[str, int]:
        return {model: len(index) for model, index in self.events.items()}

    def approx_blocks(self) -> dict[str, int]:
        return {model: len(a.index) for model, a in self.approx.items()}

    def index_sizes(self) -> dict[tuple[str, str], int]:
        """(model, index) -> block keys held: ``events`` what the engines reported,
        ``approx`` what the gateway sent where (the /metrics gauge)."""
        sizes = {(m, "events"): n for m, n in self.indexed_blocks().items()}
        sizes.update({(m, "approx"): n for m, n in self.approx_blocks().items()})
        return sizes

    # ----------------------------------------------------------------- the choice

    def approx_index(self, model: str, shard_ids: Iterable[str]) -> _Approx:
        """The approximate index of ``model``, what ``shard_ids`` last used too long ago
        forgotten."""
        approx = self._approx(model)
        now = self.clock()
        for shard_id in shard_ids:
            approx.expire(shard_id, now)
        return approx

    def by_prefix(
        self,
        index: BlockIndex | None,
        candidates: list[Endpoint],
        every: list[Endpoint],
        hint: Hint,
        session: Endpoint | None,
        in_turn: Callable[[list[Endpoint]], Endpoint],
    ) -> tuple[Endpoint, str]:
        """The candidate with the least estimated work before the request's first token by
        ``index`` (ties: the session's, the fewest in flight, then ``in_turn``), and why."""
        depth_of: dict[int, int] = {}
        bits: dict[str, int] = {}
        if index is not None and hint.keys:
            for ep in every:
                bit = index.bits.get(ep.shard_id)
                if bit is not None:
                    bits[ep.shard_id] = bit
            want = 0
            for bit in bits.values():
                want |= bit
            depth_of = index.depths(hint.keys, want)
        tokens, unit = hint.tokens, hint.unit
        best: Endpoint | None = None
        best_key: tuple[int, int, int] = (0, 0, 0)
        ties: list[Endpoint] = []
        for ep in candidates:
            depth = depth_of.get(bits.get(ep.shard_id, 0), 0)
            cost = max(0, tokens - depth * unit) + ep.pending
            key = (cost, 0 if ep is session else 1, ep.inflight)
            if best is None or key < best_key:
                best, best_key, ties = ep, key, [ep]
            elif key == best_key:
                ties.append(ep)
        assert best is not None
        if len(ties) > 1:
            best = in_turn(ties)
        depth = depth_of.get(bits.get(best.shard_id, 0), 0)
        hint.matched = depth
        deepest = max(depth_of.values(), default=0)
        if deepest == 0:
            reason = "session" if best is session else "no_prefix"
        elif depth == deepest:
            reason = "prefix_hit"
        else:
            reason = "spread"  # a replica holding more was full or had more queued
        return best, reason

    def _approx(self, model: str) -> _Approx:
        approx = self.approx.get(model)
        if approx is None:
            approx = self.approx[model] = _Approx(
                self.capacity.get(model, APPROX_CAPACITY), self.approx_ttl, self.clock
            )
        return approx


# --------------------------------------------------------------------- reading a request


def text_of(path: str, payload: Mapping[str, Any]) -> bytes | None:
    """The prompt of a request as one text for the approximate index: each chat message's
    role and text in order; a completion's prompt; a response's instructions and input.
    None when the request has none of those shapes."""
    try:
        if path == "/v1/chat/completions":
            messages = payload.get("messages")
            if not isinstance(messages, list):
                return None
            parts: list[str] = []
            for message in messages:
                if not isinstance(message, dict):
                    return None
                content = message.get("content")
                if not isinstance(content, str):
                    content = json.dumps(content, sort_keys=True, separators=(",", ":"))
                parts.append(f"{message.get('role')}\x1f{content}\x1e")
            text = "".join(parts)
        elif path == "/v1/completions":
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None
            text = prompt
        elif path == "/v1/responses":
            given = payload.get("input")
            if given is None:
                return None
            if not isinstance(given, str):
                given = json.dumps(given, sort_keys=True, separators=(",", ":"))
            instructions = payload.get("instructions")
            text = (instructions if isinstance(instructions, str) else "") + "\x1e" + given
        else:
            return None
    except (TypeError, ValueError, RecursionError):
        return None
    data = text.encode("utf-8", "surrogatepass")
    return data if len(data) <= MAX_APPROX_TEXT else data[:MAX_APPROX_TEXT]


def text_keys(data: bytes) -> list[int]:
    """The chained keys of ``data``'s full :data:`APPROX_CHUNK`-byte chunks."""
    keys: list[int] = []
    parent = b"\0" * 8
    for at in range(0, len(data) - len(data) % APPROX_CHUNK, APPROX_CHUNK):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(data[at : at + APPROX_CHUNK])
        parent = h.digest()
        keys.append(int.from_bytes(parent, "little") or 1)
    return keys
