"""SimConfig: every setting checked when it is made, multi-node ones included."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.errors import EngineError
from llmgw.netaddr import parse_hostport
from llmgw.sim.config import SimConfig


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", 70000),
        ("port", -1),
        ("tps", -1.0),
        ("ttft_ms", float("nan")),
        ("max_tokens", 0),
        ("embedding_dim", 0),
        ("embedding_dim", 16385),
        ("embedding_dim", 3.0),
    ],
)
def test_config_validation(field: str, value: Any) -> None:
    with pytest.raises(EngineError, match=field):
        SimConfig(**{field: value})


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"nodes": 0}, "nodes must be a positive integer"),
        ({"nodes": True}, "nodes must be a positive integer"),
        ({"rank": 1}, r"rank must be an integer in 0\.\.0"),
        ({"nodes": 3, "rank": 3, "dist_init_addr": "h:1"}, r"rank must be an integer in 0\.\.2"),
        ({"nodes": 2}, "needs dist_init_addr HOST:PORT"),
        ({"nodes": 2, "dist_init_addr": "h:0"}, "must be a number from 1 to 65535"),
        ({"nodes": 2, "dist_init_addr": ":80"}, "has no host"),
        ({"join_timeout_s": 0}, "join_timeout_s must be"),
        ({"heartbeat_s": float("inf")}, "heartbeat_s must be"),
        ({"heartbeat_s": 2.0, "peer_timeout_s": 2.0}, "must exceed heartbeat_s"),
    ],
)
def test_config_validation_multi_node(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(EngineError, match=needle):
        SimConfig(**kwargs)


def test_config_multi_node_defaults_and_ipv6() -> None:
    single = SimConfig()
    assert (single.nodes, single.rank, single.worker) == (1, 0, False)
    assert (single.join_timeout_s, single.heartbeat_s, single.peer_timeout_s) == (300, 1, 5)
    assert SimConfig(dist_init_addr="ignored").dist_init_addr == "ignored"  # nodes 1
    assert not SimConfig(nodes=2, dist_init_addr="10.0.0.1:29500").worker
    assert SimConfig(nodes=2, rank=1, dist_init_addr="[fd00::1]:29500").worker
    assert parse_hostport("[fd00::1]:29500") == ("fd00::1", 29500)
    assert parse_hostport("node-1.fabric:1") == ("node-1.fabric", 1)
