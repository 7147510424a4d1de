"""The desired-engine routes' reading of a request body: one node or all, and the builds
(a list, or one from url/sha256/arch), each malformed shape refused with what to send."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.errors import ConfigError
from llmgw.server.admin.context import BadRequest
from llmgw.server.admin.software import MAX_BUILDS, _builds, _target
from llmgw.server.installs import Build

SHA = "d" * 64


def test_the_target_is_one_node_or_all() -> None:
    assert _target({"node": "gpu-1"}) == "gpu-1"
    assert _target({"node": "gpu-1", "all": False}) == "gpu-1"
    assert _target({"all": True}) is None
    for body in ({}, {"node": "gpu-1", "all": True}, {"node": ""}, {"node": ["a"]}, {"all": 1}):
        with pytest.raises(BadRequest) as info:
            _target(body)
        assert str(info.value) == "give either 'node' (one node id) or 'all': true"


def test_one_build_from_url_and_sha256_or_a_list() -> None:
    assert _builds({"url": "https://h/x.tgz", "sha256": SHA}) == [Build("", "https://h/x.tgz", SHA)]
    assert _builds(
        {"builds": [{"arch": "amd64", "url": "https://h/x.tgz", "sha256": SHA.upper()}]}
    ) == [Build("x86_64", "https://h/x.tgz", SHA)]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"builds": [], "url": "https://h/x"},
            "give 'builds' or 'url' and 'sha256' (with 'arch'), not both",
        ),
        ({"builds": []}, f"'builds' must be a list of 1 to {MAX_BUILDS} builds"),
        ({"builds": {"arch": "x86_64"}}, f"'builds' must be a list of 1 to {MAX_BUILDS} builds"),
        ({"builds": ["https://h/x"]}, 'each build is an object: {"arch", "url", "sha256"}'),
        ({"url": "https://h/x"}, "'sha256' is required for each build"),
        ({"sha256": SHA}, "'url' is required for each build"),
        ({"url": "https://h/x", "sha256": SHA, "arch": 64}, "arch must be a string such as x86_64 or aarch64"),
    ],
)  # fmt: skip
def test_malformed_builds_are_refused(body: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        _builds(body)
    assert str(info.value) == message


def test_a_build_the_nodes_cannot_use_is_a_config_error_answered_400() -> None:
    with pytest.raises(ConfigError):
        _builds({"url": "s3://bucket/x.tgz", "sha256": SHA})
