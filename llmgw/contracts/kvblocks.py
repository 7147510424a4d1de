"""Prompt blocks as llmgw keys them: the token ids cut into blocks of ``block_size``, each
block's key a 64-bit hash chained to its parent's, the same on every node and instance.

Engines key their prefix caches by a hash of their own (vLLM: SHA-256 of the parent's hash,
the block's tokens and extra keys, seeded at random unless ``PYTHONHASHSEED`` is set:
``init_none_hash`` and ``hash_block_tokens`` in vllm/v1/core/kv_cache_utils.py). So that the
gateway need not reproduce each engine's function and seed, the agent re-keys the events an
engine publishes from the token ids they carry (``BlockStored.token_ids`` in
vllm/distributed/kv_events.py) and the gateway keys a request's prompt the same way: one
function, :func:`block_keys`, on both sides. Only full blocks are keyed, as engines cache
only full blocks.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

__all__ = ["BLOCK_SIZE", "MAX_BLOCK_SIZE", "ROOT", "block_keys", "chain"]

BLOCK_SIZE = 16
"""vLLM's default block size (``--block-size``), and the sim engine's."""
MAX_BLOCK_SIZE = 1024
ROOT = 0
"""The parent of a prompt's first block."""

_MASK = (1 << 32) - 1


def chain(parent: int, tokens: Sequence[int]) -> int:
    """The key of a block of ``tokens`` whose parent block has key ``parent``."""
    return _digest(parent, _pack(tokens))


def block_keys(
    tokens: Sequence[int], block_size: int = BLOCK_SIZE, parent: int = ROOT
) -> list[int]:
    """The keys of the full blocks of ``tokens``, in order (a trailing partial block has
    none). ValueError when a token id is not in 0..2**32-1 or ``block_size`` is out of
    1..MAX_BLOCK_SIZE."""
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be in 1..{MAX_BLOCK_SIZE}, got {block_size}")
    full = len(tokens) - len(tokens) % block_size
    if not full:
        return []
    data = _pack(tokens[:full])
    step = 4 * block_size
    keys: list[int] = []
    for at in range(0, len(data), step):
        parent = _digest(parent, data[at : at + step])
        keys.append(parent)
    return keys


def _pack(tokens: Sequence[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in 0..{_MASK}: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every platform llmgw runs on
        packed = array("L", tokens)
    return packed.tobytes()


def _digest(parent: int, data: bytes) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(data)
    key = int.from_bytes(h.digest(), "little")
    return key or 1  # never ROOT
