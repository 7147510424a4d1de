"""Model sources on the node: the bounded listing of models_root the inventory reports, a
shard's source resolved inside models_root (or refused), and a URL source fetched into
cache_root, checked against its SHA-256, before a real ``sim`` engine starts. Real files in
tmp dirs, real HTTP(S) servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from llmgw import pki
from llmgw.agent.config import parse_agent_config
from llmgw.agent.installs import download_ssl_context
from llmgw.agent.inventory import collect_inventory
from llmgw.agent.models_dir import Located, SourceStore, list_sources
from llmgw.agent.runtimes.base import Launch
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.agent.shards import Shard, ShardManager, ShardSpec, ShardState
from llmgw.contracts.inventory import inventory_dict
from llmgw.contracts.model_sources import SourceSpec
from llmgw.contracts.sources import parse_prefix
from llmgw.errors import ShardError

pytestmark = pytest.mark.timeout(60)

WAIT_S = 30.0

WEIGHTS = b"GGUF" + bytes(range(256)) * 64
SHA = hashlib.sha256(WEIGHTS).hexdigest()


def tree(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def names(root: Path, **kwargs: Any) -> dict[str, tuple[int, bool]]:
    msg, _ = list_sources(root, **kwargs)
    return {e.name: (e.size_bytes, e.dir) for e in msg.entries}


# -- the listing ----------------------------------------------------------------------------


def test_the_listing_goes_three_levels_deep_with_sizes(tmp_path: Path) -> None:
    root = tmp_path / "models"
    tree(
        root,
        {
            "tiny.gguf": b"x" * 10,
            "llama/config.json": b"{}",
            "llama/model.safetensors": b"w" * 100,
            "org/model/weights.bin": b"w" * 7,
            "org/model/deeper/skipped.bin": b"w" * 1000,
            ".cache/hidden.bin": b"h",
        },
    )
    msg, warnings = list_sources(root)
    assert (msg.models_root, msg.listed_depth, msg.problem, warnings) == (str(root), 3, "", [])
    assert names(root) == {
        "llama": (102, True),
        "llama/config.json": (2, False),
        "llama/model.safetensors": (100, False),
        "org": (7, True),
        "org/model": (7, True),
        "org/model/deeper": (0, True),
        "org/model/weights.bin": (7, False),
        "tiny.gguf": (10, False),
    }
    # Name order, so that an unchanged folder gives an unchanged inventory.
    assert [e.name for e in msg.entries] == sorted(e.name for e in msg.entries)


def test_a_symlink_out_of_models_root_is_not_listed_and_is_named(tmp_path: Path) -> None:
    root = tmp_path / "models"
    tree(root, {"a/w.bin": b"1"})
    tree(tmp_path / "elsewhere", {"secret.key": b"k"})
    (root / "escape").symlink_to(tmp_path / "elsewhere")
    (root / "key.gguf").symlink_to(tmp_path / "elsewhere" / "secret.key")
    (root / "alias").symlink_to(root / "a")  # inside: listed as what it leads to
    msg, warnings = list_sources(root)
    assert sorted(e.name for e in msg.entries) == ["a", "a/w.bin", "alias", "alias/w.bin"]
    assert len(warnings) == 2 and all("leads outside models_root" in w for w in warnings)
    assert f"to {tmp_path / 'elsewhere'}" in " ".join(warnings)


def test_a_full_listing_says_how_deep_it_is_complete(tmp_path: Path) -> None:
    root = tmp_path / "models"
    tree(root, {f"m{i}/w{j}.bin": b"x" for i in range(3) for j in range(5)})
    msg, warnings = list_sources(root, max_entries=10)
    assert len(msg.entries) == 10
    # Every top-level name is there; the second level stopped part way.
    assert msg.listed_depth == 1
    assert {"m0", "m1", "m2"} <= {e.name for e in msg.entries}
    assert "holds more than 10 entries" in warnings[0]


def test_a_missing_or_unreadable_models_root_is_a_problem_not_an_empty_one(
    tmp_path: Path,
) -> None:
    msg, _ = list_sources(tmp_path / "nope")
    assert msg.problem == "it does not exist; create it and put the weights there"
    (tmp_path / "file").write_text("x")
    assert "is not a folder" in list_sources(tmp_path / "file")[0].problem
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o000)
        try:
            assert list_sources(locked)[0].problem == "Permission denied"
        finally:
            locked.chmod(0o700)


def test_the_store_reports_its_fetch_prefixes_and_cache(tmp_path: Path) -> None:
    store = SourceStore(
        tmp_path / "models",
        tmp_path / "cache",
        install_sources=(parse_prefix("file:///srv/share/"),),
    )
    (tmp_path / "cache" / "sources" / SHA).mkdir(parents=True)
    (tmp_path / "cache" / "sources" / SHA / "w.gguf").write_bytes(b"x")
    (tmp_path / "cache" / "sources" / ("cd" * 32)).mkdir()  # empty: not a cached source
    (tmp_path / "cache" / "sources" / ".tmp-x").mkdir()
    msg, _ = store.listing()
    assert (list(msg.fetch_prefixes), list(msg.cached)) == (["file:///srv/share/"], [SHA])


def test_the_inventory_carries_the_sources_and_their_warnings(
    tmp_path: Path, empty_path: Path
) -> None:
    root = tmp_path / "models"
    tree(root, {"llama/w.bin": b"w" * 3})
    (root / "out").symlink_to(tmp_path)
    cfg = parse_agent_config(
        {
            "server": "cp1",
            "state_dir": str(tmp_path / "state"),
            "models_root": str(root),
            "cache_root": str(tmp_path / "cache"),
            "install_sources": ["http://10.0.0.2:8000/models/"],
            "discovery": {"ib_root": str(tmp_path / "no-infiniband")},
        }
    )
    inv = collect_inventory(cfg)
    assert inventory_dict(inv)["sources"] == {
        "models_root": str(root),
        "entries": [
            {"name": "llama", "size_bytes": 3, "dir": True},
            {"name": "llama/w.bin", "size_bytes": 3, "dir": False},
        ],
        "listed_depth": 3,
        "fetch_prefixes": ["http://10.0.0.2:8000/models/"],
        "cached": [],
        "problem": "",
    }
    assert [w for w in inv.warnings if "leads outside models_root" in w] == [
        f"{root}/out leads outside models_root (to {tmp_path}); it is not offered as a "
        "source: move the files under models_root"
    ]


# -- a shard's source -----------------------------------------------------------------------


def store_at(tmp_path: Path, *prefixes: str, **kwargs: Any) -> SourceStore:
    root = tmp_path / "models"
    root.mkdir(exist_ok=True)
    return SourceStore(
        root,
        tmp_path / "cache",
        install_sources=tuple(parse_prefix(p) for p in prefixes),
        **kwargs,
    )


def test_a_name_or_a_path_resolves_inside_models_root(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    tree(store.models_root, {"org/llama/config.json": b"{}"})
    want = Located((store.models_root / "org" / "llama").resolve())
    assert store.locate("org/llama") == want
    assert store.locate(f"{store.models_root}/org/llama") == want


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("missing", "no source missing under models_root"),
        ("/srv/other/llama", "is not under this node's models_root"),
        ("../secret", "has an empty, '.' or '..' segment"),
        ("escape/secret.key", "leads outside models_root"),
        ("https://h.example/m.gguf", "is a URL without its SHA-256"),
    ],
)
def test_a_source_that_is_not_there_or_leaves_models_root_is_refused(
    tmp_path: Path, source: str, message: str
) -> None:
    store = store_at(tmp_path)
    tree(tmp_path / "elsewhere", {"secret.key": b"k"})
    (store.models_root / "escape").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ShardError) as caught:
        store.locate(source)
    assert message in str(caught.value)


def test_a_url_is_located_in_the_cache_and_fetched_only_when_allowed(tmp_path: Path) -> None:
    store = store_at(tmp_path, "file:///srv/share/")
    spec = SourceSpec("https://h.example/m/tiny.gguf", SHA)
    cached = tmp_path / "cache" / "sources" / SHA / "tiny.gguf"
    assert store.locate(spec.text, SHA) == Located(cached, spec)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(WEIGHTS)
    assert store.locate(spec.text, SHA) == Located(cached)  # there: nothing to fetch
    with pytest.raises(ShardError) as caught:
        store.locate("http://10.0.0.2/m/tiny.gguf", SHA)
    assert "http:// sources are fetched only from places listed in install_sources" in str(
        caught.value
    )
    with pytest.raises(ShardError) as caught:
        store.locate("https://h.example/m/tiny.gguf", "nothex")
    assert "needs sha256" in str(caught.value)


# -- fetching -------------------------------------------------------------------------------


class Site:
    """/weights.gguf (counted), /stall (headers, then nothing)."""

    def __init__(self) -> None:
        self.hits = 0
        self.base = ""

    async def weights(self, request: web.Request) -> web.Response:
        self.hits += 1
        await asyncio.sleep(0.2)  # long enough for a second fetch to wait on the first
        return web.Response(body=WEIGHTS)

    async def stall(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = len(WEIGHTS)
        await resp.prepare(request)
        await resp.write(WEIGHTS[:10])
        await asyncio.sleep(3600)
        return resp

    @contextlib.asynccontextmanager
    async def running(self, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Site]:
        app = web.Application()
        app.router.add_get("/weights.gguf", self.weights)
        app.router.add_get("/stall.gguf", self.stall)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = runner.addresses[0][1]
        self.base = f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}"
        try:
            yield self
        finally:
            await runner.cleanup()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, Path]:
    """A server context with a certificate from a cluster CA, and that CA."""
    tmp = tmp_path_factory.mktemp("tls")
    ca = pki.init_ca(tmp / "ca")
    ident = pki.issue_server_cert(ca, tmp / "srv", hosts=["127.0.0.1"])
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(ident.cert, ident.key)
    return ctx, ident.ca


def test_an_https_source_is_fetched_once_checked_and_cached(
    tmp_path: Path, tls: tuple[ssl.SSLContext, Path]
) -> None:
    server_ctx, ca = tls
    store = store_at(tmp_path, ssl_context=lambda: download_ssl_context(ca))

    async def scenario() -> None:
        async with Site().running(server_ctx) as site:
            spec = SourceSpec(f"{site.base}/weights.gguf", SHA)
            # Two shards at once: one download, both get the file.
            first, second = await asyncio.gather(store.fetch(spec), store.fetch(spec))
            assert first == second == tmp_path / "cache" / "sources" / SHA / "weights.gguf"
            assert first.read_bytes() == WEIGHTS
            assert site.hits == 1
            assert await store.fetch(spec) == first and site.hits == 1
            # Nothing left in the cache but the checked file.
            assert os.listdir(tmp_path / "cache" / "sources") == [SHA]

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_server_the_cluster_ca_did_not_sign_is_not_fetched(
    tmp_path: Path, tls: tuple[ssl.SSLContext, Path]
) -> None:
    server_ctx, _ = tls
    store = store_at(tmp_path, ssl_context=ssl.create_default_context)

    async def scenario() -> None:
        async with Site().running(server_ctx) as site:
            with pytest.raises(ShardError) as caught:
                await store.fetch(SourceSpec(f"{site.base}/weights.gguf", SHA))
            assert str(caught.value).startswith("cannot fetch model source: download of")
            assert "journalctl -u llmgw-agent" in str(caught.value)

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert os.listdir(tmp_path / "cache" / "sources") == []


def test_a_download_that_does_not_match_its_sha256_is_deleted(tmp_path: Path) -> None:
    share = tmp_path / "share"
    tree(share, {"w.gguf": WEIGHTS + b"tampered"})
    store = store_at(tmp_path, f"file://{share}/")

    async def scenario() -> None:
        with pytest.raises(ShardError) as caught:
            await store.fetch(SourceSpec(f"file://{share}/w.gguf", SHA))
        assert str(caught.value).startswith(f"checksum mismatch for source file://{share}/w.gguf")

    asyncio.run(scenario())
    assert os.listdir(tmp_path / "cache" / "sources") == []


def test_leftovers_of_an_interrupted_fetch_are_removed(tmp_path: Path) -> None:
    share = tmp_path / "share"
    tree(share, {"w.gguf": WEIGHTS})
    store = store_at(tmp_path, f"file://{share}/")
    leftover = tmp_path / "cache" / "sources" / ".tmp-old"
    leftover.mkdir(parents=True)
    (leftover / "w.gguf").write_bytes(b"half")
    asyncio.run(store.fetch(SourceSpec(f"file://{share}/w.gguf", SHA)))
    assert sorted(os.listdir(tmp_path / "cache" / "sources")) == [SHA]


# -- the step before a shard starts ---------------------------------------------------------


@dataclass(frozen=True)
class Event:
    shard_id: str
    state: str
    pid: int
    reason: str


class Recorder:
    """The on_status callback: every status change, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._changed = asyncio.Event()

    def __call__(self, shard: Shard) -> None:
        self.events.append(Event(shard.shard_id, shard.state, shard.pid, shard.reason))
        self._changed.set()

    def states(self, shard_id: str) -> list[str]:
        return [e.state for e in self.events if e.shard_id == shard_id]

    async def wait_for(self, shard_id: str, state: str) -> Event:
        async def scan() -> Event:
            while True:
                for e in self.events:
                    if (e.shard_id, e.state) == (shard_id, state):
                        return e
                self._changed.clear()
                await self._changed.wait()

        return await asyncio.wait_for(scan(), WAIT_S)


