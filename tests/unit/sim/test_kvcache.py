"""The sim engine's prefix cache (keys, hits, LRU eviction, events), its KV event publisher
over real ZeroMQ sockets, its prefill lane, and the refusals of their settings."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import socket
import time
import urllib.request
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
import zmq
from click.testing import CliRunner
from zmq.utils.monitor import recv_monitor_message

from llmgw.cli import engine as engine_cli
from llmgw.engines.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    events_config,
    parse_frames,
)
from llmgw.errors import EngineError
from llmgw.sim.config import KvEventsSettings, SimConfig, kv_events_settings
from llmgw.sim.generate import tokenize
from llmgw.sim.kvcache import NONE_HASH, PrefixCache, block_hashes
from llmgw.sim.protocol import chat_prompt
from llmgw.sim.publisher import EventPublisher
from tests.unit.sim.running import running

MODEL = "llmgw-sim"
GPU = "GPU"


def post(url: str, body: Any) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        data = resp.read()
        return json.loads(data) if data else {}


def complete(url: str, prompt: str | list[str], **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
    return post(f"{url}/v1/completions", body)


def words(n: int, start: int = 0) -> str:
    """A prompt of exactly ``n`` sim tokens (known words, each one token)."""
    vocab = ["river", "stone", "bridge", "road", "valley", "forest", "cloud", "music"]
    text = " ".join(vocab[(start + i) % len(vocab)] for i in range(n))
    assert len(tokenize(text)) == n
    return text


# ------------------------------------------------------------------ the block hashes


def test_block_hashes_chain_sha256_from_the_process_seed() -> None:
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    assert len(NONE_HASH) == 32 and len(hashes) == 2  # the partial block [8, 9] has none
    first = hashlib.sha256(NONE_HASH + array("I", range(4)).tobytes()).digest()
    second = hashlib.sha256(first + array("I", range(4, 8)).tobytes()).digest()
    assert hashes == [first, second]
    assert block_hashes(tokens, 4, seed=bytes(32)) != hashes  # another engine's seed
    assert block_hashes(tokens[:3], 4) == []
    assert block_hashes([9, 9, 9, 9], 4) != block_hashes([9, 9, 9, 8], 4)


# ------------------------------------------------------------------ the cache itself


def test_lookup_counts_leading_blocks_and_stores_the_rest() -> None:
    cache = PrefixCache(block_size=4, capacity=100)
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    first = cache.lookup(tokens)
    assert first.cached_tokens == 0
    assert first.events == [BlockStored(tuple(hashes), None, tuple(range(8)), 4, None, GPU)]
    again = cache.lookup(tokens)
    assert (again.cached_tokens, again.events) == (8, [])
    # A longer prompt with the same prefix: its two blocks hit, the third is stored as the
    # child of the second.
    longer = [*range(8), 50, 51, 52, 53, 54]
    found = cache.lookup(longer)
    third = block_hashes(longer, 4)[2]
    assert found.cached_tokens == 8
    assert found.events == [BlockStored((third,), hashes[1], (50, 51, 52, 53), 4, None, GPU)]
    # A different first block shares nothing, though its later tokens are the same.
    other = cache.lookup([99, *range(1, 10)])
    assert other.cached_tokens == 0 and len(other.events) == 1


def test_eviction_is_least_recently_used_first() -> None:
    cache = PrefixCache(block_size=2, capacity=2)
    a, b, c = [1, 1], [2, 2], [3, 3]
    (ha,), (hb,), (hc,) = (block_hashes(t, 2) for t in (a, b, c))
    cache.lookup(a)
    cache.lookup(b)
    assert cache.lookup(a).cached_tokens == 2  # A touched: B is now the least recent
    stored_c = cache.lookup(c)
    assert stored_c.cached_tokens == 0
    assert stored_c.events == [
        BlockRemoved((hb,), GPU),
        BlockStored((hc,), None, (3, 3), 2, None, GPU),
    ]
    assert ha in cache and hc in cache and hb not in cache
    assert cache.lookup(a).cached_tokens == 2
    assert cache.lookup(b).cached_tokens == 0  # evicted: stored again, C goes (A was touched)
    assert hc not in cache and len(cache) == 2


def test_a_prompt_never_evicts_its_own_blocks() -> None:
    cache = PrefixCache(block_size=1, capacity=3)
    cache.lookup([7])
    found = cache.lookup([1, 2, 3, 4, 5])
    hashes = block_hashes([1, 2, 3, 4, 5], 1)
    # The foreign block goes; of the prompt's five blocks only the first three fit.
    assert found.events == [
        BlockRemoved(tuple(block_hashes([7], 1)), GPU),
        BlockStored(tuple(hashes[:3]), None, (1, 2, 3), 1, None, GPU),
    ]
    assert len(cache) == 3
    assert cache.lookup([1, 2, 3, 4, 5]).cached_tokens == 3
    assert len(cache) == 3


def test_a_hit_stops_at_the_first_missing_block() -> None:
    cache = PrefixCache(block_size=1, capacity=3)
    tokens = [1, 2, 3]
    h = block_hashes(tokens, 1)
    cache.lookup(tokens)
    cache.lookup([9])  # evicts block 1 (the least recent): 2 and 3 stay, parentless
    assert h[0] not in cache and h[1] in cache and h[2] in cache
    found = cache.lookup(tokens)
    assert found.cached_tokens == 0  # block 2 is there, but its parent is not
    # Only the missing block is stored again (the foreign one evicted for it).
    assert found.events == [
        BlockRemoved(tuple(block_hashes([9], 1)), GPU),
        BlockStored((h[0],), None, (1,), 1, None, GPU),
    ]
    assert cache.lookup(tokens).cached_tokens == 3


def test_a_run_of_new_blocks_after_a_kept_one_has_that_block_as_parent() -> None:
    cache = PrefixCache(block_size=1, capacity=10)
    h = block_hashes([1, 2, 3, 4], 1)
    cache.lookup([1, 2])
    cache._blocks.pop(h[0])  # as if block 1 alone had been evicted
    found = cache.lookup([1, 2, 3, 4])
    assert found.events == [
        BlockStored((h[0],), None, (1,), 1, None, GPU),
        BlockStored((h[2], h[3]), h[1], (3, 4), 1, None, GPU),
    ]


def test_clear_empties_the_cache_once() -> None:
    cache = PrefixCache(block_size=2, capacity=4)
    assert cache.clear() == []
    cache.lookup([1, 2, 3, 4])
    assert cache.clear() == [AllBlocksCleared()]
    assert len(cache) == 0 and cache.lookup([1, 2, 3, 4]).cached_tokens == 0


# ------------------------------------------------------------------ through the server


def test_the_same_prefix_twice_reports_its_full_blocks_cached() -> None:
    prefix = words(40)  # two full blocks of 16, and 8 tokens more
    with running(SimConfig(port=0)) as url:
        first = complete(url, prefix + " end")
        assert first["usage"]["prompt_tokens"] == 41
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = complete(url, prefix + " sea")
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        # Chat: the template's text is cached the same way, and the streamed usage says so.
        messages = [
            {"role": "system", "content": words(20, start=5)},
            {"role": "user", "content": "hi"},
        ]
        assert len(tokenize(chat_prompt(messages))) == 23  # a newline and "hi": 3 bytes
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        whole = post(f"{url}/v1/chat/completions", body)
        assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        streamed = _stream_usage(
            f"{url}/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}
        )
        assert streamed["prompt_tokens"] == 23
        assert streamed["prompt_tokens_details"] == {"cached_tokens": 16}
        # A list of prompts: each looked up in turn (the second hits what the first stored);
        # n > 1 looks each prompt up once.
        fresh = words(16, start=3)
        listed = complete(url, [fresh, fresh], n=3)
        assert listed["usage"]["prompt_tokens"] == 32
        assert listed["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


def _stream_usage(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        events = resp.read().decode().split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e and e != "data: [DONE]"]
    assert chunks[-1]["choices"] == []
    usage: dict[str, Any] = chunks[-1]["usage"]
    return usage


# ------------------------------------------------------------------ the events


@dataclass
class Subscriber:
    """A SUB socket bound on a random loopback port, as the agent binds one, and a monitor
    of it that tells when a publisher has joined."""

    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    endpoint: str

    def joined(self) -> None:
        """Wait for a publisher to have connected."""
        _handshake(self.sub, self.monitor)


@pytest.fixture
def subscriber() -> Iterator[Subscriber]:
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        yield Subscriber(sub, monitor, f"tcp://127.0.0.1:{port}")
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)
        context.term()


def _handshake(sub: zmq.Socket[bytes], monitor: zmq.Socket[bytes]) -> None:
    """Wait for a publisher to have joined ``sub`` (``monitor`` watches it)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if monitor.poll(1000):
            if recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # A socket takes in a new peer (and so sends it its subscription) only when
                # its own thread next uses it: until then the publisher drops every message.
                sub.poll(100)
                time.sleep(0.3)
                return
    raise AssertionError("the engine's publisher did not connect within 10s")


