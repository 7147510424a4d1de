"""The console's HTML: the Jinja2 templates (autoescaped: node ids, model names and event
messages are other people's input) and the static files, each served under a URL that
holds its content's hash so that a browser may keep it for a year and still never run an
old script against a new page.

Templates and static files are package data (pyproject's ``package-data``) and PyInstaller
``datas`` (packaging/llmgw.spec): found beside this module, in a wheel as in a frozen build.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from llmgw.errors import ConfigError

__all__ = ["STATIC_DIR", "TEMPLATE_DIR", "Asset", "Assets", "Renderer", "when"]

HERE = Path(__file__).resolve().parent
TEMPLATE_DIR = HERE / "templates"
STATIC_DIR = HERE / "static"

# What each kind of static file is served as; any other file in static/ is refused at start
# (a file a browser would sniff is not served).
CONTENT_TYPES: Mapping[str, str] = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}


@dataclass(frozen=True)
class Asset:
    """One static file: its bytes, their hash (the URL's version) and its content type."""

    name: str
    body: bytes
    digest: str
    content_type: str

    @property
    def url(self) -> str:
        return f"/ui/static/{self.digest}/{self.name}"


class Assets:
    """The static files, read once at start."""

    def __init__(self, root: Path = STATIC_DIR) -> None:
        if not root.is_dir():
            raise ConfigError(
                f"the console's static files are missing ({root}); reinstall llmgw (a build "
                "without its package data)"
            )
        self.files: dict[str, Asset] = {}
        for path in sorted(root.iterdir()):
            content_type = CONTENT_TYPES.get(path.suffix)
            if content_type is None or not path.is_file():
                raise ConfigError(
                    f"{path}: not a kind of file the console serves "
                    f"({', '.join(CONTENT_TYPES)}); remove it"
                )
            body = path.read_bytes()
            digest = hashlib.sha256(body).hexdigest()[:16]
            self.files[path.name] = Asset(path.name, body, digest, content_type)

    def url(self, name: str) -> str:
        asset = self.files.get(name)
        if asset is None:
            raise KeyError(f"no static file {name!r} in the console's static/")
        return asset.url


def when(ts: float | None, now: float | None = None) -> str:
    """A time as the pages show it: UTC, to the second ("" when unknown)."""
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def ago(ts: float | None, now: float | None = None) -> str:
    """How long ago ``ts`` was, to the unit a person reads ("never" when unknown)."""
    if ts is None:
        return "never"
    seconds = max(0, int((time.time() if now is None else now) - ts))
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 7200:
        return f"{seconds // 60} min ago"
    if seconds < 172800:
        return f"{seconds // 3600} h ago"
    return f"{seconds // 86400} days ago"


def mib(value: Any) -> str:
    """MiB as GiB with one decimal, the way GPU memory is quoted."""
    try:
        return f"{int(value) / 1024:.1f} GiB"
    except (TypeError, ValueError):
        return ""


def size(value: Any) -> str:
    """Bytes in GiB."""
    try:
        return f"{int(value) / 1024**3:.1f} GiB"
    except (TypeError, ValueError):
        return ""


class Renderer:
    """Pages and fragments from the templates, every value escaped unless a template marks
    it safe (only the server-made SVG charts are)."""

    def __init__(self, assets: Assets, templates: Path = TEMPLATE_DIR) -> None:
        if not templates.is_dir():
            raise ConfigError(
                f"the console's templates are missing ({templates}); reinstall llmgw (a "
                "build without its package data)"
            )
        self.assets = assets
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(str(templates)),
            autoescape=True,
            undefined=jinja2.StrictUndefined,  # a misspelt name fails the test, not the page
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.globals["static"] = assets.url
        self.env.filters["when"] = when
        self.env.filters["ago"] = ago
        self.env.filters["mib"] = mib
        self.env.filters["size"] = size

    def render(self, template: str, **values: Any) -> str:
        return self.env.get_template(template).render(**values)
