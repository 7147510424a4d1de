"""A node that joined under the control plane's name before such ids were refused, or under
another instance's name before that instance was registered, is named in the control plane's
log at start, with the way out."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmgw.server.ha.instances import warn_of_nodes_named_like_the_control_plane


def test_nodes_named_like_the_control_plane_are_named_at_start(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nodes = [
        SimpleNamespace(id="cp-1.example", state="approved"),
        SimpleNamespace(id="gpu-1", state="approved"),
        SimpleNamespace(id="cp-1", state="revoked"),  # already cut off: nothing to say
        SimpleNamespace(id="cp-2.example", state="approved"),  # another instance's name
    ]
    store = SimpleNamespace(
        list_nodes=lambda: nodes, instance_names=lambda: {"cp-2.example": "cp2"}
    )
    names = frozenset({"cp-1.example", "cp-1", "llmgw-control-plane"})
    with caplog.at_level(logging.WARNING, logger="llmgw.server"):
        warn_of_nodes_named_like_the_control_plane(cast(Any, store), names, "cp1")
    first, second = caplog.records
    assert first.getMessage().startswith("a node has the control plane's name as its id")
    fields = first.fields  # type: ignore[attr-defined]
    assert (fields["node"], fields["instance"]) == ("cp-1.example", "cp1")
    assert fields["hint"] == (
        "llmgw ctl revoke cp-1.example, then join the machine under another node id"
    )
    fields = second.fields  # type: ignore[attr-defined]
    assert (fields["node"], fields["instance"]) == ("cp-2.example", "cp2")


def test_a_standby_registering_names_the_nodes_under_its_own_names(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An instance registered after a node took one of its names: the node is named in that
    instance's log as it starts (and its approval is refused while pending)."""
    nodes = [
        SimpleNamespace(id="cp-3.example", state="pending"),
        SimpleNamespace(id="gpu-1", state="approved"),
    ]
    store = SimpleNamespace(list_nodes=lambda: nodes)
    with caplog.at_level(logging.WARNING, logger="llmgw.server"):
        warn_of_nodes_named_like_the_control_plane(
            cast(Any, store), ["cp-3", "cp-3.example"], "cp3", others=False
        )
    (line,) = caplog.records
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["node"], fields["instance"]) == ("cp-3.example", "cp3")
