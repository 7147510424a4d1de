"""A shard's KV cache blocks as llmgw keys them: the map from an engine's block hashes to
llmgw's keys, and the changes not sent yet (:mod:`llmgw.agent.kvevents` feeds them).

**Re-keying.** vLLM keys a block by a hash of its tokens and the request's extra keys (LoRA,
images, ``cache_salt``) under a seed that ``PYTHONHASHSEED`` changes, so the gateway cannot
compute the engine's hashes; but ``BlockStored`` carries the token ids, so each stored
block is keyed :func:`llmgw.contracts.kvblocks.chain` (its parent's key, its tokens), the
parent found by the event's ``parent_block_hash`` in the shard's map engine hash -> key
(:class:`BlockMap`; no parent: ``ROOT``), which also translates ``BlockRemoved``. A block
whose parent the map does not hold cannot be keyed and is counted in ``lost``, as are the
blocks forgotten when the map is full (:data:`MAX_BLOCKS`, the oldest first; the index is
told they are gone). Events of another medium than the GPU's
(vLLM's CPU offload, ``medium`` "CPU"), and of a LoRA adapter's blocks (llmgw keys a prompt
without one), are ignored. ``AllBlocksCleared`` empties the map and sends ``cleared``.

A map and its :class:`Pending` belong to one thread at a time (the feed's worker, while it
applies a message; the event loop otherwise): neither takes a lock.

**Size.** A block costs 8 bytes (a packed ``fixed64``) instead of the engine's 32-byte hash
and 16 token ids (about 100 bytes a block in vLLM's msgpack, 79 after zlib): a twelfth.
General compression would add nothing on top: zlib (levels 1 to 9) makes a message of
16,384 packed random keys 0.04 % larger, not smaller (tests/unit/agent/test_kvevents.py
measures both), as random 64-bit keys do not compress.
"""

from __future__ import annotations

from collections import OrderedDict

from llmgw.contracts.kvblocks import MAX_BLOCK_SIZE, ROOT, chain
from llmgw.engines.kvevents import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
)
from llmgw.proto import control_pb2 as pb

__all__ = ["MAX_BLOCKS", "SNAPSHOT_CHUNK", "BlockMap", "Pending"]

SNAPSHOT_CHUNK = 16384
"""Keys in one message of a shard's whole set (the control plane takes up to 65,536)."""
MAX_BLOCKS = 4 * 1024 * 1024
"""Blocks a shard's map holds; a full GPU cache is far fewer (80 GiB of 16-token blocks of
an 8B model: about 40,000)."""
_APPLIED_MEDIA = (None, "GPU")


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
