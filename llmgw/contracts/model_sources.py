"""A profile's model ``source``, what a node reports of the sources it has, and whether a node
has (or may fetch) the one a profile names: the catalog parses it, the agent lists and
resolves it, placement checks it, all by the rules here.

A source is one of:

- a **name under the node's models_root**: ``llama-3-8b``, ``meta/Llama-3-8B``,
  ``tiny/q4.gguf`` (1 to :data:`MAX_DEPTH` segments; no ``.``, ``..``, backslash or NUL);
- an **absolute path**, which must lie under the node's models_root
  (``/srv/llmgw/models/llama-3-8b`` is the name ``llama-3-8b`` on a node whose models_root is
  ``/srv/llmgw/models``; on a node with another models_root it is not there);
- a **URL with its SHA-256** (``source: {url: https://host/path/FILE, sha256: HEX}``): one
  file the agent downloads into ``<cache_root>/sources/<sha256>/FILE`` before the engine
  starts, checked and moved into place in one rename, and reused for every later shard. A
  node fetches ``https://`` URLs, and ``http://`` or ``file://`` ones only from the places
  its ``install_sources`` lists (:func:`llmgw.contracts.sources.fetchable`).

The node's agent lists models_root breadth first, :data:`MAX_DEPTH` levels deep and at most
:data:`MAX_ENTRIES` entries, and reports it with its inventory; placement chooses only a node
whose listing has the name, or that may fetch the URL (or has it in its cache already). A
symlink under models_root that leads outside it is neither listed nor used: a source never
escapes models_root. A node that reports no listing at all (an agent older than this check)
is not filtered, nor is a name deeper than its listing reached.

Engines that need no weights (``builtin`` in the engine registry: ``sim``) may leave
``source`` out; one that is given is checked all the same. Hub names an engine would fetch
itself (a Hugging Face repo id for vLLM) are not a source kind: such a download would bypass
``install_sources`` and the checksum; stage the files under models_root, or give a URL and
its SHA-256.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import Any

from llmgw.contracts.sources import SourcePrefix, fetchable, parse_prefix, split_url
from llmgw.errors import ConfigError
from llmgw.proto import control_pb2 as pb

__all__ = [
    "CACHE_DIR",
    "MAX_DEPTH",
    "MAX_ENTRIES",
    "NodeSources",
    "SourceSpec",
    "parse_source",
    "sources_dict",
]

MAX_DEPTH = 3
"""How many levels under models_root a name may have, and the agent lists."""

MAX_ENTRIES = 2000
"""The most entries of models_root an agent reports."""

MAX_CACHED = 1000
"""The most fetched sources an agent reports as cached."""

CACHE_DIR = "sources"
"""The folder under cache_root that fetched sources go to, one folder per SHA-256."""

_SHA256 = re.compile(r"[0-9a-f]{64}")
_URL_KEYS = ("url", "sha256")


@dataclass(frozen=True)
class SourceSpec:
    """A parsed source: ``text`` as the profile gives it (name, absolute path or URL) and,
    for a URL, its ``sha256`` (lowercase hex)."""

    text: str
    sha256: str = ""

    @property
    def fetched(self) -> bool:
        """A URL the agent downloads (rather than a name or path under models_root)."""
        return bool(self.sha256)

    @property
    def file_name(self) -> str:
        """A URL's last path segment: the name the file has in the cache."""
        return PurePosixPath(split_url(self.text)[3]).name

    def cache_path(self, cache_root: Path) -> Path:
        """Where a fetched source lies on a node with this ``cache_root``."""
        return cache_root / CACHE_DIR / self.sha256 / self.file_name

    def name_under(self, models_root: str) -> str | None:
        """The name this source has under ``models_root``; None for an absolute path
        outside it (or a URL)."""
        if self.fetched:
            return None
        if not self.text.startswith("/"):
            return self.text
        root = PurePosixPath(models_root)
        try:
            rel = PurePosixPath(self.text).relative_to(root)
        except ValueError:
            return None
        return str(rel) if rel.parts else None

    def to_value(self) -> str | dict[str, str]:
        """The catalog's form: the text, or ``{url, sha256}``."""
        return {"url": self.text, "sha256": self.sha256} if self.fetched else self.text


def parse_source(value: object) -> SourceSpec:
    """A profile's ``source`` value, checked; :class:`ConfigError` says what is wrong with it
    (without the key, which the catalog adds)."""
    if isinstance(value, Mapping):
        return _url_source(value)
    if not isinstance(value, str) or not value:
        raise ConfigError(
            "must be a name under the node's models_root (e.g. llama-3-8b), an absolute path "
            "under it, or {url: https://…, sha256: …}"
        )
    if "\0" in value or "\\" in value:
        raise ConfigError(f"{value!r} must not contain a NUL character or a backslash")
    if "://" in value:
        raise ConfigError(
            f"{value!r} is a URL without its SHA-256; give source: {{url: {value}, sha256: "
            "<the publisher's SHA-256 of the file>}"
        )
    parts = value.split("/")
    absolute = value.startswith("/")
    segments = parts[1:] if absolute else parts
    if any(seg in ("", ".", "..") for seg in segments):
        raise ConfigError(
            f"{value!r} has an empty, '.' or '..' segment; a source stays under the node's "
            "models_root: give its name there, e.g. llama-3-8b or org/model"
        )
    if not absolute and len(segments) > MAX_DEPTH:
        raise ConfigError(
            f"{value!r} is {len(segments)} levels deep; the agent lists models_root "
            f"{MAX_DEPTH} levels deep: move the weights up, e.g. {'/'.join(segments[-2:])}"
        )
    return SourceSpec(value)


