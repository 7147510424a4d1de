"""The engines' KV cache events at the agent (llmgw.agent.kvevents): vLLM's batches, made
by hand from its schema, re-keyed into KvEvents; a real ZeroMQ publisher binding the socket
the agent dials; the snapshot of a new stream; a shard's stop; and the shards it is wired
into (the engine's flag, the record, adoption, docker). What keeps the channel private and
the agent's loop free: test_kvevents_channel.py."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import tempfile
import zlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from llmgw.agent import kvevents as kvevents_module
from llmgw.agent import kvmap as kvmap_module
from llmgw.agent.kvevents import KvEventsHub, engine_config
from llmgw.agent.kvmap import SNAPSHOT_CHUNK, BlockMap, Pending
from llmgw.agent.kvsockets import kv_endpoint, kv_socket_dir
from llmgw.agent.records import parse_record, record_json
from llmgw.agent.runtimes import Launch
from llmgw.agent.runtimes.base import ShardRecord
from llmgw.agent.runtimes.containers import launch_for
from llmgw.agent.shards import ShardManager, ShardSpec, ShardState
from llmgw.contracts.kvblocks import ROOT, block_keys, chain
from llmgw.engines.kvevents import (
    MAX_EVENTS,
    MAX_ITEMS,
    MAX_LEAF_BYTES,
    MAX_PAYLOAD,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from llmgw.errors import KvEventError
from llmgw.proto import control_pb2 as pb
from tests.unit.agent.kvevents_rig import (
    TOKENS,
    WAIT_S,
    H,
    IdleRuntime,
    Publisher,
    Sender,
    array_batch,
    kv_order,
    stored_array,
)

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- vLLM's batches


def removed_array(hashes: list[Any], medium: Any = "GPU") -> list[Any]:
    return ["BlockRemoved", hashes, medium]


def map_batch(*events: dict[str, Any]) -> bytes:
    """The newest releases' form: maps, the tag under "type"."""
    return msgpack.packb(
        {"ts": 2.0, "events": list(events), "data_parallel_rank": None}, use_bin_type=True
    )


def stored_map(hashes: list[Any], parent: Any, tokens: list[int], **more: Any) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": None,
        "group_idx": 0,
        **more,
    }


def translate(*payloads: bytes, blocks: BlockMap | None = None) -> list[pb.KvEvents]:
    """The payloads through one shard's map, coalesced into the messages sent for them."""
    blocks = blocks if blocks is not None else BlockMap()
    pending = Pending()
    for payload in payloads:
        for event in decode_batch(payload).events:
            blocks.apply(event, pending)
    return pending.take("r1-s0", 16)


@pytest.mark.parametrize("form", ["array", "map"])
@pytest.mark.parametrize("hashes", [H[:3], [11, -12, 2**63]], ids=["bytes", "int"])
def test_stored_blocks_are_keyed_as_the_gateway_keys_a_prompt(form: str, hashes: list[Any]) -> None:
    # One event for the first two blocks, one for the third (its parent: the second).
    if form == "array":
        payload = array_batch(
            stored_array(hashes[:2], None, TOKENS[:32]),
            stored_array(hashes[2:], hashes[1], TOKENS[32:]),
        )
    else:
        payload = map_batch(
            stored_map(hashes[:2], None, TOKENS[:32]),
            stored_map(hashes[2:], hashes[1], TOKENS[32:]),
        )
    (msg,) = translate(payload)
    assert list(msg.stored) == block_keys(TOKENS, 16)
    assert (msg.shard_id, msg.block_size, msg.cleared, list(msg.removed), msg.lost) == (
        "r1-s0",
        16,
        False,
        [],
        0,
    )


def test_removed_blocks_are_translated_by_the_shards_map() -> None:
    blocks = BlockMap()
    translate(array_batch(stored_array(H[:3], None, TOKENS)), blocks=blocks)
    (msg,) = translate(array_batch(removed_array([H[2], H[0]])), blocks=blocks)
    keys = block_keys(TOKENS, 16)
    assert list(msg.removed) == [keys[2], keys[0]]
    assert list(msg.stored) == [] and len(blocks) == 1
    # A hash the map never held (its store was lost, or another medium's) is no change.
    assert translate(array_batch(removed_array([H[6]])), blocks=blocks) == []


