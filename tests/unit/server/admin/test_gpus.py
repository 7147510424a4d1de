"""The GPU admin routes' functions: a node's GPUs with their states, cordon and uncordon by
index or uuid with events naming the actor, vanished GPUs forgotten, and every refusal."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmgw.errors import Conflict, NotFound
from llmgw.server.admin.context import AdminContext, BadRequest
from llmgw.server.admin.gpus import _gpus_of, cordon, node_gpus, uncordon
from llmgw.server.fleet.gpuhealth import VANISHED, GpuStates
from llmgw.server.store import Store


def _inventory(**health: str) -> dict[str, Any]:
    return {
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-{i}",
                "name": "H100",
                "memory_total_mib": 81559,
                "memory_used_mib": 0,
                **({"health": health[f"g{i}"]} if f"g{i}" in health else {}),
            }
            for i in range(3)
        ]
    }


@pytest.fixture
def ctx(store: Store) -> SimpleNamespace:
    store.upsert_node(
        "n1",
        dataplane_addr="10.0.0.1:9443",
        agent_version="0.1.0",
        inventory=_inventory(g2=VANISHED),
        connected=True,
    )
    kicks: list[int] = []
    scheduler = SimpleNamespace(
        gpu_blocked={}, gpus=GpuStates(), kick=lambda: kicks.append(1), kicks=kicks
    )
    return SimpleNamespace(store=store, scheduler=scheduler)


def _events(store: Store) -> list[tuple[str, str, str]]:
    return [(e.kind, e.message, e.actor) for e in reversed(store.list_events(limit=50))]


def test_cordon_by_index_and_uuid_then_uncordon(ctx: SimpleNamespace) -> None:
    admin = cast(AdminContext, ctx)
    data = cordon(admin, "n1", ["0", "GPU-1"], reason="fan noise", actor="alice")
    states = [(g["index"], g["state"]) for g in data["gpus"]]
    assert states == [(0, "cordoned"), (1, "cordoned"), (2, "unhealthy")]
    assert data["gpus"][0]["cordon"]["actor"] == "alice"
    assert data["gpus"][2]["health"] == VANISHED
    assert ctx.scheduler.kicks == [1]
    data = uncordon(admin, "n1", ["1"], actor="bob")
    assert [g["state"] for g in data["gpus"]] == ["cordoned", "healthy", "unhealthy"]
    assert _events(ctx.store) == [
        ("gpu_cordon", "GPU 0 (GPU-0), GPU 1 (GPU-1) cordoned: fan noise", "alice"),
        ("gpu_uncordon", "GPU 1 (GPU-1) uncordoned", "bob"),
    ]


def test_uncordon_forgets_a_vanished_gpu(ctx: SimpleNamespace) -> None:
    data = uncordon(cast(AdminContext, ctx), "n1", ["2"], actor="alice")
    assert [g["index"] for g in data["gpus"]] == [0, 1]
    assert [g["index"] for g in ctx.store.get_node("n1").inventory["gpus"]] == [0, 1]
    assert _events(ctx.store) == [("gpu_forgotten", "GPU 2 (GPU-2) (vanished) forgotten", "alice")]


def test_refusals(ctx: SimpleNamespace) -> None:
    admin = cast(AdminContext, ctx)
    with pytest.raises(NotFound, match="no node"):
        cordon(admin, "nope", ["0"], reason="", actor="alice")
    with pytest.raises(NotFound) as info:
        cordon(admin, "n1", ["7"], reason="", actor="alice")
    assert str(info.value) == (
        "node n1 has no GPU '7'; its GPUs: 0 (GPU-0), 1 (GPU-1), 2 (GPU-2) "
        "('llmgw ctl gpus n1' lists them)"
    )
    cordon(admin, "n1", ["0"], reason="", actor="alice")
    with pytest.raises(Conflict) as conflict:
        cordon(admin, "n1", ["0"], reason="", actor="bob")
    assert str(conflict.value) == (
        "GPU 0 of n1 already cordoned; 'llmgw ctl gpus uncordon n1 0' lifts it"
    )
    with pytest.raises(Conflict, match="GPU 1 of n1 not cordoned; nothing to undo"):
        uncordon(admin, "n1", ["1"], actor="alice")
    assert node_gpus(admin, "n1")["gpus"][0]["state"] == "cordoned"


@pytest.mark.parametrize(
    "body", [{}, {"gpus": []}, {"gpus": "3"}, {"gpus": [True]}, {"gpus": [{}]}]
)
def test_a_body_without_gpus_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest, match="'gpus' is required"):
        _gpus_of(body)
