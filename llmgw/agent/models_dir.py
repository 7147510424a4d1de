"""The model sources this node has: what lies under models_root (listed, bounded, for the
inventory), a profile's source resolved to a path that stays inside models_root, and a URL
source fetched into cache_root and checked against its SHA-256 before the engine starts.

The rules (what a source may be, how deep the listing goes, where a fetched file lies) are
the contract :mod:`llmgw.contracts.model_sources`, which placement reads too: a shard is
placed only on a node whose listing has its source, or that may fetch it. The checks here
are the node's own, made again when the order comes: the control plane decides where a
shard goes, never which files of the node an engine reads. So a source that leads out of
models_root (``..`` in the name, an absolute path elsewhere, a symlink to another place) is
refused, and a URL is fetched only by the rule of ``install_sources``
(:func:`llmgw.contracts.sources.fetchable`), through the engine installs' download (the
same redirect, size and error rules), into a temporary folder first: the file appears under
``<cache_root>/sources/<sha256>/`` in one rename once its SHA-256 matched, and is reused by
every later shard without another download.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import os
import re
import shutil
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw.agent.installs import _download
from llmgw.contracts.install_order import display_url
from llmgw.contracts.model_sources import (
    CACHE_DIR,
    MAX_CACHED,
    MAX_DEPTH,
    MAX_ENTRIES,
    SourceSpec,
    parse_source,
)
from llmgw.contracts.sources import SourcePrefix, fetchable
from llmgw.errors import ConfigError, EngineError, ShardError
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = ["MAX_SOURCE_BYTES", "Located", "SourceStore", "list_sources"]

log = logging.getLogger("llmgw.agent.models_dir")

MAX_SOURCE_BYTES = 2 * 1024**4
"""The largest file a source URL may download (2 TiB)."""

FETCH_TIMEOUT = 6 * 3600.0
"""How long one source download may take."""

_TMP_PREFIX = ".tmp-"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_WARNINGS = 5


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def list_sources(
    models_root: Path, *, max_depth: int = MAX_DEPTH, max_entries: int = MAX_ENTRIES
) -> tuple[pb.ModelSources, list[str]]:
    """What lies under ``models_root``, breadth first, ``max_depth`` levels and at most
    ``max_entries`` entries, in name order; and warnings for the operator (a symlink that
    leads out of models_root, which is not listed). Hidden entries (``.cache``) are skipped.
    A folder's size is that of the files listed under it."""
    msg = pb.ModelSources(models_root=str(models_root))
    warnings: list[str] = []
    root = os.path.realpath(models_root)
    if not os.path.isdir(root):
        msg.problem = (
            "it does not exist; create it and put the weights there"
            if not os.path.lexists(models_root)
            else "it is not a folder; point models_root in agent.yaml at the weights' folder"
        )
        return msg, warnings
    entries: dict[str, pb.ModelSource] = {}
    level: list[tuple[str, str]] = [("", root)]
    listed = 0
    full = False
    for depth in range(1, max_depth + 1):
        below: list[tuple[str, str]] = []
        for rel, path in level:
            try:
                children = sorted(os.scandir(path), key=lambda e: e.name)
            except OSError as exc:
                if not rel:
                    msg.problem = exc.strerror or str(exc)
                    return msg, warnings
                warnings.append(f"cannot list {models_root}/{rel}: {exc.strerror or exc}")
                continue
            for child in children:
                if child.name.startswith("."):
                    continue
                if len(entries) >= max_entries:
                    full = True
                    break
                name = f"{rel}/{child.name}" if rel else child.name
                real = os.path.realpath(child.path)
                if not _inside(real, root):
                    warnings.append(
                        f"{models_root}/{name} leads outside models_root (to {real}); it is "
                        "not offered as a source: move the files under models_root"
                    )
                    continue
                try:
                    st = os.stat(real)
                except OSError:
                    continue  # a dangling symlink, or gone meanwhile
                if os.path.isdir(real):
                    entries[name] = pb.ModelSource(name=name, dir=True)
                    below.append((name, real))
                elif os.path.isfile(real):
                    entries[name] = pb.ModelSource(name=name, size_bytes=st.st_size)
                    parts = name.split("/")
                    for i in range(1, len(parts)):
                        entries["/".join(parts[:i])].size_bytes += st.st_size
            if full:
                break
        if full:
            break
        listed = depth
        level = below
    msg.entries.extend(sorted(entries.values(), key=lambda e: e.name))
    msg.listed_depth = listed
    if full:
        warnings.append(
            f"models_root {models_root} holds more than {max_entries} entries "
            f"{max_depth} levels deep; those below level {listed} are not all reported, and "
            "placement does not check sources there"
        )
    if len(warnings) > _MAX_WARNINGS:
        warnings[_MAX_WARNINGS:] = [f"and {len(warnings) - _MAX_WARNINGS} more such warnings"]
    return msg, warnings


@dataclass(frozen=True)
class Located:
    """Where a shard's source is on this node; ``fetch`` when it must be downloaded there
    first."""

    path: Path
    fetch: SourceSpec | None = None