def sim(shard_id: str, source: str, sha256: str = "") -> ShardSpec:
    return ShardSpec(
        shard_id=shard_id,
        replica_id="r1",
        model="m",
        engine="sim",
        source=source,
        source_sha256=sha256,
    )


async def with_manager(store: SourceStore, state: Path, body: Any) -> list[str]:
    """Run ``body(manager, recorder)``; the sources every launch was built with."""
    recorder = Recorder()
    launched: list[str] = []
    manager: ShardManager

    def make_launch(spec: ShardSpec, port: int, log_path: Path) -> Launch:
        launched.append(spec.source)
        return manager._process_launch(spec, port, log_path)

    manager = ShardManager(
        state,
        ProcessRuntime(),
        recorder,
        startup_timeout=WAIT_S,
        make_launch=make_launch,
        sources=store,
    )
    await manager.open()
    try:
        await body(manager, recorder)
    finally:
        await manager.stop_all(grace=5.0)
        await manager.close()
    return launched


def test_a_shard_without_its_source_fails_before_anything_starts(tmp_path: Path) -> None:
    store = store_at(tmp_path)

    async def body(manager: ShardManager, recorder: Recorder) -> None:
        with pytest.raises(ShardError) as caught:
            await manager.start(sim("s1", "llama"))
        assert "no source llama under models_root" in str(caught.value)
        assert recorder.events == [] and manager.get("s1") is None

    assert asyncio.run(with_manager(store, tmp_path / "state", body)) == []