def _batches(sub: zmq.Socket[bytes], count: int, topic: str) -> list[tuple[int, EventBatch]]:
    out = []
    for _ in range(count):
        frames = parse_frames(sub.recv_multipart())
        assert frames.topic == topic
        out.append((frames.seq, decode_batch(frames.payload)))
    return out


def test_events_match_the_blocks_stored_and_removed(subscriber: Subscriber) -> None:
    sub, endpoint = subscriber.sub, subscriber.endpoint
    cfg = SimConfig(
        port=0, block_size=4, kv_blocks=4, kv_events_config=events_config(endpoint, "kv@r1")
    )
    a, b = words(9), words(12, start=4)
    ta, tb = tokenize(a), tokenize(b)
    ha, hb = block_hashes(ta, 4), block_hashes(tb, 4)
    with running(cfg) as url:
        subscriber.joined()
        before = time.time()
        complete(url, a)  # stores A's 2 blocks
        assert complete(url, a)["usage"]["prompt_tokens_details"] == {"cached_tokens": 8}
        complete(url, b)  # 3 blocks: one of A's goes (its first, the least recent)
        post(f"{url}/reset_prefix_cache", {})
        batches = _batches(sub, 3, "kv@r1")
        after = time.time()
        complete(url, b)  # a cold cache again: the next batch follows with no gap
        (last,) = _batches(sub, 1, "kv@r1")
    assert [seq for seq, _ in batches] == [0, 1, 2] and last[0] == 3
    (_, b0), (_, b1), (_, b2) = batches
    assert b0.events == (BlockStored(tuple(ha), None, tuple(ta[:8]), 4, None, GPU),)
    assert b1.events == (
        BlockRemoved((ha[0],), GPU),
        BlockStored(tuple(hb), None, tuple(tb), 4, None, GPU),
    )
    assert b2.events == (AllBlocksCleared(),)
    assert last[1].events == (BlockStored(tuple(hb), None, tuple(tb), 4, None, GPU),)
    assert all(before <= batch.ts <= after for _, batch in batches)
    assert b0.data_parallel_rank is None


