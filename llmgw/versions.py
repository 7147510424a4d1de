"""Release versions of llmgw: their shape and their order.

Used wherever two versions are compared: the control plane picks the newest agent bundle,
the update helper refuses a downgrade, the control plane refuses an agent (or an update
order) of a newer release than its own and warns about agents too far behind.

Skew is judged on the *release* a version belongs to, its leading numbers: a local build
("0.2.0+local", "0.2.0-1"), a development build ("0.2.0.dev3") and a pre-release
("0.2.0rc1") are all of release 0.2.0, so a control plane built from a checkout meets the
agents of its own release. A development build of the next release is of that release.
"""

from __future__ import annotations

import re

__all__ = [
    "MINORS_SUPPORTED",
    "VERSION_PATTERN",
    "is_version",
    "newer_release",
    "release",
    "too_old",
    "version_key",
]

VERSION_PATTERN = r"[0-9][0-9A-Za-z.+~-]*"
"""A release version as it appears in bundle names and update orders (a regex fragment)."""
MAX_VERSION = 64
_VERSION = re.compile(VERSION_PATTERN)
_PARTS = re.compile(r"\d+|[A-Za-z]+")
_RELEASE = re.compile(r"\d+(?:\.\d+)*")
MINORS_SUPPORTED = 2
"""An agent up to this many minor releases behind its control plane (N-2) is supported."""


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


def release(version: str) -> tuple[int, ...]:
    """The release ``version`` belongs to: its leading dot-separated numbers, trailing zeros
    dropped ("0.2.0rc1", "0.2.0+local", "0.2.0.dev3", "0.2" -> (0, 2); "0.0.0" -> (0,)).
    () for a text that does not start with a digit: no release to compare."""
    match = _RELEASE.match(version)
    if match is None:
        return ()
    numbers = [int(n) for n in match.group().split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def newer_release(version: str, than: str) -> bool:
    """True when ``version`` is of a later release than ``than`` ("0.2.0rc1" is newer than
    "0.1.9"; "0.2.0+local" is not newer than "0.2.0"). False when either has no release."""
    mine, theirs = release(version), release(than)
    return bool(mine) and bool(theirs) and mine > theirs


def too_old(version: str, than: str) -> bool:
    """True when ``version`` is outside the supported window below ``than``: more than
    MINORS_SUPPORTED minor releases behind it, or of an earlier major release. False when
    either has no release (nothing to judge)."""
    mine, theirs = release(version), release(than)
    if not mine or not theirs:
        return False
    major, minor = (*mine, 0)[:2]
    their_major, their_minor = (*theirs, 0)[:2]
    if major != their_major:
        return major < their_major
    return their_minor - minor > MINORS_SUPPORTED
