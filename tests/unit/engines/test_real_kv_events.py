"""KV cache events as the real engines send them: frames captured from vLLM's and SGLang's own
publishers (their structs, their block hashes, their msgpack), bound to the ipc:// endpoint
llmgw gives a shard and dialled as the agent dials it (scripts/capture-engine-help.sh; the
releases are in tests/fixtures/engines/help/VERSIONS). llmgw must read them and key their
blocks as the gateway keys a prompt's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.kvmap import BlockMap, Pending
from llmgw.contracts.kvblocks import block_keys
from llmgw.engines.kvevents import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    Event,
    decode_batch,
    parse_frames,
)

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "engines"
ENGINES = ("vllm", "sglang")


def _capture(engine: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "kvevents" / f"{engine}.json").read_text())
    return data


def _hash(value: int | dict[str, str]) -> BlockHash:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) else value


def _expected(event: dict[str, Any]) -> Event:
    if event["type"] == "BlockStored":
        parent = event["parent_block_hash"]
        return BlockStored(
            tuple(_hash(h) for h in event["block_hashes"]),
            None if parent is None else _hash(parent),
            tuple(event["token_ids"]),
            event["block_size"],
            None,
            event["medium"],
        )
    if event["type"] == "BlockRemoved":
        return BlockRemoved(tuple(_hash(h) for h in event["block_hashes"]), event["medium"])
    return AllBlocksCleared()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_captured_releases_are_named(engine: str) -> None:
    versions = (FIXTURES / "help" / "VERSIONS").read_text()
    assert f"{engine} {_capture(engine)['version']}" in versions


@pytest.mark.parametrize("engine", ENGINES)
def test_llmgw_reads_the_engines_own_frames(engine: str) -> None:
    capture = _capture(engine)
    expect = capture["expect"]
    assert capture["endpoint"].startswith("ipc://")  # the engine bound llmgw's socket
    frames = parse_frames([bytes.fromhex(frame) for frame in capture["frames_hex"]])
    assert (frames.topic, frames.seq) == (expect["topic"], expect["seq"])
    batch = decode_batch(frames.payload)
    assert batch.data_parallel_rank == expect["data_parallel_rank"]
    assert batch.events == tuple(_expected(event) for event in expect["events"])


def test_vllm_sends_maps_of_events_and_integer_hashes_by_default() -> None:
    # vLLM 0.34: tagged maps (no array_like) and VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES on by
    # default, so a hash is an unsigned 64-bit integer, not 32 bytes of SHA-256.
    batch = decode_batch(
        parse_frames([bytes.fromhex(f) for f in _capture("vllm")["frames_hex"]]).payload
    )
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    assert all(isinstance(h, int) for h in stored.block_hashes)
    assert max(h for h in stored.block_hashes if isinstance(h, int)) >= 2**63


def test_sglang_sends_one_page_an_event_with_signed_hashes() -> None:
    batch = decode_batch(
        parse_frames([bytes.fromhex(f) for f in _capture("sglang")["frames_hex"]]).payload
    )
    first, second = batch.events[:2]
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert len(first.block_hashes) == len(second.block_hashes) == 1
    assert second.parent_block_hash == first.block_hashes[0]
    assert any(isinstance(h, int) and h < 0 for h in (*first.block_hashes, *second.block_hashes))


@pytest.mark.parametrize("engine", ENGINES)
def test_the_agent_keys_the_engines_blocks_as_the_gateway_keys_the_prompt(engine: str) -> None:
    capture = _capture(engine)
    batch = decode_batch(parse_frames([bytes.fromhex(f) for f in capture["frames_hex"]]).payload)
    tokens = [t for e in capture["expect"]["events"] if "token_ids" in e for t in e["token_ids"]]
    first, second = block_keys(tokens, 16)
    blocks, pending = BlockMap(), Pending()
    events = list(batch.events)
    while isinstance(events[0], BlockStored):
        blocks.apply(events.pop(0), pending)
    assert list(pending.stored) == [first, second] and pending.lost == 0
    assert blocks.held() == [first, second]
    blocks.apply(events.pop(0), pending)  # BlockRemoved: the second block
    assert list(pending.stored) == [first] and blocks.held() == [first]
    blocks.apply(events.pop(0), pending)  # AllBlocksCleared
    assert pending.cleared and not blocks.held() and not events
