"""Release versions of llmgw: their shape and their order.

Used wherever two versions are compared: the control plane picks the newest agent bundle,
the update helper refuses a downgrade.
"""

from __future__ import annotations

import re

__all__ = ["VERSION_PATTERN", "is_version", "version_key"]

VERSION_PATTERN = r"[0-9][0-9A-Za-z.+~-]*"
"""A release version as it appears in bundle names and update orders (a regex fragment)."""
MAX_VERSION = 64
_VERSION = re.compile(VERSION_PATTERN)
_PARTS = re.compile(r"\d+|[A-Za-z]+")


def is_version(text: str) -> bool:
    """True for a release version: a digit, then letters, digits and ``.+~-``, at most 64."""
    return len(text) <= MAX_VERSION and _VERSION.fullmatch(text) is not None


def version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Order versions as numbers, part by part ("0.10.0" > "0.9.1"); a part with letters
    marks a pre-release, below its release ("0.2.0rc1" < "0.2.0" < "0.2.0.1")."""
    parts = _PARTS.findall(version)
    key = [(2, int(p), "") if p.isdigit() else (0, 0, p.lower()) for p in parts]
    key.append((1, 0, ""))  # the end of the version: above a tag, below a further number
    return tuple(key)