def test_a_block_whose_parent_is_unknown_is_lost_with_its_children() -> None:
    blocks = BlockMap()
    (msg,) = translate(array_batch(stored_array(H[1:3], H[0], TOKENS[16:])), blocks=blocks)
    assert (list(msg.stored), msg.lost) == ([], 2)
    assert len(blocks) == 0


def test_all_blocks_cleared_empties_the_map_and_sends_cleared() -> None:
    blocks = BlockMap()
    translate(array_batch(stored_array(H[:2], None, TOKENS[:32])), blocks=blocks)
    (msg,) = translate(
        array_batch(["AllBlocksCleared"], stored_array(H[3:4], None, TOKENS[:16])), blocks=blocks
    )
    assert msg.cleared
    assert list(msg.stored) == [chain(ROOT, TOKENS[:16])]  # what came after the clear
    assert blocks.held() == [chain(ROOT, TOKENS[:16])]


def test_a_store_and_remove_in_one_batch_cancel_out() -> None:
    payload = array_batch(
        stored_array(H[:2], None, TOKENS[:32]), removed_array([H[1]]), removed_array([H[0]])
    )
    assert translate(payload) == []
    # Removed then stored again before a flush: the index keeps it, nothing is sent.
    blocks = BlockMap()
    translate(array_batch(stored_array(H[:1], None, TOKENS[:16])), blocks=blocks)
    again = array_batch(removed_array([H[0]]), stored_array(H[1:2], None, TOKENS[:16]))
    assert translate(again, blocks=blocks) == []


def test_two_engine_blocks_of_one_key_are_removed_with_the_last() -> None:
    blocks = BlockMap()
    (first,) = translate(
        array_batch(
            stored_array(H[:1], None, TOKENS[:16]), stored_array(H[1:2], None, TOKENS[:16])
        ),
        blocks=blocks,
    )
    assert list(first.stored) == [chain(ROOT, TOKENS[:16])]
    assert translate(array_batch(removed_array([H[0]])), blocks=blocks) == []
    (last,) = translate(array_batch(removed_array([H[1]])), blocks=blocks)
    assert list(last.removed) == [chain(ROOT, TOKENS[:16])]


def test_other_media_and_lora_blocks_are_ignored() -> None:
    blocks = BlockMap()
    payload = array_batch(
        stored_array(H[:1], None, TOKENS[:16], medium="CPU"),
        ["BlockStored", H[1:2], None, TOKENS[:16], 16, 3, "GPU"],  # a LoRA adapter's
    )
    assert translate(payload, blocks=blocks) == []
    assert blocks.ignored == 2 and len(blocks) == 0
    # vLLM before media existed says nothing (nil): the GPU's.
    (msg,) = translate(array_batch(stored_array(H[:1], None, TOKENS[:16], medium=None)))
    assert len(msg.stored) == 1


def test_a_full_map_forgets_its_oldest_blocks_and_counts_them() -> None:
    blocks = BlockMap(limit=2)
    (msg,) = translate(array_batch(stored_array(H[:3], None, TOKENS)), blocks=blocks)
    keys = block_keys(TOKENS, 16)
    # The first block is forgotten at once: stored and removed in one flush, no change.
    assert (list(msg.stored), list(msg.removed), msg.lost) == (keys[1:], [], 1)
    assert (len(blocks), blocks.forgotten) == (2, 1)


def test_a_large_change_is_sent_in_chunks_of_keys() -> None:
    pending = Pending()
    for key in range(1, SNAPSHOT_CHUNK + 11):
        pending.store(key)
    pending.lost = 4
    first, second = pending.take("s", 16)
    assert (len(first.stored), first.lost, len(second.stored), second.lost) == (
        SNAPSHOT_CHUNK,
        4,
        10,
        0,
    )
    assert not pending and pending.take("s", 16) == []


