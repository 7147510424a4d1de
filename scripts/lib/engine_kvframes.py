"""KV cache events as the engine's own publisher sends them, to the ``ipc://`` endpoint llmgw
gives it, written out as a fixture (JSON on stdout) for llmgw's decoder tests.

Run with the Python that has the engine installed (scripts/capture-engine-help.sh does):
``python engine_kvframes.py vllm CONFIG_JSON``, CONFIG_JSON being the ``--kv-events-config``
llmgw builds for a shard (``llmgw.agent.kvevents.engine_config``), whose endpoint is in a
socket directory the agent's code made (``llmgw.agent.kvsockets.prepare_socket_dir``).

The publisher is made the way the engine's scheduler makes it (vLLM:
``EventPublisherFactory.create(KVEventsConfig, data_parallel_index)`` in
vllm/v1/core/sched/scheduler.py; SGLang: ``EventPublisherFactory.create(json, dp_rank)`` in
sglang/srt/managers/scheduler_components/kv_events_publisher.py). It must bind the endpoint:
the socket file must exist before anyone dials it, and a SUB socket that connects (as the
agent does) must receive what it publishes. The events are the engine's own structs, with
block hashes from its own hash functions; their values are described beside the frames.
Exits 1, saying why, when the publisher does not bind or nothing arrives.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import zmq

TOKENS = list(range(1000, 1032))  # two blocks of 16
BLOCK = 16


def vllm_events() -> tuple[Any, Any, dict[str, Any]]:
    from vllm.config.kv_events import KVEventsConfig
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventPublisherFactory,
        KVEventBatch,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        hash_block_tokens,
        init_none_hash,
        maybe_convert_block_hash,
    )

    config = KVEventsConfig(**json.loads(sys.argv[2]))
    publisher = EventPublisherFactory.create(config, 0)
    sha256 = get_hash_fn_by_name("sha256")  # --prefix-caching-hash-algo's default
    init_none_hash(sha256)
    first = hash_block_tokens(sha256, None, TOKENS[:BLOCK])
    second = hash_block_tokens(sha256, first, TOKENS[BLOCK:])
    hashes = [maybe_convert_block_hash(first), maybe_convert_block_hash(second)]
    batch = KVEventBatch(
        ts=time.time(),
        events=[
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=TOKENS,
                block_size=BLOCK,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            BlockRemoved(block_hashes=hashes[1:], medium="GPU"),
            AllBlocksCleared(),
        ],
    )
    expect = {
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [_show(h) for h in hashes],
                "parent_block_hash": None,
                "token_ids": TOKENS,
                "block_size": BLOCK,
                "medium": "GPU",
            },
            {"type": "BlockRemoved", "block_hashes": [_show(hashes[1])], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        "data_parallel_rank": 0,
    }
    return publisher, batch, expect


def sglang_events() -> tuple[Any, Any, dict[str, Any]]:
    from sglang.srt.disaggregation.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventPublisherFactory,
        KVEventBatch,
        StorageMedium,
    )
    from sglang.srt.mem_cache.utils import get_hash_str, hash_str_to_int64

    publisher = EventPublisherFactory.create(sys.argv[2], 0)
    # One event a page, chained by the previous page's hash (mem_cache/events.py).
    first_str = get_hash_str(TOKENS[:BLOCK])
    second_str = get_hash_str(TOKENS[BLOCK:], first_str)
    first, second = hash_str_to_int64(first_str), hash_str_to_int64(second_str)
    events = [
        BlockStored(
            block_hashes=[first],
            parent_block_hash=None,
            token_ids=TOKENS[:BLOCK],
            block_size=BLOCK,
            lora_id=None,
            medium=StorageMedium.GPU,
        ),
        BlockStored(
            block_hashes=[second],
            parent_block_hash=first,
            token_ids=TOKENS[BLOCK:],
            block_size=BLOCK,
            lora_id=None,
            medium=StorageMedium.GPU,
        ),
        BlockRemoved(block_hashes=[second], medium=StorageMedium.GPU),
        AllBlocksCleared(),
    ]
    batch = KVEventBatch(ts=time.time(), events=events)
    expect = {
        "events": [
            {
                "type": "BlockStored",
                "block_hashes": [first],
                "parent_block_hash": None,
                "token_ids": TOKENS[:BLOCK],
                "block_size": BLOCK,
                "medium": "GPU",
            },
            {
                "type": "BlockStored",
                "block_hashes": [second],
                "parent_block_hash": first,
                "token_ids": TOKENS[BLOCK:],
                "block_size": BLOCK,
                "medium": "GPU",
            },
            {"type": "BlockRemoved", "block_hashes": [second], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        "data_parallel_rank": 0,
    }
    return publisher, batch, expect


def _show(block_hash: bytes | int) -> str | int:
    return {"hex": block_hash.hex()} if isinstance(block_hash, bytes) else block_hash  # type: ignore[return-value]


def main(engine: str) -> int:
    config = json.loads(sys.argv[2])
    endpoint = config["endpoint"]
    path = endpoint.removeprefix("ipc://")
    publisher, batch, expect = {"vllm": vllm_events, "sglang": sglang_events}[engine]()
    if not os.path.exists(path):
        print(f"the {engine} publisher did not bind {endpoint} (no socket file)", file=sys.stderr)
        return 1
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, config["topic"].encode())
    sub.connect(endpoint)  # as the agent dials it
    time.sleep(0.5)  # a PUB drops what it sends before the SUB has joined
    publisher.publish(batch)
    if not sub.poll(10_000):
        print(f"nothing arrived from the {engine} publisher at {endpoint}", file=sys.stderr)
        return 1
    frames = sub.recv_multipart()
    publisher.shutdown()
    module = __import__(engine)
    json.dump(
        {
            "engine": engine,
            "version": module.__version__,
            "endpoint": endpoint,
            "frames_hex": [frame.hex() for frame in frames],
            "expect": {"topic": config["topic"], "seq": 0, **expect},
        },
        sys.stdout,
        indent=1,
    )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("vllm", "sglang"):
        sys.exit("usage: engine_kvframes.py vllm|sglang CONFIG_JSON")
    sys.exit(main(sys.argv[1]))
