"""vLLM's KV cache events as they travel: the ZeroMQ frames and the msgpack event batches.

vLLM publishes them when started with ``--kv-events-config`` (publisher ``zmq``): each batch
is one multipart message ``(topic, seq, payload)``, ``seq`` 8 bytes big-endian counting up
from 0, ``payload`` a msgpack-encoded ``KVEventBatch`` (``ZmqEventPublisher._publisher_thread``
in vllm/distributed/kv_events.py). The schema is that file's msgspec structs:

- ``EventBatch``: ``ts`` (float), ``events`` (list), ``data_parallel_rank`` (int or None);
- ``BlockStored``: ``block_hashes``, ``parent_block_hash`` (or None), ``token_ids`` (every
  token of those blocks, in order), ``block_size``, ``lora_id``, ``medium`` and, in newer
  releases, ``lora_name``, ``extra_keys``, ``group_idx``, …;
- ``BlockRemoved``: ``block_hashes``, ``medium`` (and ``group_idx``);
- ``AllBlocksCleared``: nothing.

The structs are tagged unions (``tag=True``: the tag is the class name). Releases up to 0.11
declare them ``array_like=True``, so a batch is ``[ts, [event, ...], dp_rank]`` and an event
``["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...]``; the newest
drop ``array_like`` and encode maps with the tag under ``"type"``. :func:`decode_batch` reads
both; :func:`encode_batch` writes the array form (the sim engine's, and what the tests record).
A block hash is ``bytes`` (SHA-256, the default since 0.11) or an ``int``
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``): ``ExternalBlockHash`` in
vllm/v1/core/kv_cache_utils.py. SGLang's publisher (``--kv-events-config`` too) sends the
same array form; its ``block_size`` is its page size.

Where the publisher connects or binds follows vLLM's own rule (``_socket_setup``): it binds
an endpoint with ``*`` or ``::`` in it and ``ipc://`` / ``inproc://`` ones, and connects to
any other, so ``tcp://127.0.0.1:PORT`` makes the engine dial a subscriber that bound it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from llmgw.errors import KvEventError

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "Frames",
    "decode_batch",
    "encode_batch",
    "events_config",
    "parse_frames",
    "publisher_binds",
]

BlockHash = bytes | int
"""An engine's own key of a block (vLLM's ``ExternalBlockHash``)."""

MAX_PAYLOAD = 16 * 1024 * 1024
"""The largest batch read (vLLM batches one engine step's events: far less)."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Frames:
    """One published message: its topic, sequence number and payload."""

    topic: str
    seq: int
    payload: bytes


def parse_frames(frames: Sequence[bytes]) -> Frames:
    """A multipart message as vLLM's publisher sends it; KvEventError when it is not one."""
    if len(frames) != 3:
        raise KvEventError(
            f"a KV event message has 3 frames (topic, seq, payload); this one has {len(frames)}"
        )
    topic, seq, payload = frames
    if len(seq) != 8:
        raise KvEventError(f"a KV event's sequence number is 8 bytes; got {len(seq)}")
    try:
        name = bytes(topic).decode("utf-8")
    except UnicodeDecodeError:
        raise KvEventError("a KV event's topic is not UTF-8") from None
    return Frames(name, int.from_bytes(seq, "big", signed=True), bytes(payload))


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack ``KVEventBatch`` in either of vLLM's forms; KvEventError says what is wrong
    (an event of a type this llmgw does not know is one: a newer engine's)."""
    if len(payload) > MAX_PAYLOAD:
        raise KvEventError(f"a KV event batch of {len(payload)} bytes is over {MAX_PAYLOAD}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise KvEventError(f"a KV event batch is not msgpack: {exc}") from None
    if isinstance(data, list):
        if len(data) < 2:
            raise KvEventError("a KV event batch array needs [ts, events, ...]")
        ts, events, rank = data[0], data[1], data[2] if len(data) > 2 else None
    elif isinstance(data, dict):
        ts, events, rank = data.get("ts"), data.get("events"), data.get("data_parallel_rank")
    else:
        raise KvEventError(f"a KV event batch is an array or a map, not {type(data).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvEventError(f"a KV event batch's ts must be a number, got {ts!r}")
    if not isinstance(events, list):
        raise KvEventError("a KV event batch's events must be a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KvEventError(f"a KV event batch's data_parallel_rank must be an integer: {rank!r}")
    return EventBatch(float(ts), tuple(_event(e, i) for i, e in enumerate(events)), rank)


def _event(raw: Any, index: int) -> Event:
    where = f"events[{index}]"
    tag: object
    fields: dict[str, Any]
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KvEventError(f"{where}: an event array starts with its type's name")
        tag, fields = raw[0], _positional(raw[0], raw[1:], where)
    elif isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise KvEventError(f"{where}: an event map names its type under 'type'")
        fields = raw
    else:
        raise KvEventError(f"{where}: an event is an array or a map")
    if tag == "BlockStored":
        hashes = _hashes(fields.get("block_hashes"), f"{where}.block_hashes")
        parent = fields.get("parent_block_hash")
        if parent is not None and not _is_hash(parent):
            raise KvEventError(f"{where}.parent_block_hash must be bytes, an integer or nil")
        tokens = fields.get("token_ids")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tokens
        ):
            raise KvEventError(f"{where}.token_ids must be a list of integers")
        size = fields.get("block_size")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise KvEventError(f"{where}.block_size must be a positive integer, got {size!r}")
        if len(tokens) != size * len(hashes):
            raise KvEventError(
                f"{where}: {len(hashes)} block(s) of {size} tokens need {size * len(hashes)} "
                f"token ids; it has {len(tokens)}"
            )
        lora = fields.get("lora_id")
        medium = fields.get("medium")
        return BlockStored(
            hashes,
            parent,
            tuple(tokens),
            size,
            lora if isinstance(lora, int) and not isinstance(lora, bool) else None,
            medium if isinstance(medium, str) else None,
        )
    if tag == "BlockRemoved":
        medium = fields.get("medium")
        return BlockRemoved(
            _hashes(fields.get("block_hashes"), f"{where}.block_hashes"),
            medium if isinstance(medium, str) else None,
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventError(
        f"{where}: unknown KV event type {tag!r} (this llmgw reads BlockStored, BlockRemoved "
        "and AllBlocksCleared)"
    )


# The array form's field order, as the structs declare them (later fields are optional).
_ORDER = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _positional(tag: str, values: list[Any], where: str) -> dict[str, Any]:
    names = _ORDER.get(tag)
    if names is None:
        return {}
    if len(values) > len(names) + 8:  # a few fields newer than this llmgw are fine
        raise KvEventError(f"{where}: a {tag} array has {len(values)} fields")
    return dict(zip(names, values, strict=False))


def _is_hash(value: object) -> bool:
    return isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool))


def _hashes(value: object, where: str) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not all(_is_hash(h) for h in value):
        raise KvEventError(f"{where} must be a list of block hashes (bytes or integers)")
    return tuple(value)


def encode_batch(batch: EventBatch) -> bytes:
    """``batch`` as vLLM's array-form msgpack (the form :func:`decode_batch` reads first)."""
    events: list[list[Any]] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(
                [
                    "BlockStored",
                    list(event.block_hashes),
                    event.parent_block_hash,
                    list(event.token_ids),
                    event.block_size,
                    event.lora_id,
                    event.medium,
                ]
            )
        elif isinstance(event, BlockRemoved):
            events.append(["BlockRemoved", list(event.block_hashes), event.medium])
        else:
            events.append(["AllBlocksCleared"])
    packed = msgpack.packb([batch.ts, events, batch.data_parallel_rank], use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def publisher_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds ``endpoint`` (else it connects to it)."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def events_config(endpoint: str, topic: str) -> str:
    """The ``--kv-events-config`` JSON that makes an engine publish to ``endpoint`` under
    ``topic`` (vllm/config/kv_events.py ``KVEventsConfig``)."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "topic": topic,
        },
        separators=(",", ":"),
    )