class SourceStore:
    """This node's models_root and cache_root, as shards and the inventory use them."""

    def __init__(
        self,
        models_root: Path,
        cache_root: Path,
        *,
        install_sources: tuple[SourcePrefix, ...] = (),
        ssl_context: Callable[[], ssl.SSLContext] | None = None,
        timeout: float = FETCH_TIMEOUT,
        max_bytes: int = MAX_SOURCE_BYTES,
    ) -> None:
        self.models_root = models_root
        self.cache_root = cache_root
        self.install_sources = install_sources
        self.ssl_context = ssl_context
        self.timeout = timeout
        self.max_bytes = max_bytes
        self._locks: dict[str, asyncio.Lock] = {}
        self._cleaned = False

    # -- what the inventory reports -----------------------------------------------------------

    def listing(self) -> tuple[pb.ModelSources, list[str]]:
        """The inventory's ``sources`` and warnings: models_root listed, the prefixes of
        ``install_sources`` and the SHA-256 of the sources fetched already."""
        msg, warnings = list_sources(self.models_root)
        msg.fetch_prefixes.extend(p.text for p in self.install_sources)
        msg.cached.extend(self.cached())
        return msg, warnings

    def cached(self) -> list[str]:
        """The SHA-256 of each source in the cache, sorted (at most MAX_CACHED)."""
        base = self.cache_root / CACHE_DIR
        try:
            names = sorted(os.listdir(base))
        except OSError:
            return []
        return [n for n in names if _SHA256.fullmatch(n) and any((base / n).iterdir())][:MAX_CACHED]

    # -- a shard's source ---------------------------------------------------------------------

    def locate(self, source: str, sha256: str = "") -> Located:
        """Where ``source`` (a StartShard's ``source`` and ``source_sha256``) is on this node.

        :class:`ShardError`, with the fix, when it is not a valid source, leads out of
        models_root, is not there, or is a URL this node does not fetch."""
        try:
            spec = parse_source({"url": source, "sha256": sha256} if sha256 else source)
        except ConfigError as exc:
            raise ShardError(
                f"the order's source {source!r} is not one this node takes: {exc.message}; "
                "fix the profile's source in the catalog"
            ) from None
        if spec.fetched:
            return self._locate_url(spec)
        root = str(self.models_root)
        name = spec.name_under(root)
        if name is None:
            raise ShardError(
                f"source {source} is not under this node's models_root {root}; put the "
                "weights under models_root and name them there (e.g. source: "
                f"{os.path.basename(source.rstrip('/')) or 'NAME'})"
            )
        path = self.models_root / name
        real = os.path.realpath(path)
        if not _inside(real, os.path.realpath(self.models_root)):
            raise ShardError(
                f"source {name} leads outside models_root {root} (to {real}); sources stay "
                "under models_root: move the files there instead of linking to them"
            )
        if not os.path.exists(real):
            raise ShardError(
                f"no source {name} under models_root {root} on this node; copy the weights "
                f"to {path}, or fix the profile's source"
            )
        return Located(Path(real))

    def _locate_url(self, spec: SourceSpec) -> Located:
        shown = display_url(spec.text)
        if not fetchable(spec.text, self.install_sources):
            scheme = spec.text.split(":", 1)[0].lower()
            raise ShardError(
                f"cannot fetch source {shown}: {scheme}:// sources are fetched only from "
                "places listed in install_sources in agent.yaml; list its folder there and "
                "restart the agent, or give an https:// URL"
            )
        path = spec.cache_path(self.cache_root)
        return Located(path, None if path.is_file() else spec)

    async def fetch(self, spec: SourceSpec) -> Path:
        """Download ``spec`` into the cache (once, however many shards wait for it), check
        its SHA-256 and move it into place; the cached file. ShardError when it fails."""
        final = spec.cache_path(self.cache_root)
        lock = self._locks.setdefault(spec.sha256, asyncio.Lock())
        async with lock:
            if final.is_file():
                return final
            base = self.cache_root / CACHE_DIR
            shown = display_url(spec.text)
            try:
                base.mkdir(parents=True, exist_ok=True)
                if not self._cleaned:
                    self._remove_leftovers(base)
                tmp = Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=base))
            except OSError as exc:
                raise ShardError(
                    f"cannot prepare {base} for source {shown}: {exc.strerror}; check that "
                    "cache_root exists and belongs to the agent's user"
                ) from exc
            try:
                ctx = await asyncio.to_thread(self.ssl_context) if self.ssl_context else None
                log.info("fetching a model source", extra=kv(url=shown, sha256=spec.sha256))
                try:
                    got = await _download(
                        spec.text,
                        shown,
                        tmp / spec.file_name,
                        timeout=self.timeout,
                        max_bytes=self.max_bytes,
                        sources=self.install_sources,
                        ssl_context=ctx,
                    )
                except EngineError as exc:
                    raise ShardError(f"cannot fetch model source: {exc.message}") from exc
                if not hmac.compare_digest(got, spec.sha256):
                    log.warning(
                        "model source does not match its SHA-256",
                        extra=kv(url=shown, got=got, want=spec.sha256),
                    )
                    raise ShardError(
                        f"checksum mismatch for source {shown}: the download is not the file "
                        "the profile's sha256 names; it was deleted; check the SHA-256 the "
                        "publisher gives and fix the profile's source"
                    )
                self._commit(tmp, base / spec.sha256, shown)
            finally:
                await asyncio.to_thread(shutil.rmtree, tmp, True)
            log.info("model source fetched", extra=kv(url=shown, path=str(final)))
            return final

    def _commit(self, tmp: Path, final: Path, shown: str) -> None:
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                return  # fetched meanwhile (another agent run); that one is as good
            raise ShardError(
                f"cannot move source {shown} into {final}: {exc.strerror}; check that "
                "cache_root belongs to the agent's user"
            ) from exc
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _remove_leftovers(self, base: Path) -> None:
        """Temporary folders of downloads an earlier agent did not finish (this one has
        started none yet)."""
        self._cleaned = True
        for entry in base.iterdir():
            if entry.name.startswith(_TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