def test_a_binding_publisher_is_dialled_by_its_subscriber(tmp_path: Any) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    publisher = EventPublisher(KvEventsSettings(endpoint, "t"))
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVTIMEO, 10_000)
    sub.setsockopt(zmq.SUBSCRIBE, b"t")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        _handshake(sub, monitor)
        assert publisher.publish([AllBlocksCleared()])
        topic, seq, payload = sub.recv_multipart()
        assert (topic, seq) == (b"t", (0).to_bytes(8, "big"))
        assert decode_batch(payload).events == (AllBlocksCleared(),)
        assert publisher.sequence == 1
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)
        context.term()
        publisher.close()
    publisher.close()  # a second close is a no-op


def test_an_endpoint_it_cannot_bind_is_an_engine_error() -> None:
    context = zmq.Context()
    holder = context.socket(zmq.PUB)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(
            EngineError, match=rf"cannot bind the KV events endpoint tcp://\*:{port}"
        ):
            EventPublisher(KvEventsSettings(f"tcp://*:{port}"))
        # And the engine does not start: serve raises it.
        cfg = SimConfig(port=0, kv_events_config=events_config(f"tcp://*:{port}", ""))
        with pytest.raises(EngineError, match="cannot bind"), running(cfg):
            pass
    finally:
        holder.close(0)
        context.term()


def test_the_engine_lets_go_of_its_endpoint_when_it_stops() -> None:
    with socket.socket() as free:
        free.bind(("", 0))
        port = free.getsockname()[1]
    endpoint = f"tcp://*:{port}"
    context = zmq.Context()
    probe = context.socket(zmq.PUB)
    probe.setsockopt(zmq.LINGER, 0)
    try:
        with running(SimConfig(port=0, kv_events_config=events_config(endpoint, "kv"))):
            with pytest.raises(zmq.ZMQError):
                probe.bind(endpoint)  # the engine holds it
        probe.bind(endpoint)  # closed on shutdown: free again
    finally:
        probe.close(0)
        context.term()