def _head(count: int) -> bytes:
    """An array 32 header of ``count`` items (the items themselves may be left out: a bound
    is checked on the header, before one is read)."""
    return b"\xdd" + count.to_bytes(4, "big")


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        pytest.param(
            array_batch(stored_array(H[:1], None, [[]] * 16)),  # type: ignore[list-item]
            "events[0].token_ids must be a list of integers; it holds a list or a map",
            id="a-container-for-a-token",
        ),
        pytest.param(
            array_batch(stored_array([[b"x" * 32]], None, TOKENS[:16])),
            "events[0].block_hashes must be a list of block hashes (bytes or integers); it "
            "holds a list or a map",
            id="a-container-for-a-hash",
        ),
        pytest.param(
            b"\x93" + msgpack.packb(1.0) + _head(MAX_EVENTS + 1),
            f"a KV event batch's events has {MAX_EVENTS + 1} items, over the {MAX_EVENTS} read",
            id="too-many-events",
        ),
        pytest.param(
            b"\x93"
            + msgpack.packb(1.0)
            + b"\x91\x97"
            + msgpack.packb("BlockStored")
            + _head(MAX_ITEMS + 1),
            f"events[0].block_hashes has {MAX_ITEMS + 1} items, over the {MAX_ITEMS} read",
            id="too-many-hashes",
        ),
        pytest.param(
            array_batch(stored_array(H[:1], None, TOKENS[:16], medium="G" * (MAX_LEAF_BYTES + 1))),
            f"{MAX_LEAF_BYTES + 1} exceeds max_str_len({MAX_LEAF_BYTES})",
            id="a-long-string",
        ),
        pytest.param(
            array_batch(stored_array(H[:1], None, TOKENS[:16])) + b"\xc0",
            "a KV event batch has bytes after its end",
            id="bytes-after-the-end",
        ),
        pytest.param(
            array_batch(stored_array(H[:1], None, TOKENS[:16]))[:-5],
            "a KV event batch",
            id="cut-short",
        ),
        pytest.param(
            b"\x00" * (MAX_PAYLOAD + 1),
            f"a KV event batch of {MAX_PAYLOAD + 1} bytes is over {MAX_PAYLOAD}",
            id="over-the-largest",
        ),
    ],
)
def test_a_batch_is_read_within_bounds(payload: bytes, problem: str) -> None:
    with pytest.raises(KvEventError) as info:
        decode_batch(payload)
    assert problem in str(info.value)


def test_fields_the_agent_does_not_read_are_skipped_unbuilt() -> None:
    # vLLM's newer fields (lora_name, extra_keys, group_idx, ...) in either form, holding
    # whatever they hold: skipped, the event read.
    deep: list[Any] = [[[[]] * 50_000]] * 2
    stored = [*stored_array(H[:1], None, TOKENS[:16]), "adapter", deep, 3, "full", None, "x"]
    (event,) = decode_batch(array_batch(stored)).events
    assert event == BlockStored((H[0],), None, tuple(TOKENS[:16]), 16, None, "GPU")
    mapped = stored_map(H[:1], None, TOKENS[:16], extra_keys=deep, kv_cache_spec_kind="full")
    assert decode_batch(map_batch(mapped)).events == (event,)


def test_packed_keys_are_a_twelfth_of_the_engines_and_zlib_adds_nothing() -> None:
    rng = random.Random(7)
    count = 16384
    packed = pb.KvEvents(
        shard_id="r1-s0", block_size=16, stored=[rng.getrandbits(64) for _ in range(count)]
    ).SerializeToString()
    for level in (1, 6, 9):
        # Random 64-bit keys do not compress: zlib makes them larger (0.04 %), not smaller.
        assert len(zlib.compress(packed, level)) >= len(packed)
    engine = encode_batch(
        EventBatch(
            0.0,
            (
                BlockStored(
                    tuple(rng.randbytes(32) for _ in range(count)),
                    None,
                    tuple(rng.randrange(150_000) for _ in range(16 * count)),
                    16,
                    None,
                    "GPU",
                ),
            ),
        )
    )
    assert len(packed) / count < 8.1
    assert len(engine) / len(packed) > 10  # about 100 bytes a block against 8
    assert len(zlib.compress(engine, 6)) / len(packed) > 8


# --------------------------------------------------------------------------- a real publisher


async def handled(feed: Any, count: int) -> None:
    """Wait until ``feed`` has handled ``count`` messages (each in its worker, then settled
    back on the loop)."""
    for _ in range(int(WAIT_S / 0.01)):
        if feed.handled >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the feed handled {feed.handled} messages, not {count}")


