"""The ``sim`` engine's prefix cache: full blocks of prompt tokens kept in an LRU of
``kv_blocks`` blocks, keyed as vLLM keys its own, and the KV cache events each change makes.

A prompt's token ids (:func:`llmgw.sim.generate.tokenize`) are cut into full blocks of
``block_size``; a trailing partial block is never cached, as in vLLM. Each block's engine
hash is the SHA-256 (32 bytes, vLLM's default hash) of its parent's hash followed by its
token ids; a first block's parent is a random 32-byte seed drawn once per process, as vLLM's
``NONE_HASH`` is without ``PYTHONHASHSEED`` (``init_none_hash`` in
vllm/v1/core/kv_cache_utils.py). So two engines never agree on a hash, and whoever routes
by these events must re-key the blocks from the token ids they carry, as with vLLM
(:mod:`llmgw.contracts.kvblocks`).

:meth:`PrefixCache.lookup` counts the leading blocks present (stopping at the first miss),
touches them, then stores the prompt's missing full blocks, evicting the least recently used
blocks first but never one of the same prompt's. Every store is a ``BlockStored`` (one per
run of consecutive new blocks, with its parent's hash, None for a first block, and every
token of its blocks), every eviction a ``BlockRemoved``, a reset ``AllBlocksCleared``; medium
``"GPU"``, as vLLM reports them (vllm/distributed/kv_events.py). The caller publishes one
request's events as one batch.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmgw.engines.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, Event

__all__ = ["MEDIUM", "NONE_HASH", "Lookup", "PrefixCache", "block_hashes"]

MEDIUM = "GPU"
"""Where the sim says its blocks live (vLLM's ``MEDIUM_GPU``)."""

NONE_HASH = os.urandom(32)
"""The parent hash of a prompt's first block: random per process, as vLLM's NONE_HASH when
PYTHONHASHSEED is unset (``init_none_hash`` in vllm/v1/core/kv_cache_utils.py)."""


def block_hashes(tokens: Sequence[int], block_size: int, seed: bytes = NONE_HASH) -> list[bytes]:
    """The engine hashes of the full blocks of ``tokens``, in order, chained from ``seed``."""
    full = len(tokens) - len(tokens) % block_size
    ids = array("I", tokens[:full])
    packed = ids.tobytes()
    step = ids.itemsize * block_size
    hashes: list[bytes] = []
    parent = seed
    for at in range(0, len(packed), step):
        parent = hashlib.sha256(parent + packed[at : at + step]).digest()
        hashes.append(parent)
    return hashes


@dataclass(slots=True)
class Lookup:
    """What one prompt found in the cache: its ``cached_tokens`` (the leading hit blocks
    times the block size) and the ``events`` its lookup caused, in order."""

    cached_tokens: int
    events: list[Event] = field(default_factory=list)


class PrefixCache:
    """An LRU of at most ``capacity`` full blocks of ``block_size`` tokens."""

    def __init__(self, block_size: int, capacity: int) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError(f"block_size and capacity must be >= 1: {block_size}, {capacity}")
        self.block_size = block_size
        self.capacity = capacity
        # The blocks' hashes, the least recently used first.
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def lookup(self, tokens: Sequence[int]) -> Lookup:
        """Count the cached leading blocks of ``tokens``, touch them, store the missing ones."""
        size = self.block_size
        hashes = block_hashes(tokens, size)
        blocks = self._blocks
        hits = 0
        for h in hashes:
            if h not in blocks:
                break
            hits += 1
        for h in hashes:  # touched: this prompt's blocks become the most recently used
            if h in blocks:
                blocks.move_to_end(h)
        missing = [i for i in range(hits, len(hashes)) if hashes[i] not in blocks]
        result = Lookup(hits * size)
        if not missing:
            return result
        mine = set(hashes)
        evicted: list[bytes] = []
        room = self.capacity - len(blocks)
        while room < len(missing) and blocks:
            oldest = next(iter(blocks))
            if oldest in mine:  # all that is left is this prompt's own: keep it
                break
            del blocks[oldest]
            evicted.append(oldest)
            room += 1
        if evicted:
            result.events.append(BlockRemoved(tuple(evicted), MEDIUM))
        missing = missing[: max(room, 0)]
        run: list[int] = []
        for i in missing:
            if run and i != run[-1] + 1:
                result.events.append(self._store(run, hashes, tokens))
                run = []
            run.append(i)
        if run:
            result.events.append(self._store(run, hashes, tokens))
        return result

    def _store(self, run: list[int], hashes: list[bytes], tokens: Sequence[int]) -> BlockStored:
        size = self.block_size
        for i in run:
            self._blocks[hashes[i]] = None
        first, last = run[0], run[-1]
        return BlockStored(
            block_hashes=tuple(hashes[first : last + 1]),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=tuple(tokens[first * size : (last + 1) * size]),
            block_size=size,
            lora_id=None,
            medium=MEDIUM,
        )

    def clear(self) -> list[Event]:
        """Drop every block: the ``AllBlocksCleared`` event to publish (none when empty)."""
        if not self._blocks:
            return []
        self._blocks.clear()
        return [AllBlocksCleared()]