class _Full:
    """A socket whose every send would block."""

    closed = False

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        assert flags == zmq.NOBLOCK
        raise zmq.Again()

    def close(self, linger: int | None = None) -> None:
        self.closed = True


def test_a_send_that_would_block_is_dropped_counted_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    publisher = EventPublisher(KvEventsSettings("inproc://full"))
    real = publisher._socket
    publisher._socket = _Full()  # type: ignore[assignment]
    try:
        with caplog.at_level(logging.WARNING, logger="llmgw.engine.sim"):
            assert not publisher.publish([AllBlocksCleared()])
            assert not publisher.publish([AllBlocksCleared()])
        assert (publisher.dropped, publisher.sequence) == (2, 2)  # the seq is spent: a gap
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ["sim: dropped 1 KV event batch(es) to inproc://full: the subscriber "
                         "is not keeping up"]  # fmt: skip
        publisher._last_drop_log -= 61  # a minute later: the next drop is logged, with the count
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="llmgw.engine.sim"):
            publisher.publish([AllBlocksCleared()])
        assert [r.getMessage() for r in caplog.records] == [
            "sim: dropped 2 KV event batch(es) to inproc://full: the subscriber is not keeping up"
        ]
    finally:
        publisher._socket = real
        publisher.close()


# ------------------------------------------------------------------ the prefill lane


async def _first_token_at(session: aiohttp.ClientSession, url: str, prompt: str) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    loop = asyncio.get_running_loop()
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        return loop.time()


def test_prefill_is_served_one_request_at_a_time() -> None:
    # 20 ms a token: a 10-token prompt's prefill takes 200 ms.
    cfg = SimConfig(port=0, prefill_us_per_token=20_000)
    one, two = words(10), words(10, start=1)

    async def go(url: str) -> tuple[float, float, float]:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession() as session:
            start = loop.time()
            first, second = await asyncio.gather(
                _first_token_at(session, url, one), _first_token_at(session, url, two)
            )
            return start, min(first, second), max(first, second)

    with running(cfg) as url:
        start, first, second = asyncio.run(go(url))
    assert first - start >= 0.2
    assert second - start >= 0.4  # it waited for the other's prefill, then did its own
    assert second - start < 10


def test_a_cached_prompt_skips_its_prefill() -> None:
    cfg = SimConfig(port=0, block_size=1, prefill_us_per_token=20_000)
    prompt = words(30)  # 30 blocks of 1 token: 600 ms uncached, nothing once cached
    with running(cfg) as url:
        t = time.monotonic()
        assert complete(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cold = time.monotonic() - t
        t = time.monotonic()
        assert complete(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 30
        warm = time.monotonic() - t
    assert cold >= 0.6
    assert warm < cold


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_size": 0}, r"block_size must be an integer in 1\.\.1024, got 0"),
        ({"block_size": 1025}, r"block_size must be an integer in 1\.\.1024, got 1025"),
        ({"block_size": True}, r"block_size must be an integer in 1\.\.1024, got True"),
        ({"kv_blocks": 0}, r"kv_blocks must be a positive integer .*got 0"),
        ({"kv_blocks": 2.5}, r"kv_blocks must be a positive integer .*got 2\.5"),
        ({"prefill_us_per_token": -1}, r"prefill_us_per_token must be a finite number >= 0"),
        ({"prefill_us_per_token": float("inf")}, r"prefill_us_per_token must be a finite"),
        ({"prefill_us_per_token": float("nan")}, r"prefill_us_per_token must be a finite"),
        ({"prefill_us_per_token": "5"}, r"prefill_us_per_token must be a finite"),
    ],
)
def test_bad_cache_settings_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineError, match=message):
        SimConfig(**fields)


