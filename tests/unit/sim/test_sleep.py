"""The sim's sleep mode: vLLM's routes, their costs, and generation refused while asleep."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from llmgw.errors import EngineError
from llmgw.sim.config import SimConfig
from tests.unit.sim.running import running

CHAT = {"model": "llmgw-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def call(url: str, body: Any = None, *, method: str = "POST") -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw or b"null")
        except ValueError:
            return exc.code, raw.decode()


@pytest.fixture
def url() -> Iterator[str]:
    cfg = SimConfig(
        port=0, sleep_mode=True, sleep_s=0.05, wake_s=0.3, wake_level2_s=0.6, sleep_host_mib=512
    )
    with running(cfg) as base:
        yield base


def sleeping(url: str) -> dict[str, Any]:
    status, body = call(f"{url}/is_sleeping", method="GET")
    assert status == 200
    assert isinstance(body, dict)
    return body


def test_level_1_sleep_refuses_generation_and_holds_the_weights_in_host_memory(url: str) -> None:
    assert call(f"{url}/v1/chat/completions", CHAT)[0] == 200
    assert sleeping(url) == {"is_sleeping": False, "level": 0, "host_memory_mib": 0}
    assert call(f"{url}/sleep?level=1")[0] == 200
    assert sleeping(url) == {"is_sleeping": True, "level": 1, "host_memory_mib": 512}
    status, body = call(f"{url}/v1/chat/completions", CHAT)
    assert status == 503
    assert body["error"]["code"] == "model_sleeping"
    assert "/wake_up" in body["error"]["message"]
    # What needs no weights keeps answering.
    assert call(f"{url}/health", method="GET")[0] == 200
    assert call(f"{url}/v1/models", method="GET")[0] == 200
    began = time.monotonic()
    assert call(f"{url}/wake_up")[0] == 200
    assert time.monotonic() - began >= 0.3  # the wake cost
    assert sleeping(url)["is_sleeping"] is False
    assert call(f"{url}/v1/chat/completions", CHAT)[0] == 200


def test_level_2_drops_the_weights_and_needs_a_reload(url: str) -> None:
    assert call(f"{url}/sleep?level=2")[0] == 200
    assert sleeping(url) == {"is_sleeping": True, "level": 2, "host_memory_mib": 0}
    assert call(f"{url}/wake_up")[0] == 200
    # Woken without weights: still no generation until they are reloaded.
    assert call(f"{url}/v1/completions", {"model": "llmgw-sim", "prompt": "a"})[0] == 503
    began = time.monotonic()
    status, _ = call(f"{url}/collective_rpc", {"method": "reload_weights"})
    assert status == 200
    assert time.monotonic() - began >= 0.6  # a weights load
    assert call(f"{url}/v1/completions", {"model": "llmgw-sim", "prompt": "a"})[0] == 200


def test_sglang_names_sleep_and_wake_at_level_1(url: str) -> None:
    assert call(f"{url}/release_memory_occupation", {"tags": None}) == (
        200,
        {"success": True, "message": ""},
    )
    assert sleeping(url)["level"] == 1
    assert call(f"{url}/v1/embeddings", {"model": "llmgw-sim", "input": "a"})[0] == 503
    assert call(f"{url}/resume_memory_occupation", {"tags": None})[0] == 200
    assert call(f"{url}/v1/embeddings", {"model": "llmgw-sim", "input": "a"})[0] == 200


def test_refusals(url: str) -> None:
    status, body = call(f"{url}/sleep?level=3")
    assert status == 400 and "level must be 1 or 2" in body["error"]["message"]
    status, body = call(f"{url}/collective_rpc", {"method": "save_sharded_state"})
    assert status == 400 and "reload_weights" in body["error"]["message"]
    assert call(f"{url}/sleep?level=1")[0] == 200
    status, body = call(f"{url}/collective_rpc", {"method": "reload_weights"})
    assert status == 400 and "sleeping" in body["error"]["message"]
    # Sleeping twice, waking an awake engine: no-ops, as vLLM's are.
    assert call(f"{url}/sleep?level=1")[0] == 200
    assert call(f"{url}/wake_up")[0] == 200
    assert call(f"{url}/wake_up")[0] == 200


def test_without_sleep_mode_there_are_no_sleep_routes() -> None:
    with running(SimConfig(port=0)) as base:
        assert call(f"{base}/sleep?level=1")[0] == 404
        assert call(f"{base}/v1/chat/completions", CHAT)[0] == 200


@pytest.mark.parametrize("name", ["sleep_s", "wake_s", "wake_level2_s"])
def test_a_negative_cost_is_refused(name: str) -> None:
    with pytest.raises(EngineError, match=f"{name} must be a finite number >= 0"):
        SimConfig(**{name: -1.0})  # type: ignore[arg-type]


def test_a_negative_host_memory_is_refused() -> None:
    with pytest.raises(EngineError, match="sleep_host_mib"):
        SimConfig(sleep_host_mib=-1)


def test_a_sleep_with_mode_wait_lets_the_requests_in_flight_finish() -> None:
    import threading

    cfg = SimConfig(port=0, sleep_mode=True, ttft_ms=600)
    with running(cfg) as base:
        answers: list[int] = []
        slow = threading.Thread(
            target=lambda: answers.append(call(f"{base}/v1/chat/completions", CHAT)[0])
        )
        slow.start()
        time.sleep(0.2)  # the request is being answered
        began = time.monotonic()
        assert call(f"{base}/sleep?level=1&mode=wait")[0] == 200
        assert time.monotonic() - began >= 0.3  # it waited for the request
        slow.join()
        assert answers == [200]
        assert call(f"{base}/wake_up")[0] == 200
        status, body = call(f"{base}/sleep?level=1&mode=later")
        assert status == 400 and "mode must be abort, wait or keep" in body["error"]["message"]
