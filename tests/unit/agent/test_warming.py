"""The agent's warmer: the sources the leader names read into the page cache, again each
interval, a dropped one stopped, nothing read outside models_root/cache_root, none while the
node is short of memory; and the stream hands it each HeartbeatAck's set."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmgw.agent import warming
from llmgw.agent.models_dir import SourceStore
from llmgw.agent.oplog import OperationLog
from llmgw.agent.stream import Credentials, StreamClient
from llmgw.agent.warming import Warmer, read_into_cache
from llmgw.proto import control_pb2 as pb

MIB = 1024**2
PLENTY = 1 << 50


def _weights(root: Path, name: str = "llama", files: int = 2, size: int = MIB) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"part-{i}.safetensors").write_bytes(os.urandom(size))
    return folder


def _warmer(tmp_path: Path, **kw: Any) -> tuple[Warmer, Path]:
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    store = SourceStore(models, tmp_path / "cache")
    kw.setdefault("memory", lambda: PLENTY)
    return Warmer(store, **kw), models


def test_a_named_folder_is_read_whole_and_reported_warm(tmp_path: Path) -> None:
    changes: list[list[pb.WarmStatus]] = []
    warmer, models = _warmer(tmp_path)

    async def changed() -> None:
        changes.append(warmer.status())

    warmer.on_change = changed
    _weights(models, files=3, size=MIB)
    warmer.want([("llama", "")])
    assert [(s.source, s.state) for s in warmer.status()] == [("llama", "warming")]
    assert asyncio.run(warmer.warm("llama")) == "warm"
    (status,) = warmer.status()
    assert (status.state, status.reason, status.bytes) == ("warm", "", 3 * MIB)
    assert status.pass_seconds > 0 and abs(status.last_pass_at - time.time()) < 60
    assert [c[0].state for c in changes] == ["warm"]  # told once, when it turned warm
    # An absolute path under models_root names the same files.
    warmer.want([(str(models / "llama"), "")])
    assert asyncio.run(warmer.warm(str(models / "llama"))) == "warm"
    # A source not in the set is not read.
    assert asyncio.run(warmer.warm("llama")) == ""


def test_it_is_read_again_each_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    passes: list[float] = []
    real = warming.read_into_cache

    def counting(*args: Any, **kw: Any) -> bool:
        passes.append(time.monotonic())
        return real(*args, **kw)

    monkeypatch.setattr(warming, "read_into_cache", counting)
    warmer, models = _warmer(tmp_path, interval=0.2)
    _weights(models, files=1, size=64 * 1024)

    async def main() -> None:
        task = asyncio.create_task(warmer.run())
        warmer.want([("llama", "")])
        deadline = time.monotonic() + 10
        while len(passes) < 3 and time.monotonic() < deadline:  # noqa: ASYNC110 - bounded poll
            await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(main())
    assert len(passes) >= 3
    assert passes[2] - passes[1] >= 0.15  # not before its interval
    assert warmer.status()[0].state == "warm"


def test_a_source_dropped_from_the_set_stops_within_a_chunk(tmp_path: Path) -> None:
    # 8 MiB at 1 MiB a second would take 8 s; dropped after 0.3 s it stops at once.
    warmer, models = _warmer(tmp_path, rate=MIB, chunk=64 * 1024)
    _weights(models, files=1, size=8 * MIB)

    async def main() -> float:
        warmer.want([("llama", "")])
        task = asyncio.create_task(warmer.warm("llama"))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        warmer.want([])
        await asyncio.wait_for(task, timeout=5)
        return time.monotonic() - started

    assert asyncio.run(main()) < 3
    assert warmer.status() == []


def test_the_rate_cap_holds_the_read_back(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(2 * MIB))
    started = time.monotonic()
    files = [(str(path), 2 * MIB)]
    assert read_into_cache(files, rate=4 * MIB, stop=threading.Event(), chunk=MIB)
    assert time.monotonic() - started >= 0.2  # 2 MiB at 4 MiB/s: about 0.5 s, never at once
    stopped = threading.Event()
    stopped.set()
    assert not read_into_cache(files, rate=4 * MIB, stop=stopped, chunk=MIB)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("/etc", "is not under this node's models_root"),
        ("../outside", "is not one this node takes"),
        ("missing", "no source missing under models_root"),
    ],
)
def test_a_source_outside_models_root_or_missing_is_skipped_with_why(
    tmp_path: Path, source: str, words: str
) -> None:
    warmer, _models = _warmer(tmp_path)
    warmer.want([(source, "")])
    assert asyncio.run(warmer.warm(source)) == "skipped"
    (status,) = warmer.status()
    assert words in status.reason, status.reason
    assert status.bytes == 0


def test_a_link_inside_a_source_that_leads_out_is_not_read(tmp_path: Path) -> None:
    warmer, models = _warmer(tmp_path)
    folder = _weights(models, files=1, size=MIB)
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 4096)
    (folder / "link").symlink_to(secret)
    warmer.want([("llama", "")])
    assert asyncio.run(warmer.warm("llama")) == "warm"
    assert warmer.status()[0].bytes == MIB  # the 4 KiB outside was neither counted nor read


def test_a_link_named_as_the_source_that_leads_out_is_refused(tmp_path: Path) -> None:
    warmer, models = _warmer(tmp_path)
    elsewhere = _weights(tmp_path / "elsewhere")
    (models / "llama").symlink_to(elsewhere)
    warmer.want([("llama", "")])
    assert asyncio.run(warmer.warm("llama")) == "skipped"
    assert "leads outside models_root" in warmer.status()[0].reason


def test_nothing_is_read_while_the_node_is_short_of_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    free = [2 * MIB]
    warmer, models = _warmer(tmp_path, memory=lambda: free[0], margin=MIB)
    _weights(models, files=2, size=MIB)

    def no_read(*_a: Any, **_k: Any) -> bool:
        raise AssertionError("read while short of memory")

    monkeypatch.setattr(warming, "read_into_cache", no_read)
    warmer.want([("llama", "")])
    assert asyncio.run(warmer.warm("llama")) == "skipped"
    (status,) = warmer.status()
    assert status.reason.startswith("the node is short of memory: 2.0 MiB available, ")
    assert "needs 2.0 MiB and a margin of 1.0 MiB" in status.reason
    assert status.bytes == 2 * MIB
    monkeypatch.undo()
    free[0] = PLENTY
    assert asyncio.run(warmer.warm("llama")) == "warm"
    assert warmer.status()[0].reason == ""


def test_a_url_source_not_fetched_yet_is_not_fetched_for_this(tmp_path: Path) -> None:
    warmer, _models = _warmer(tmp_path)
    url, sha = "https://example.com/m.gguf", "a" * 64
    warmer.want([(url, sha)])
    assert asyncio.run(warmer.warm(url, sha)) == "skipped"
    assert warmer.status()[0].reason.startswith("not fetched here yet")
    # Once a shard's start fetched it into cache_root, it is warmed from there.
    cached = tmp_path / "cache" / "sources" / sha / "m.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"w" * MIB)
    assert asyncio.run(warmer.warm(url, sha)) == "warm"
    assert warmer.status()[0].bytes == MIB


def test_the_set_is_bounded(tmp_path: Path) -> None:
    warmer, _models = _warmer(tmp_path)
    warmer.want([(f"m{i}", "") for i in range(warming.MAX_WARM_SOURCES + 5)])
    assert len(warmer.status()) == warming.MAX_WARM_SOURCES


def _stream(on_warm: Any) -> StreamClient:
    client = StreamClient(
        node_id="gpu-1",
        servers=cast(Any, SimpleNamespace()),
        credentials=lambda: Credentials(b"", b"", b""),
        shards=cast(Any, SimpleNamespace(snapshot=list)),
        oplog=cast(OperationLog, SimpleNamespace()),
        inventory=pb.Inventory,
        dataplane_addr=lambda server: "",
        on_warm=on_warm,
    )
    client.connected_to = "cp-1:7443"
    return client


def test_the_stream_hands_the_warmer_each_acks_set() -> None:
    told: list[list[tuple[str, str]]] = []
    client = _stream(told.append)
    sources = [pb.WarmSource(source="llama"), pb.WarmSource(source="https://x/m", sha256="b" * 64)]
    ack = pb.HeartbeatAck(seq=1, warm=pb.WarmSources(sources=sources))
    client._on_message(pb.ServerMessage(heartbeat_ack=ack), "cp-1:7443")
    assert told == [[("llama", ""), ("https://x/m", "b" * 64)]]
    # An empty set is a set: warm nothing.
    empty = pb.HeartbeatAck(seq=2, warm=pb.WarmSources())
    client._on_message(pb.ServerMessage(heartbeat_ack=empty), "cp-1:7443")
    assert told[-1] == []
    # An ack that says nothing of it (an older control plane) leaves the set alone, and so
    # does one from a server that did not welcome us.
    client._on_message(pb.ServerMessage(heartbeat_ack=pb.HeartbeatAck(seq=3)), "cp-1:7443")
    client._on_message(pb.ServerMessage(heartbeat_ack=ack), "cp-2:7443")
    assert len(told) == 2


def test_the_warm_statuses_and_the_set_survive_the_wire() -> None:
    status = pb.WarmStatus(
        source="llama", state="warm", bytes=5, pass_seconds=1.5, last_pass_at=1e9
    )
    back = pb.Inventory.FromString(pb.Inventory(warm=[status]).SerializeToString())
    assert list(back.warm) == [status]
    ack = pb.HeartbeatAck(seq=1, warm=pb.WarmSources(sources=[pb.WarmSource(source="a")]))
    got = pb.HeartbeatAck.FromString(ack.SerializeToString())
    assert got.HasField("warm") and got.warm.sources[0].source == "a"
    plain = pb.HeartbeatAck.FromString(pb.HeartbeatAck(seq=1).SerializeToString())
    assert not plain.HasField("warm")


def test_the_inventory_is_told_when_a_source_leaves_the_set(tmp_path: Path) -> None:
    warmer, models = _warmer(tmp_path)
    _weights(models, files=1, size=64 * 1024)
    told: list[list[str]] = []

    async def changed() -> None:
        told.append([s.source for s in warmer.status()])

    warmer.on_change = changed

    async def main() -> None:
        task = asyncio.create_task(warmer.run())
        warmer.want([("llama", "")])
        await asyncio.wait_for(_until(lambda: told == [["llama"]]), timeout=10)
        warmer.want([])
        await asyncio.wait_for(_until(lambda: told[-1:] == [[]]), timeout=10)
        task.cancel()

    asyncio.run(main())


async def _until(done: Any) -> None:
    while not done():  # noqa: ASYNC110 - bounded by the caller's wait_for
        await asyncio.sleep(0.02)