GOOD = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:1"}


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{not json", r"--kv-events-config is not valid JSON \(.*\); give e\.g\. \{"),
        ("[1]", r"--kv-events-config must be a JSON object; give e\.g\."),
        (json.dumps({**GOOD, "publisher": "kafka"}), r"publisher must be \"zmq\".*'kafka'"),
        (json.dumps({**GOOD, "publisher": "null"}), r"publisher must be \"zmq\".*'null'"),
        (
            json.dumps({"enable_kv_cache_events": True, "publisher": "zmq"}),
            r"--kv-events-config has no endpoint; name where to publish",
        ),
        (
            json.dumps({**GOOD, "endpoint": "http://127.0.0.1:1"}),
            r"endpoint must be a tcp://, ipc:// or inproc:// ZeroMQ address, got 'http://",
        ),
        (json.dumps({**GOOD, "endpoint": 5}), r"endpoint must be a tcp://.*got 5"),
        (json.dumps({**GOOD, "endpoint": "tcp://"}), r"endpoint 'tcp://' has no address"),
        (json.dumps({**GOOD, "topic": 3}), r"topic must be a string, got 3"),
        (json.dumps({**GOOD, "hwm": -1}), r"hwm must be an integer >= 0 .*got -1"),
        (json.dumps({**GOOD, "enable_kv_cache_events": "yes"}), r"must be true or false"),
        (json.dumps({**GOOD, "colour": "red"}), r"unknown key\(s\) colour; it takes .*endpoint"),
    ],
)
def test_bad_kv_events_configs_are_refused(config: str, message: str) -> None:
    with pytest.raises(EngineError, match=message):
        SimConfig(kv_events_config=config)
    result = CliRunner().invoke(engine_cli.engine, ["sim", "--kv-events-config", config])
    assert result.exit_code == 1
    assert re.search(message, result.output), result.output
    assert "Traceback" not in result.output


def test_the_cli_refuses_bad_cache_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_cli, "run", lambda cfg: pytest.fail("the engine started"))
    result = CliRunner().invoke(engine_cli.engine, ["sim", "--block-size", "0"])
    assert result.exit_code == 1
    assert "sim: block_size must be an integer in 1..1024, got 0" in result.output
    result = CliRunner().invoke(engine_cli.engine, ["sim", "--prefill-us-per-token", "-3"])
    assert result.exit_code == 1
    assert "sim: prefill_us_per_token must be a finite number >= 0, got -3.0" in result.output


def test_kv_events_settings_read_vllms_json() -> None:
    assert kv_events_settings("") is None
    assert kv_events_settings(json.dumps({"enable_kv_cache_events": False})) is None
    # Disabled, it publishes nothing, but what it says is still checked.
    with pytest.raises(EngineError, match="no endpoint"):
        kv_events_settings(json.dumps({"enable_kv_cache_events": False, "publisher": "zmq"}))
    assert kv_events_settings(events_config("tcp://*:5557", "kv")) == KvEventsSettings(
        "tcp://*:5557", "kv"
    )
    given = {**GOOD, "hwm": 10, "replay_endpoint": None, "buffer_steps": 1}
    assert kv_events_settings(json.dumps(given)) == KvEventsSettings("tcp://127.0.0.1:1", "", 10)
    assert SimConfig(kv_events_config=json.dumps(GOOD)).kv_events == KvEventsSettings(
        "tcp://127.0.0.1:1"
    )


def test_the_cli_passes_the_cache_settings_on(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[SimConfig] = []
    monkeypatch.setattr(engine_cli, "run", started.append)
    config = events_config("tcp://127.0.0.1:5557", "kv")
    args = ["sim", "--block-size", "32", "--kv-blocks", "64", "--prefill-us-per-token", "5"]
    result = CliRunner().invoke(engine_cli.engine, [*args, "--kv-events-config", config])
    assert result.exit_code == 0, result.output
    assert started == [
        SimConfig(block_size=32, kv_blocks=64, prefill_us_per_token=5.0, kv_events_config=config)
    ]


def test_the_start_up_line_names_the_cache_and_the_events(
    caplog: pytest.LogCaptureFixture, subscriber: Subscriber
) -> None:
    endpoint = subscriber.endpoint
    cfg = SimConfig(
        port=0, block_size=8, kv_blocks=100, prefill_us_per_token=2.5,
        kv_events_config=events_config(endpoint, "kv"),
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="llmgw.engine.sim"), running(cfg):
        pass
    (line,) = [r.getMessage() for r in caplog.records if "listening" in r.getMessage()]
    assert line.endswith(
        f"block_size=8 kv_blocks=100 prefill_us_per_token=2.5 kv_events={endpoint}"
    ), line
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmgw.engine.sim"), running(SimConfig(port=0)):
        pass
    (line,) = [r.getMessage() for r in caplog.records if "listening" in r.getMessage()]
    assert line.endswith("block_size=16 kv_blocks=8192 prefill_us_per_token=0 kv_events=off")
