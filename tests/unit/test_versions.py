"""Unit tests of llmgw.versions: release versions' shape and order."""

from __future__ import annotations

import re

import pytest

from llmgw.versions import (
    VERSION_PATTERN,
    is_version,
    newer_release,
    release,
    too_old,
    version_key,
)


def test_version_order() -> None:
    ordered = ["0.1.0", "0.1.1a1", "0.1.1rc1", "0.1.1", "0.1.1.1", "0.1.2", "0.1.10", "0.10.0"]
    assert sorted(reversed(ordered), key=version_key) == ordered


def test_a_pre_release_is_below_its_release_and_case_does_not_matter() -> None:
    assert version_key("0.2.0rc1") < version_key("0.2.0")
    assert version_key("0.2.0RC1") == version_key("0.2.0rc1")
    assert version_key("0.10.0") > version_key("0.9.1")


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("0.2.0", True),
        ("1.0.0+git.abc~1-2", True),
        ("v1.0", False),
        ("", False),
        ("1" * 64, True),
        ("1" * 65, False),
        ("1.0 beta", False),
    ],
)
def test_is_version(text: str, ok: bool) -> None:
    assert is_version(text) is ok


def test_the_pattern_embeds_in_a_bundle_name() -> None:
    name = re.compile(rf"llmgw-agent-(?P<version>{VERSION_PATTERN})-linux-x64\.tar\.gz")
    match = name.fullmatch("llmgw-agent-0.3.1rc2-linux-x64.tar.gz")
    assert match and match["version"] == "0.3.1rc2"


@pytest.mark.parametrize(
    ("text", "numbers"),
    [
        ("0.2.0", (0, 2)),
        ("0.2", (0, 2)),
        ("0.2.0rc1", (0, 2)),
        ("0.2.0+local.3", (0, 2)),
        ("0.2.0.dev3", (0, 2)),
        ("0.2.0-1", (0, 2)),
        ("0.2.0~git5", (0, 2)),
        ("0.2.0.1", (0, 2, 0, 1)),
        ("0.0.0", (0,)),
        ("10.0.3", (10, 0, 3)),
        ("", ()),
        ("dev", ()),
    ],
)
def test_release_is_the_leading_numbers(text: str, numbers: tuple[int, ...]) -> None:
    assert release(text) == numbers


@pytest.mark.parametrize(
    ("version", "than", "newer"),
    [
        ("0.1.1", "0.1.0", True),
        ("0.2.0rc1", "0.1.9", True),  # a pre-release of the next release is of that release
        ("0.2.0.dev3", "0.1.9", True),
        ("0.10.0", "0.9.0", True),
        ("1.0.0", "0.99.0", True),
        ("0.1.0.1", "0.1.0", True),
        ("0.1.0", "0.1.0", False),
        ("0.1.0+local", "0.1.0", False),  # a local build of the same release
        ("0.1.0", "0.1.0+local", False),
        ("0.1.0", "0.1.0rc2", False),  # the final of the control plane's pre-release
        ("0.1.0", "0.1", False),
        ("0.1.0", "0.1.1", False),
        ("", "0.1.0", False),  # nothing to compare: not judged newer
        ("0.2.0", "", False),
    ],
)
def test_newer_release(version: str, than: str, newer: bool) -> None:
    assert newer_release(version, than) is newer


@pytest.mark.parametrize(
    ("version", "than", "old"),
    [
        ("0.3.0", "0.5.0", False),  # N-2: supported
        ("0.3.9", "0.5.2", False),
        ("0.2.9", "0.5.0", True),  # N-3
        ("0.2.0rc1", "0.5.0", True),
        ("0.5.0", "0.5.0", False),
        ("0.6.0", "0.5.0", False),  # newer is not old (it is refused instead)
        ("0.9.0", "1.0.0", True),  # an earlier major release: no minor window covers it
        ("1.0.0", "1.2.0+local", False),
        ("1", "1.2", False),
        ("", "0.5.0", False),
        ("0.1.0", "dev", False),
    ],
)
def test_too_old_is_beyond_two_minor_releases(version: str, than: str, old: bool) -> None:
    assert too_old(version, than) is old