def test_the_engine_gets_the_resolved_path_and_the_order_is_kept(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    tree(store.models_root, {"llama/w.bin": b"w"})

    async def body(manager: ShardManager, recorder: Recorder) -> None:
        shard = await manager.start(sim("s1", "llama"))
        await recorder.wait_for("s1", ShardState.READY)
        assert shard.spec.source == "llama"  # recorded as ordered

    launched = asyncio.run(with_manager(store, tmp_path / "state", body))
    assert launched == [str((store.models_root / "llama").resolve())]


def test_a_url_source_is_fetched_then_the_engine_starts(tmp_path: Path) -> None:
    share = tmp_path / "share"
    tree(share, {"w.gguf": WEIGHTS})
    store = store_at(tmp_path, f"file://{share}/")
    url = f"file://{share}/w.gguf"
    cached = tmp_path / "cache" / "sources" / SHA / "w.gguf"

    async def body(manager: ShardManager, recorder: Recorder) -> None:
        shard = await manager.start(sim("s1", url, SHA))
        assert shard.state == ShardState.STARTING and shard.pid == 0
        await recorder.wait_for("s1", ShardState.READY)
        assert cached.read_bytes() == WEIGHTS
        # The next shard takes it from the cache: the share may be gone.
        (share / "w.gguf").unlink()
        await manager.start(sim("s2", url, SHA))
        await recorder.wait_for("s2", ShardState.READY)

    assert asyncio.run(with_manager(store, tmp_path / "state", body)) == [str(cached)] * 2


def test_a_failed_fetch_fails_the_shard_and_no_engine_starts(tmp_path: Path) -> None:
    share = tmp_path / "share"
    tree(share, {"w.gguf": b"not the weights"})
    store = store_at(tmp_path, f"file://{share}/")

    async def body(manager: ShardManager, recorder: Recorder) -> None:
        await manager.start(sim("s1", f"file://{share}/w.gguf", SHA))
        event = await recorder.wait_for("s1", ShardState.FAILED)
        assert event.pid == 0
        assert event.reason.startswith(f"checksum mismatch for source file://{share}/w.gguf")
        assert recorder.states("s1") == ["starting", "failed"]

    asyncio.run(with_manager(store, tmp_path / "state", body))


def test_stopping_a_shard_cancels_its_download(tmp_path: Path) -> None:
    store = store_at(tmp_path)
    store.ssl_context = None

    async def body(manager: ShardManager, recorder: Recorder) -> None:
        async with Site().running() as site:
            # http:// from a listed place, so that no TLS is needed for this one.
            store.install_sources = (parse_prefix(f"{site.base}/"),)
            await manager.start(sim("s1", f"{site.base}/stall.gguf", SHA))
            await asyncio.sleep(0.3)
            assert manager.get("s1") is not None and manager.get("s1").fetching is not None  # type: ignore[union-attr]
            shard = await asyncio.wait_for(manager.stop("s1"), 5)
            assert shard is not None and shard.state == ShardState.EXITED
            assert recorder.states("s1") == ["starting", "exited"]

    assert asyncio.run(with_manager(store, tmp_path / "state", body)) == [
        str(tmp_path / "cache" / "sources" / SHA / "stall.gguf")
    ]
    assert os.listdir(tmp_path / "cache" / "sources") == []
