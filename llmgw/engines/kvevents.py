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
A block hash is an ``int`` (the low 64 bits of the block's SHA-256, unsigned:
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default in 0.34) or the 32 ``bytes`` of it
(that variable 0): ``ExternalBlockHash`` in vllm/v1/core/kv_cache_utils.py. SGLang's
publisher (``--kv-events-config`` too) sends the same batch array and event maps, one
``BlockStored`` a page, its hashes signed 64-bit integers and its ``block_size`` the page's
tokens (sglang/srt/mem_cache/events.py, 0.5.23). Frames captured from both are
tests/fixtures/engines/kvevents/.

Where the publisher connects or binds follows vLLM's own rule (``_socket_setup``): it binds
an endpoint with ``*`` or ``::`` in it and ``ipc://`` / ``inproc://`` ones, and connects to
any other. llmgw hands an engine an ``ipc://`` endpoint in a directory only the agent's user
may enter (:mod:`llmgw.agent.kvsockets`): the engine binds it, the agent dials it, and no
other local user can reach it, to read the token ids or to forge blocks. The config names no
``replay_endpoint`` (vLLM would bind a ROUTER there for anyone to ask for past batches), and
an ``ipc://`` endpoint takes no data-parallel rank above 0 (vLLM's ``offset_endpoint_port``
refuses it), which llmgw's shards never have.

A batch is read within bounds (:data:`MAX_PAYLOAD` bytes, :data:`MAX_EVENTS` events,
:data:`MAX_ITEMS` hashes or token ids an event, :data:`MAX_LEAF_BYTES` a string), walked
along the schema rather than unpacked whole (:func:`decode_batch`).
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

MAX_PAYLOAD = 4 * 1024 * 1024
"""The largest batch read, and the agent's ``ZMQ_MAXMSGSIZE``: vLLM batches one engine step's
events, far less (a step of 8,192 new blocks of 16 tokens, 131,072 prompt tokens, is about
0.9 MiB)."""
MAX_EVENTS = 65_536
"""Events in one batch (a step has one per request that stored or freed blocks)."""
MAX_ITEMS = 1 << 20
"""Block hashes, or token ids, in one event."""
MAX_LEAF_BYTES = 4096
"""The longest string or binary value read (a block hash is 32 bytes; medium a word)."""


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
    (an event of a type this llmgw does not know is one: a newer engine's).

    The payload is walked along the schema (:class:`_Reader`) rather than unpacked whole: a
    container is read only where the schema has one, each no longer than its bound
    (:data:`MAX_EVENTS`, :data:`MAX_ITEMS`), so that whatever the bytes, one message makes
    at most one Python object per leaf and the work stays in Python code, which a worker
    thread shares with the event loop (one ``unpackb`` of 4 MiB of nested empty arrays holds
    the interpreter for a second)."""
    if len(payload) > MAX_PAYLOAD:
        raise KvEventError(f"a KV event batch of {len(payload)} bytes is over {MAX_PAYLOAD}")
    reader = _Reader(payload)
    try:
        batch = _batch(reader)
        reader.end()
    except (ValueError, msgpack.UnpackException) as exc:  # limits, truncation, bad bytes
        raise KvEventError(f"a KV event batch is not msgpack of vLLM's schema: {exc}") from None
    return batch


def _batch(reader: _Reader) -> EventBatch:
    kind = reader.kind()
    if kind == "array":
        size = reader.array(8, "a KV event batch array")
        if size < 2:
            raise KvEventError("a KV event batch array needs [ts, events, ...]")
        ts = reader.scalar()
        events = _events(reader)
        rank = reader.scalar() if size > 2 else None
        reader.skip(size - 3)
    elif kind == "map":
        ts, events, rank = None, None, None
        for _ in range(reader.map(16, "a KV event batch map")):
            name = reader.scalar()
            if name == "ts":
                ts = reader.scalar()
            elif name == "events":
                events = _events(reader)
            elif name == "data_parallel_rank":
                rank = reader.scalar()
            else:
                reader.skip()
    else:
        value = reader.scalar()  # bytes that are no msgpack at all raise here
        raise KvEventError(f"a KV event batch is an array or a map, not {type(value).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KvEventError(f"a KV event batch's ts must be a number, got {ts!r}")
    if events is None:
        raise KvEventError("a KV event batch's events must be a list")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KvEventError(f"a KV event batch's data_parallel_rank must be an integer: {rank!r}")
    return EventBatch(float(ts), events, rank)


def _events(reader: _Reader) -> tuple[Event, ...]:
    if reader.kind() != "array":
        raise KvEventError("a KV event batch's events must be a list")
    count = reader.array(MAX_EVENTS, "a KV event batch's events")
    return tuple(_event(reader, f"events[{i}]") for i in range(count))


def _event(reader: _Reader, where: str) -> Event:
    fields: dict[str, Any] = {}
    kind = reader.kind()
    if kind == "array":
        size = reader.array(_MAX_FIELDS, f"{where}: an event array")
        tag = reader.scalar() if size else None
        if not isinstance(tag, str):
            raise KvEventError(f"{where}: an event array starts with its type's name")
        names = _ORDER.get(tag, ())
        for i in range(size - 1):
            name = names[i] if i < len(names) else ""
            fields[name] = _field(reader, name, where)
        fields.pop("", None)
    elif kind == "map":
        for _ in range(reader.map(_MAX_FIELDS, f"{where}: an event map")):
            name = reader.scalar()
            fields[name if isinstance(name, str) else ""] = _field(
                reader, name if isinstance(name, str) else "", where
            )
        fields.pop("", None)
        tag = fields.get("type")
        if not isinstance(tag, str):
            raise KvEventError(f"{where}: an event map names its type under 'type'")
    else:
        raise KvEventError(f"{where}: an event is an array or a map")
    return _typed(tag, fields, where)


def _field(reader: _Reader, name: str, where: str) -> Any:
    """One field's value, read as its name says (an unknown field is skipped unread)."""
    if name == "block_hashes":
        return reader.leaves(f"{where}.{name}", (bytes, int), "block hashes (bytes or integers)")
    if name == "token_ids":
        return reader.leaves(f"{where}.{name}", (int,), "integers")
    if name in _SCALARS:
        return reader.scalar()
    reader.skip()
    return None


def _typed(tag: str, fields: dict[str, Any], where: str) -> Event:
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
_MAX_FIELDS = 32  # an event's fields: a few newer than this llmgw are fine
_SCALARS = frozenset({"type", "parent_block_hash", "block_size", "lora_id", "medium"})
# msgpack's first byte of an array (fixarray, array 16, array 32) and of a map.
_ARRAY_BYTES = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD})
_MAP_BYTES = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})


