"""A node that joined under the control plane's name before such ids were refused is named in
the control plane's log at start, with the way out."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmgw.server.app import ControlPlane


def test_nodes_named_like_the_control_plane_are_named_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nodes = [
        SimpleNamespace(id="cp-1.example", state="approved"),
        SimpleNamespace(id="gpu-1", state="approved"),
        SimpleNamespace(id="cp-1", state="revoked"),  # already cut off: nothing to say
    ]
    cp = SimpleNamespace(
        store=SimpleNamespace(list_nodes=lambda: nodes),
        control_plane_names=frozenset({"cp-1.example", "cp-1", "llmgw-control-plane"}),
    )
    with caplog.at_level(logging.WARNING, logger="llmgw.server"):
        ControlPlane._warn_of_nodes_named_like_the_control_plane(cast(Any, cp))
    (line,) = caplog.records
    assert line.getMessage().startswith("a node has the control plane's name as its id")
    fields = line.fields  # type: ignore[attr-defined]
    assert fields["node"] == "cp-1.example"
    assert fields["hint"] == (
        "llmgw ctl revoke cp-1.example, then join the machine under another node id"
    )