def _url_source(value: Mapping[Any, Any]) -> SourceSpec:
    unknown = sorted(str(k) for k in value if k not in _URL_KEYS)
    if unknown:
        raise ConfigError(
            f"has unknown key(s) {', '.join(unknown)}; a fetched source is {{url: …, sha256: …}}"
        )
    url, sha256 = value.get("url"), value.get("sha256")
    if not isinstance(url, str) or not url:
        raise ConfigError("needs url: the https:// (or listed http://, file://) URL of the file")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256.strip().lower()):
        raise ConfigError(
            f"needs sha256: the 64 hex digits of the file's SHA-256 (got {sha256!r}); the node "
            "refuses a download that does not match it"
        )
    try:
        path = split_url(url)[3]
    except ValueError as exc:
        raise ConfigError(f"url {url!r} cannot be fetched: {exc}") from None
    if "?" in url or "#" in url:
        raise ConfigError(f"url {url!r} must not have a query or fragment: name the file itself")
    name = PurePosixPath(path).name
    if not name or path.endswith("/"):
        raise ConfigError(f"url {url!r} must end in the file's name, e.g. …/model.Q4_K_M.gguf")
    return SourceSpec(url.strip(), sha256.strip().lower())


def sources_dict(msg: pb.ModelSources) -> dict[str, Any]:
    """A node's reported sources as the control plane stores them (JSON-ready)."""
    return {
        "models_root": msg.models_root,
        "entries": [
            {"name": e.name, "size_bytes": e.size_bytes, "dir": e.dir} for e in msg.entries
        ],
        "listed_depth": msg.listed_depth,
        "fetch_prefixes": list(msg.fetch_prefixes),
        "cached": list(msg.cached),
        "problem": msg.problem,
    }


class NodeSources:
    """A node's stored ``sources`` (:func:`sources_dict`), and what it can serve. Cheap to
    build: the names are indexed on first use."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = data
        self.models_root = str(data.get("models_root") or "")
        self.listed_depth = int(data.get("listed_depth") or 0)
        self.problem_text = str(data.get("problem") or "")

    @classmethod
    def from_inventory(cls, inventory: Mapping[str, Any]) -> NodeSources | None:
        """The node's sources; None when its agent reports none (it predates the check)."""
        data = inventory.get("sources")
        return cls(data) if isinstance(data, Mapping) else None

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(str(e.get("name")) for e in self.data.get("entries") or ())

    @cached_property
    def cached(self) -> frozenset[str]:
        return frozenset(str(s) for s in self.data.get("cached") or ())

    @cached_property
    def prefixes(self) -> tuple[SourcePrefix, ...]:
        out = []
        for text in self.data.get("fetch_prefixes") or ():
            try:
                out.append(parse_prefix(str(text)))
            except ValueError:
                continue  # the agent checked it; one it could not have sent is no prefix
        return tuple(out)

    def size_bytes(self, source: SourceSpec) -> int:
        """The size of ``source``'s weights as listed here: its entry's size (a folder: the
        files listed under it, summed where the agent left the folder's own size out); 0
        when not listed (a URL, a name deeper than the listing, another models_root)."""
        name = source.name_under(self.models_root)
        if name is None or name not in self.names:
            return 0
        entries = self.data.get("entries") or ()
        entry = next(e for e in entries if str(e.get("name")) == name)
        size = int(entry.get("size_bytes") or 0)
        if size or not entry.get("dir"):
            return size
        inside = name + "/"
        return sum(
            int(e.get("size_bytes") or 0)
            for e in entries
            if not e.get("dir") and str(e.get("name")).startswith(inside)
        )

    def problem(self, source: SourceSpec) -> str:
        """Why this node cannot serve ``source``; "" when it has it, may fetch it, or cannot
        tell (a name deeper than its listing reached)."""
        if source.fetched:
            if source.sha256 in self.cached or fetchable(source.text, self.prefixes):
                return ""
            scheme = source.text.split(":", 1)[0].lower()
            listed = ", ".join(p.text for p in self.prefixes) or "none listed"
            return (
                f"may not fetch {source.text}: {scheme}:// sources only from its "
                f"install_sources ({listed})"
            )
        name = source.name_under(self.models_root)
        if name is None:
            return f"source {source.text} is not under its models_root {self.models_root}"
        if name in self.names:
            return ""
        if self.problem_text:
            return f"cannot list its models_root {self.models_root}: {self.problem_text}"
        if len(name.split("/")) > self.listed_depth:
            return ""  # deeper than the listing reached: the engine will tell
        return f"no source {name} under its models_root {self.models_root}"
