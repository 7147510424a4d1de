"""``llmgw ctl replicas [MODEL]``, ``replicas sleep REPLICA [--level]`` and ``replicas wake
REPLICA``: what the operator reads, and the admin API's refusals as they are told."""

from __future__ import annotations

from typing import Any

from llmgw.errors import APIError
from tests.unit.cli.ctl.fakeapi import FakeAPI


def _row(state: str, **extra: Any) -> dict[str, Any]:
    return {
        "replica": "m-1",
        "model": "m",
        "profile": "default",
        "state": state,
        "node": "gpu-1",
        "shard": "m-1-s0",
        "rank": 0,
        "port": 8001,
        "pid": 10,
        "restarts": 0,
        "exit_code": None,
        "reason": "",
        "inflight": 0,
        "routable": state == "ready",
        "sleep_level": 0,
        "host_memory_mib": 0,
        **extra,
    }


def test_the_list_shows_asleep_with_its_level_and_host_memory() -> None:
    rows = [_row("asleep", sleep_level=1, host_memory_mib=512), _row("waking", replica="m-2")]
    api = FakeAPI(lambda method, path, body: rows)
    result = api.ctl("replicas", "m")
    assert result.exit_code == 0, result.output
    assert api.requests == ["GET /api/replicas?model=m"]
    assert "asleep (level 1, 512 MiB host)" in result.output
    assert "waking" in result.output
    assert api.ctl("replicas").exit_code == 0
    assert api.requests[-1] == "GET /api/replicas"


def test_sleep_and_wake_send_the_orders() -> None:
    def handler(method: str, path: str, body: Any) -> Any:
        if path.endswith("/sleep"):
            return {"replica": "m-1", "level": body.get("level", 1), "state": "falling_asleep"}
        return {"replica": "m-1", "state": "waking"}

    api = FakeAPI(handler)
    result = api.ctl("replicas", "sleep", "m-1", "--level", "2")
    assert result.exit_code == 0, result.output
    assert api.calls[-1] == ("POST", "/api/replicas/m-1/sleep", {"level": 2})
    assert result.output == (
        "m-1 is falling asleep at level 2; wake it with 'llmgw ctl replicas wake m-1'\n"
    )
    result = api.ctl("replicas", "sleep", "m-1")
    assert api.calls[-1] == ("POST", "/api/replicas/m-1/sleep", {})
    result = api.ctl("replicas", "wake", "m-1")
    assert result.exit_code == 0, result.output
    assert api.calls[-1] == ("POST", "/api/replicas/m-1/wake", {})
    assert "m-1 is waking" in result.output


def test_a_refusal_is_told_as_the_control_plane_says_it() -> None:
    def handler(method: str, path: str, body: Any) -> Any:
        raise APIError(
            "replica m-1 of model m cannot sleep: its profile has no 'sleep'",
            status=409,
            code="conflict",
        )

    result = FakeAPI(handler).ctl("replicas", "sleep", "m-1")
    assert result.exit_code == 1
    assert "cannot sleep: its profile has no 'sleep'" in result.output


def test_a_level_out_of_range_is_a_usage_error() -> None:
    result = FakeAPI(lambda *a: {}).ctl("replicas", "sleep", "m-1", "--level", "3")
    assert result.exit_code == 2
    assert "--level" in result.output