class _Reader:
    """A msgpack payload read one value at a time. Its unpacker takes no container at all
    (``max_array_len``/``max_map_len`` 0): the schema's containers are opened by their
    headers, each checked against its bound before a value of it is read; a string or a
    binary is at most :data:`MAX_LEAF_BYTES`. A value the schema does not use is skipped,
    which builds no object."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
        self._unpacker = msgpack.Unpacker(
            raw=False,
            strict_map_key=False,
            max_buffer_size=max(len(payload), 1),
            max_array_len=0,
            max_map_len=0,
            max_str_len=MAX_LEAF_BYTES,
            max_bin_len=MAX_LEAF_BYTES,
            max_ext_len=0,
        )
        self._unpacker.feed(payload)

    def kind(self) -> str:
        """What the next value is: ``array``, ``map`` or ``scalar``."""
        at = self._unpacker.tell()
        if at >= len(self._payload):
            raise KvEventError("a KV event batch ends in the middle of a value")
        first = self._payload[at]
        if first in _ARRAY_BYTES:
            return "array"
        return "map" if first in _MAP_BYTES else "scalar"

    def array(self, limit: int, what: str) -> int:
        size = int(self._unpacker.read_array_header())
        if size > limit:
            raise KvEventError(f"{what} has {size} items, over the {limit} read")
        return size

    def map(self, limit: int, what: str) -> int:
        size = int(self._unpacker.read_map_header())
        if size > limit:
            raise KvEventError(f"{what} has {size} entries, over the {limit} read")
        return size

    def scalar(self) -> Any:
        """The next value, which must be no container (an empty one reads as ``[]``/``{}``,
        which no field takes)."""
        if self.kind() != "scalar":
            raise KvEventError("a list or a map where vLLM's schema has a single value")
        return self._unpacker.unpack()

    def leaves(self, what: str, kinds: tuple[type, ...], noun: str) -> list[Any] | None:
        """An array of scalars of ``kinds`` (block hashes, token ids; never a boolean), or
        None when the value is not an array (the field's check then refuses it)."""
        if self.kind() != "array":
            self.skip()
            return None
        unpack = self._unpacker.unpack
        items = []
        for _ in range(self.array(MAX_ITEMS, what)):
            try:
                item = unpack()
            except ValueError:
                if self.kind() == "scalar":  # bad bytes, not a container: said as they are
                    raise
                item = []  # the unpacker takes no container, and stays before it
            if type(item) not in kinds:  # stop at the first wrong one, whatever follows
                held = "list or a map" if isinstance(item, list | dict) else type(item).__name__
                raise KvEventError(f"{what} must be a list of {noun}; it holds a {held}")
            items.append(item)
        return items

    def skip(self, count: int = 1) -> None:
        for _ in range(count):
            self._unpacker.skip()

    def end(self) -> None:
        if self._unpacker.tell() != len(self._payload):
            raise KvEventError("a KV event batch has bytes after its end")


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
