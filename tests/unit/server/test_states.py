"""A node's health beside its state: read from whether it is connected and the reasons of its
stored inventory, and the event a change of those reasons is worth."""

from __future__ import annotations

from llmgw.server.store.states import NodeHealth, NodeState, health_change, node_health

DOCKER = {"code": "docker", "message": "dockerd cannot be reached", "engine": "", "fabric": ""}
VLLM = {"code": "engine", "message": "engine vllm will not run", "engine": "vllm", "fabric": ""}


def test_health_is_not_a_state() -> None:
    assert set(NodeHealth) & {str(s) for s in NodeState} == set()
    assert [str(h) for h in NodeHealth] == ["healthy", "degraded", "offline"]


def test_health_from_connection_and_reasons() -> None:
    assert node_health(True, False) == NodeHealth.HEALTHY
    assert node_health(True, True) == NodeHealth.DEGRADED
    # Offline wins: what a node said before its stream went down is no longer news.
    assert node_health(False, True) == NodeHealth.OFFLINE
    assert node_health(False, False) == NodeHealth.OFFLINE


def test_an_event_when_reasons_appear_change_and_go() -> None:
    assert health_change({}, {"degraded": []}) is None
    assert health_change({"degraded": [VLLM]}, {"degraded": [VLLM]}) is None
    assert health_change({}, {"degraded": [VLLM]}) == ("node_degraded", VLLM["message"])
    assert health_change({"degraded": [VLLM]}, {"degraded": [VLLM, DOCKER]}) == (
        "node_degraded",
        f"{VLLM['message']}; {DOCKER['message']}",
    )
    assert health_change({"degraded": [VLLM, DOCKER]}, {"degraded": []}) == (
        "node_healthy",
        f"no longer degraded (was: {VLLM['message']}; {DOCKER['message']})",
    )
