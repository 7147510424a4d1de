"""Keeps the sources of models with ``prefetch: true`` in this node's page cache, so that an
engine started here (a scale-up from zero, a replica moved) loads its weights from memory
rather than from disk.

The leader names the set on every HeartbeatAck (:mod:`llmgw.server.fleet.warming`); each
source is found by the rules a shard's is (:meth:`SourceStore.locate`: a name under
models_root, or a fetched URL under cache_root, never a path elsewhere) and every file
under it is read once, start to end, in large chunks: ``posix_fadvise(WILLNEED)`` one
chunk ahead and a plain read, capped at ``prefetch_rate`` bytes a second (agent.yaml) so
that the engines on the node keep their disk and memory bandwidth. One source at a time,
in a thread; a source dropped from the set stops within a chunk. Each is read again every
``interval`` (the kernel evicts what is not used), and none is read while the node's free
memory is under its size and a margin: warming it would only evict something else (its
status says so). A source that is a URL not fetched here yet is not fetched for this:
fetching is the shard start's business (:meth:`SourceStore.fetch`); once it is in the
cache it is warmed like the others.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from llmgw.agent.config import DEFAULT_PREFETCH_INTERVAL, DEFAULT_PREFETCH_RATE
from llmgw.agent.inventory import meminfo
from llmgw.agent.models_dir import SourceStore
from llmgw.errors import ShardError
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = [
    "DEFAULT_INTERVAL",
    "DEFAULT_RATE",
    "MAX_WARM_SOURCES",
    "MEMORY_MARGIN",
    "Warmer",
    "memory_available",
    "read_into_cache",
]

log = logging.getLogger("llmgw.agent.warming")

DEFAULT_RATE = DEFAULT_PREFETCH_RATE
"""Bytes a second read when warming (agent.yaml ``prefetch_rate``)."""

DEFAULT_INTERVAL = DEFAULT_PREFETCH_INTERVAL
"""Seconds between two passes over a warm source (agent.yaml ``prefetch_interval``)."""

RETRY = 60.0
"""Seconds before a skipped source is tried again (at most ``interval``)."""

MEMORY_MARGIN = 1024**3
"""Free memory a pass leaves beside the source's size."""

CHUNK = 8 * 1024**2
MAX_WARM_SOURCES = 64
"""The most sources one set may name; the rest are ignored, with a warning."""

WARMING, WARM, SKIPPED = "warming", "warm", "skipped"


def memory_available() -> int:
    """MemAvailable, in bytes (what the kernel could give without swapping)."""
    return meminfo().get("MemAvailable", 0)


def read_into_cache(
    files: Iterable[tuple[str, int]],
    *,
    rate: int,
    stop: threading.Event,
    chunk: int = CHUNK,
) -> bool:
    """Read every file whole into the page cache, at most ``rate`` bytes a second; False
    when ``stop`` was set before the end. OSError from the files as it comes."""
    started = time.monotonic()
    done = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    for path, _size in files:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            offset = 0
            while True:
                # The next chunk is asked for while this one is read: the disk stays busy,
                # and never more than one chunk ahead of the cap.
                os.posix_fadvise(fd, offset + chunk, chunk, os.POSIX_FADV_WILLNEED)
                got = os.readv(fd, [view])
                if got <= 0:
                    break
                offset += got
                done += got
                ahead = done / rate - (time.monotonic() - started) if rate > 0 else 0.0
                if stop.wait(ahead) if ahead > 0 else stop.is_set():
                    return False
        finally:
            os.close(fd)
    return True


@dataclass
class _Source:
    source: str
    sha256: str
    state: str = WARMING
    reason: str = ""
    bytes: int = 0
    pass_seconds: float = 0.0
    last_pass_at: float = 0.0
    due: float = 0.0  # time.monotonic() of its next pass
    stop: threading.Event = field(default_factory=threading.Event)

    def status(self) -> pb.WarmStatus:
        return pb.WarmStatus(
            source=self.source,
            state=self.state,
            reason=self.reason,
            bytes=self.bytes,
            pass_seconds=self.pass_seconds,
            last_pass_at=self.last_pass_at,
        )