def with_hub(
    body: Callable[[KvEventsHub, Sender, zmq.asyncio.Context], Awaitable[None]], **hub: Any
) -> None:
    """``body`` with a hub whose state directory is short (a unix socket's path is at most
    107 bytes, and pytest's tmp_path is long)."""
    state_dir = Path(tempfile.mkdtemp(prefix="llmgw-kv-"))

    async def main() -> None:
        sender = Sender()
        events = KvEventsHub(sender, state_dir=state_dir, **hub)
        context = zmq.asyncio.Context()
        try:
            await body(events, sender, context)
        finally:
            await events.aclose()
            context.destroy(linger=0)

    try:
        asyncio.run(main())
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def test_frames_from_a_real_publisher_come_out_as_kv_events() -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        endpoint = hub.open("r1-s0")
        assert endpoint == kv_endpoint(hub.state_dir, "r1-s0")
        assert json.loads(engine_config("r1-s0", endpoint)) == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"ipc://{hub.state_dir}/kv/{kv_socket_dir(Path(), 'r1-s0').name}/kv.sock",
            "topic": "r1-s0",
        }
        pub = Publisher(context, endpoint)
        await pub.subscribed()
        await pub.publish(0, array_batch(stored_array(H[:2], None, TOKENS[:32])))
        await pub.publish(1, map_batch(stored_map(H[2:3], H[1], TOKENS[32:])))
        await pub.publish(2, array_batch(removed_array([H[0]])))
        (msg,) = await sender.wait(1)  # one flush for the three batches
        keys = block_keys(TOKENS, 16)
        assert (list(msg.stored), list(msg.removed), msg.lost) == (keys[1:], [], 0)
        await asyncio.sleep(0.15)
        assert len(sender.sent) == 1

    with_hub(body)


def test_a_gap_in_the_sequence_is_counted_lost_and_the_feed_goes_on() -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        pub = Publisher(context, hub.open("r1-s0"))
        await pub.subscribed()
        await pub.publish(0, array_batch(stored_array(H[:1], None, TOKENS[:16])))
        await pub.publish(4, array_batch(stored_array(H[1:2], H[0], TOKENS[16:32])))
        (msg,) = await sender.wait(1)
        assert msg.lost == 3  # batches 1, 2 and 3 never came
        assert list(msg.stored) == block_keys(TOKENS[:32], 16)

    with_hub(body)


