"""Unit tests of llmgw.versions: release versions' shape and order."""

from __future__ import annotations

import re

import pytest

from llmgw.versions import VERSION_PATTERN, is_version, version_key


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