class Warmer:
    """The sources the leader named, each read into the page cache in turn and again every
    ``interval``; :meth:`status` for the inventory, ``on_change`` awaited when a source's
    state changes (the inventory is sent again)."""

    def __init__(
        self,
        sources: SourceStore,
        *,
        rate: int = DEFAULT_RATE,
        interval: float = DEFAULT_INTERVAL,
        memory: Callable[[], int] = memory_available,
        margin: int = MEMORY_MARGIN,
        chunk: int = CHUNK,
        on_change: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.sources = sources
        self.rate = rate
        self.interval = interval
        self.memory = memory
        self.margin = margin
        self.chunk = chunk
        self.on_change = on_change
        self._wanted: dict[tuple[str, str], _Source] = {}
        self._wake = asyncio.Event()
        # A source left the set since the inventory was last told (run() tells it).
        self._dropped = False

    # -- what the leader says, what the inventory reports -----------------------------------

    def want(self, sources: Iterable[tuple[str, str]]) -> None:
        """The whole set of (source, sha256) to keep warm: new ones are read first, those
        left out stop (a pass under way within a chunk)."""
        wanted = list(dict.fromkeys(sources))
        if len(wanted) > MAX_WARM_SOURCES:
            log.warning(
                "too many sources to keep warm; the first ones are",
                extra=kv(named=len(wanted), kept=MAX_WARM_SOURCES),
            )
            wanted = wanted[:MAX_WARM_SOURCES]
        if wanted == list(self._wanted):
            return
        kept: dict[tuple[str, str], _Source] = {}
        for key in wanted:
            kept[key] = self._wanted.get(key) or _Source(*key)
        for key, gone in self._wanted.items():
            if key not in kept:
                gone.stop.set()
                self._dropped = True
                log.info("no longer keeping a source warm", extra=kv(source=gone.source))
        self._wanted = kept
        self._wake.set()

    def status(self) -> list[pb.WarmStatus]:
        return [s.status() for s in self._wanted.values()]

    # -- the passes ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Warm until cancelled."""
        while True:
            if self._dropped:
                self._dropped = False
                if self.on_change is not None:
                    await self.on_change()
            entry = self._next_due()
            if entry is None:
                self._wake.clear()
                delay = self._until_due()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
                except TimeoutError:
                    pass
                continue
            await self.warm(entry.source, entry.sha256)

    def _next_due(self) -> _Source | None:
        now = time.monotonic()
        due = [s for s in self._wanted.values() if s.due <= now]
        return min(due, key=lambda s: s.due) if due else None

    def _until_due(self) -> float | None:
        if not self._wanted:
            return None
        return max(0.0, min(s.due for s in self._wanted.values()) - time.monotonic())

    async def warm(self, source: str, sha256: str = "") -> str:
        """One pass over a wanted source; its state after it ("" when it is not wanted)."""
        entry = self._wanted.get((source, sha256))
        if entry is None:
            return ""
        before = (entry.state, entry.reason)
        try:
            files = await asyncio.to_thread(self._files, entry)
        except _Skip as skip:
            self._skip(entry, str(skip))
        else:
            size = sum(s for _p, s in files)
            entry.bytes = size
            available = self.memory()
            if available < size + self.margin:
                self._skip(
                    entry,
                    f"the node is short of memory: {_size(available)} available, the source "
                    f"needs {_size(size)} and a margin of {_size(self.margin)}; tried again "
                    f"in {RETRY:.0f} s",
                )
            else:
                await self._read(entry, files, before)
        if (entry.state, entry.reason) != before and self.on_change is not None:
            await self.on_change()
        return entry.state

    async def _read(
        self, entry: _Source, files: list[tuple[str, int]], before: tuple[str, str]
    ) -> None:
        if entry.state != WARM:
            entry.state, entry.reason = WARMING, ""
            if before != (WARMING, "") and self.on_change is not None:
                await self.on_change()
        started = time.monotonic()
        try:
            done = await asyncio.to_thread(
                read_into_cache, files, rate=self.rate, stop=entry.stop, chunk=self.chunk
            )
        except OSError as exc:
            self._skip(entry, f"cannot read it: {exc.strerror or exc}; check its files")
            return
        if not done:
            return  # dropped from the set meanwhile
        took = time.monotonic() - started
        entry.pass_seconds, entry.last_pass_at = took, time.time()
        entry.due = time.monotonic() + self.interval
        if entry.state != WARM:
            entry.state = WARM
            log.info(
                "model source warm",
                extra=kv(source=entry.source, bytes=entry.bytes, seconds=f"{took:.1f}"),
            )
        else:
            log.debug("model source read again", extra=kv(source=entry.source))

    def _skip(self, entry: _Source, why: str) -> None:
        if (entry.state, entry.reason) != (SKIPPED, why):
            log.warning("not keeping a source warm", extra=kv(source=entry.source, reason=why))
        entry.state, entry.reason = SKIPPED, why
        entry.due = time.monotonic() + min(RETRY, self.interval)

    def _files(self, entry: _Source) -> list[tuple[str, int]]:
        """The source's files as (path, size), each inside models_root (or cache_root for a
        fetched one); _Skip with why when there are none to read."""
        store = self.sources
        try:
            located = store.locate(entry.source, entry.sha256)
        except ShardError as exc:
            raise _Skip(exc.message) from None
        if located.fetch is not None:
            raise _Skip(
                "not fetched here yet; it is fetched when a replica is placed here, and "
                "warmed from then on"
            )
        root = os.path.realpath(store.cache_root if entry.sha256 else store.models_root)
        return _walk(located.path, root)


class _Skip(Exception):
    pass


def _walk(path: Path, root: str) -> list[tuple[str, int]]:
    """Every regular file at or under ``path`` whose real place is inside ``root``, in name
    order (a link that leads out is not read)."""
    top = os.path.realpath(path)
    if os.path.isfile(top):
        candidates = [top]
    else:
        candidates = []
        for folder, dirs, names in os.walk(top):
            dirs.sort()
            candidates.extend(os.path.join(folder, n) for n in sorted(names))
    files = []
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if real != root and not real.startswith(root.rstrip("/") + "/"):
            log.warning(
                "not warming a file that leads outside its root",
                extra=kv(path=candidate, to=real, root=root),
            )
            continue
        try:
            st = os.stat(real)
        except OSError:
            continue
        if os.path.isfile(real):
            files.append((real, st.st_size))
    return files


def _size(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB" if n >= 1024**3 else f"{n / 1024**2:.1f} MiB"
