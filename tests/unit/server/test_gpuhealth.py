"""Tests for GPU states: a GPU that vanishes from the inventory stays, unhealthy, until it
comes back or is forgotten; events say each change; GPUs named by index or uuid."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw.errors import NotFound
from llmgw.server.fleet.gpuhealth import (
    VANISHED,
    blocked_gpus,
    forget_vanished,
    gpu_rows,
    gpu_state_counts,
    note_gpu_health,
    resolve_gpus,
)
from llmgw.server.store import GpuCordon, Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store.open(tmp_path / "llmgw.db")
    yield s
    s.close()


def _inv(*indexes: int, health: dict[int, str] | None = None) -> dict[str, Any]:
    health = health or {}
    return {
        "gpus": [
            {"index": i, "uuid": f"GPU-{i}", **({"health": health[i]} if i in health else {})}
            for i in indexes
        ]
    }


def _events(store: Store) -> list[tuple[str, str]]:
    return [(e.kind, e.message) for e in reversed(store.list_events(limit=100))]


def test_a_vanished_gpu_stays_unhealthy_until_it_comes_back(store: Store) -> None:
    after = _inv(0, 2)
    note_gpu_health(store, "n1", _inv(0, 1, 2), after)
    assert after == _inv(0, 1, 2, health={1: VANISHED})
    again = _inv(0, 2)
    note_gpu_health(store, "n1", after, again)
    assert again == after  # still vanished, said once
    back = _inv(0, 1, 2)
    note_gpu_health(store, "n1", again, back)
    assert back == _inv(0, 1, 2)
    assert _events(store) == [
        ("gpu_unhealthy", f"GPU 1 (GPU-1) unhealthy: {VANISHED}"),
        ("gpu_healthy", f"GPU 1 (GPU-1) healthy again (was: {VANISHED})"),
    ]


def test_an_xid_reported_by_the_agent_is_an_event(store: Store) -> None:
    note_gpu_health(store, "n1", {}, _inv(0))  # a first inventory: nothing vanished
    note_gpu_health(store, "n1", _inv(0), _inv(0, health={0: "XID 79"}))
    assert _events(store) == [("gpu_unhealthy", "GPU 0 (GPU-0) unhealthy: XID 79")]


def test_forget_drops_only_vanished_gpus() -> None:
    inv = _inv(0, 1, health={1: VANISHED})
    assert forget_vanished(inv, ["GPU-0"]) is None
    assert forget_vanished(inv, ["GPU-1"]) == _inv(0)


def test_states_rows_and_counts() -> None:
    inv = _inv(0, 1, 2, health={2: "XID 48"})
    cordon = GpuCordon("n1", "GPU-1", "fan", "alice", 5.0)
    assert blocked_gpus(inv, frozenset({"GPU-1", "GPU-2"})) == {
        "GPU-1": "cordoned",
        "GPU-2": "unhealthy: XID 48",
    }
    rows = gpu_rows(inv, [cordon])
    assert [(r["index"], r["state"], r["health"]) for r in rows] == [
        (0, "healthy", ""),
        (1, "cordoned", ""),
        (2, "unhealthy", "XID 48"),
    ]
    assert rows[1]["cordon"] == {"actor": "alice", "reason": "fan", "at": 5.0}
    counts = gpu_state_counts([inv, _inv(0)], [cordon], ["n1", "n2"])
    assert dict(counts) == {"healthy": 2, "cordoned": 1, "unhealthy": 1}


def test_gpus_named_by_index_or_uuid() -> None:
    inv = _inv(0, 1)
    assert resolve_gpus("n1", inv, ["1", "GPU-0", "GPU-1"]) == ["GPU-1", "GPU-0"]
    with pytest.raises(NotFound) as info:
        resolve_gpus("n1", inv, ["7"])
    assert str(info.value) == (
        "node n1 has no GPU '7'; its GPUs: 0 (GPU-0), 1 (GPU-1) ('llmgw ctl gpus n1' lists them)"
    )
    with pytest.raises(NotFound) as info:
        resolve_gpus("n1", {}, ["0"])
    assert str(info.value) == (
        "node n1 has no GPU '0'; it reports no GPUs ('llmgw ctl gpus n1' lists them)"
    )