def test_a_bad_payload_is_logged_and_counted_and_the_next_good_one_applied(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        pub = Publisher(context, hub.open("r1-s0"))
        await pub.subscribed()
        await pub.publish(0, b"\xc1 not msgpack")
        await pub.publish(1, array_batch(["NewEventType", 1]))
        # Another publisher's topic, and a message that is not (topic, seq, payload): bad,
        # and no number of this shard's sequence.
        await pub.publish(2, array_batch(stored_array(H[:1], None, TOKENS[:16])), topic=b"other")
        await pub.socket.send_multipart([b"r1-s0", b"short"])
        await pub.publish(2, array_batch(stored_array(H[:1], None, TOKENS[:16])))
        (msg,) = await sender.wait(1)
        assert msg.lost == 4
        assert list(msg.stored) == [chain(ROOT, TOKENS[:16])]

    with caplog.at_level(logging.WARNING, logger="llmgw.agent.kvevents"):
        with_hub(body)
    bad = [r for r in caplog.records if "bad KV cache event" in r.getMessage()]
    assert len(bad) == 1  # once a minute per shard, however many
    assert "not msgpack" in str(bad[0].__dict__["fields"]["problem"])


def test_a_new_stream_gets_every_shards_whole_set() -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        pub = Publisher(context, hub.open("r1-s0"))
        await pub.subscribed()
        sender.up = False  # no stream: the changes are dropped
        tokens = list(range(SNAPSHOT_CHUNK + 5))
        hashes = list(range(1, len(tokens) + 1))
        stored = ["BlockStored", hashes, None, tokens, 1, None, "GPU"]
        await pub.publish(0, array_batch(stored))
        await pub.publish(3, array_batch(removed_array([hashes[-1]])))
        await handled(hub.feeds["r1-s0"], 2)
        assert sender.sent == []
        sender.up = True
        hub.resync()  # the Welcome of a new stream
        head, first, second = sender.sent
        assert (head.cleared, head.lost, list(head.stored), head.block_size) == (True, 2, [], 1)
        assert not first.cleared and len(first.stored) == SNAPSHOT_CHUNK
        assert set(first.stored) | set(second.stored) == set(block_keys(tokens[:-1], 1))
        await asyncio.sleep(0.1)
        assert len(sender.sent) == 3  # nothing pending was sent again after it

    with_hub(body)


def test_a_stopped_shard_sends_cleared_once_and_closes_its_socket() -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        endpoint = hub.open("r1-s0")
        pub = Publisher(context, endpoint)
        await pub.subscribed()
        await pub.publish(0, array_batch(stored_array(H[:1], None, TOKENS[:16])))
        await sender.wait(1)
        feed = hub.feeds["r1-s0"]
        hub.close("r1-s0")
        hub.close("r1-s0")  # once only
        assert [(m.shard_id, m.cleared, list(m.stored)) for m in sender.sent[1:]] == [
            ("r1-s0", True, [])
        ]
        assert feed.socket.closed and "r1-s0" not in hub.feeds
        # Its engine is gone: so is its socket directory.
        assert not kv_socket_dir(hub.state_dir, "r1-s0").exists()
        await asyncio.sleep(0.1)
        assert sender.sent[1:] == [sender.sent[1]]  # nothing more from it

    with_hub(body)


def test_an_adopted_shard_dials_its_engine_again_and_takes_the_sequence_as_it_is() -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        endpoint = hub.open("r1-s0")
        pub = Publisher(context, endpoint)
        await pub.subscribed()
        await hub.aclose()  # the agent goes; the engine and its socket stay
        assert await asyncio.wait_for(pub.socket.recv(), WAIT_S) == b"\x00"
        assert hub.adopt("r1-s0", endpoint, ready=True) == endpoint
        await pub.subscribed()
        await pub.publish(812, array_batch(stored_array(H[:1], None, TOKENS[:16])))
        (msg,) = await sender.wait(1)
        assert msg.lost == 0  # where the engine is now is no gap

    with_hub(body)


def test_docker_shards_run_without_events_and_say_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        with caplog.at_level(logging.WARNING, logger="llmgw.agent.kvevents"):
            assert hub.open("r1-s0") == ""
            assert hub.open("r1-s0") == ""
            # A multi-node replica's containers too (in the host's network namespace, but
            # still without the agent's socket directory).
            assert hub.open("r2-s0", nodes=2, rank=0) == ""
            assert hub.adopt("r3-s0", "", ready=True) == ""
        warned = [r for r in caplog.records if "cannot reach" in r.getMessage()]
        assert [r.__dict__["fields"]["shard"] for r in warned] == ["r1-s0", "r2-s0", "r3-s0"]
        assert hub.feeds == {} and not (hub.state_dir / "kv").exists()

    with_hub(body, runtime="docker")


def test_a_worker_publishes_nothing() -> None:
    async def body(hub: KvEventsHub, sender: Sender, context: zmq.asyncio.Context) -> None:
        assert hub.open("r2-s1", nodes=2, rank=1) == ""
        assert hub.open("r2-s0", nodes=2, rank=0).startswith("ipc://")
        assert sorted(hub.feeds) == ["r2-s0"]

    with_hub(body)


# --------------------------------------------------------------------------- the shards


def test_a_kv_events_order_reaches_the_spec() -> None:
    order = pb.StartShard(shard_id="r1-s0", replica_id="r1", model="m", engine="sim")
    assert not ShardSpec.from_order(order).kv_events
    order.kv_events = True
    assert ShardSpec.from_order(order).kv_events


def test_a_kv_events_shard_tells_its_engine_where_to_publish_and_records_the_endpoint(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        sender = Sender()
        hub = KvEventsHub(sender, state_dir=tmp_path)
        runtime = IdleRuntime()
        manager = ShardManager(tmp_path, runtime, lambda shard: None, kv_events=hub)
        await manager.open()
        try:
            shard = await manager.start(kv_order())
            plain = await manager.start(kv_order(shard_id="r2-s0", kv_events=False))
            endpoint = shard.kv_events_endpoint
            assert endpoint == kv_endpoint(tmp_path, "r1-s0") and plain.kv_events_endpoint == ""
            argv = list(runtime.launches[0].argv)
            assert argv[argv.index("--kv-events-config") + 1] == engine_config("r1-s0", endpoint)
            assert "--kv-events-config" not in runtime.launches[1].argv
            saved = json.loads((tmp_path / "shards.json").read_text())["r1-s0"]
            assert (saved["kv_events"], saved["kv_events_endpoint"]) == (True, endpoint)
            assert "kv_events_port" not in saved
            assert sorted(hub.feeds) == ["r1-s0"]
            await manager.stop("r1-s0")
            assert "r1-s0" not in hub.feeds
            assert [(m.shard_id, m.cleared) for m in sender.sent] == [("r1-s0", True)]
        finally:
            await manager.stop_all()
            await manager.close()
            await hub.aclose()

    asyncio.run(main())


def test_an_adopting_agent_subscribes_to_the_recorded_endpoint(tmp_path: Path) -> None:
    async def main() -> None:
        first = KvEventsHub(Sender(), state_dir=tmp_path)
        manager = ShardManager(tmp_path, IdleRuntime(), lambda shard: None, kv_events=first)
        await manager.open()
        await manager.start(kv_order(shard_id="r9-s0"))  # its engine ends while no agent runs
        endpoint = (await manager.start(kv_order())).kv_events_endpoint
        await manager.close()  # the agent goes; the engines run on
        await first.aclose()
        records = json.loads((tmp_path / "shards.json").read_text())
        del records["r9-s0"]
        (tmp_path / "shards.json").write_text(json.dumps(records))
        hub = KvEventsHub(Sender(), state_dir=tmp_path)
        again = ShardManager(tmp_path, IdleRuntime(), lambda shard: None, kv_events=hub)
        await again.open()
        try:
            (adopted,), dead = await again.adopt_all()
            assert dead == [] and adopted.state == ShardState.STARTING
            assert adopted.kv_events_endpoint == endpoint == hub.feeds["r1-s0"].endpoint
            assert adopted.spec.kv_events
            # The directory of the shard that is gone went with it.
            assert [d.name for d in (tmp_path / "kv").iterdir()] == [
                kv_socket_dir(tmp_path, "r1-s0").name
            ]
        finally:
            await again.stop_all()
            await again.close()
            await hub.aclose()

    asyncio.run(main())


def test_a_failing_launch_closes_the_shards_socket(tmp_path: Path) -> None:
    async def main() -> None:
        hub = KvEventsHub(Sender(), state_dir=tmp_path)
        manager = ShardManager(tmp_path, IdleRuntime(), lambda shard: None, kv_events=hub)
        with pytest.raises(Exception, match="publishes no KV cache events"):
            await manager.start(kv_order(engine="llamacpp", source="/m.gguf"))
        assert hub.feeds == {}
        assert not kv_socket_dir(tmp_path, "r1-s0").exists()
        await hub.aclose()

    asyncio.run(main())


def test_the_record_keeps_the_kv_events_endpoint_and_reads_an_older_agents_port() -> None:
    record = ShardRecord(
        "r1-s0", "r1", "m", "sim", kv_events=True, kv_events_endpoint="ipc:///s/kv/ab/kv.sock"
    )
    data = record_json(record)
    assert "kv_events_port" not in data
    assert parse_record("r1-s0", data) == record
    older = {k: v for k, v in data.items() if not k.startswith("kv_events")}
    assert parse_record("r1-s0", older).kv_events_endpoint == ""  # before kv events
    legacy = {**older, "kv_events": True, "kv_events_port": 40123}  # the TCP channel's
    assert parse_record("r1-s0", legacy).kv_events_port == 40123
    with pytest.raises(ValueError, match="'kv_events_port' 70000 is not a port"):
        parse_record("r1-s0", {**data, "kv_events_port": 70000})
    with pytest.raises(ValueError, match="'kv_events_endpoint' is a int"):
        parse_record("r1-s0", {**data, "kv_events_endpoint": 5})


def test_containers_carry_no_kv_events_config() -> None:
    def launch(spec: ShardSpec) -> Launch:
        return launch_for(
            spec,
            port=41000,
            log_path=Path("/tmp/x.log"),
            node_id="n1",
            cluster_id="c",
            images={"sim": "llmgw-sim:0.1"},
        )

    # The hub hands a docker shard no endpoint; in the host's network or not, no flag.
    multi = launch(kv_order(nodes=2, dist_init_addr="10.0.0.1:29500"))
    assert multi.host_network and "--kv-events-config" not in multi.argv
    assert "--kv-events-config" not in launch(kv_order()).argv


def test_the_module_docstrings_state_the_measured_figure_and_docker() -> None:
    assert "0.04 %" in (kvmap_module.__doc__ or "")
    assert "docker" in (kvevents_module.__doc__ or "")
