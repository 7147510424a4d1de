"""Deploying a disaggregated model through the admin API's functions: its pool rows written
with it (profiles, counts, policies), switched to an aggregated profile and back, scaled per
pool, undeployed whole, all in one transaction; the refusals (a pool named on its own,
--replicas for a disaggregated profile, pools for an aggregated one); what the API lists."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmgw.contracts.catalog import parse_catalog
from llmgw.errors import Conflict, NotFound
from llmgw.server.admin.context import AdminContext, BadRequest
from llmgw.server.admin.models import (
    apply_catalog,
    catalog_json,
    deploy,
    listed_models,
    model_json,
    replica_rows,
    undeploy,
)
from llmgw.server.common.metrics import Metrics
from llmgw.server.store import Store
from tests.unit.server.scheduler_rig import SchedulerRig

PD = {
    "engine": "sim",
    "gpus": 1,
    "disaggregated": {
        "prefill": {"gpus": 1, "replicas": 1, "args": ["--chunk", "512"]},
        "decode": {"gpus": 2, "replicas": {"min": 1, "max": 4}},
    },
}
PD2 = {
    "engine": "sim",
    "gpus": 1,
    "disaggregated": {
        "prefill": {"gpus": 1, "replicas": 2},
        "decode": {"gpus": 1, "replicas": 3},
    },
}
AGG = {"engine": "sim", "gpus": 1}


class _Router:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def endpoints(self, model: str | None = None) -> list[Any]:
        return []

    def remove_model(self, name: str) -> None:
        self.removed.append(name)


@pytest.fixture
def ctx(cp: SchedulerRig) -> SimpleNamespace:
    catalog = parse_catalog(
        {"models": {"m": {"profiles": {"pd": PD, "pd2": PD2, "agg": AGG}}}}, source="catalog"
    )
    cp.store.put_catalog_model("m", catalog.models["m"].to_dict()["profiles"])
    return SimpleNamespace(
        store=cp.store,
        scheduler=cp.scheduler(),
        router=_Router(),
        serving=SimpleNamespace(refresh_models=lambda: None),
        planner=None,
        metrics=Metrics(),
        tokenizer_problem=lambda name: None,
    )


def _apply(ctx: SimpleNamespace, profiles: dict[str, Any], **model: Any) -> Any:
    body = {"models": {"m": {"profiles": profiles, **model}}}
    return apply_catalog(cast(AdminContext, ctx), body, actor="alice")


def _deploy(ctx: SimpleNamespace, **body: Any) -> Any:
    return deploy(cast(AdminContext, ctx), {"name": "m", **body}, actor="alice")


def _rows(store: Store) -> dict[str, tuple[str, int, dict[str, Any]]]:
    return {m.name: (m.profile, m.replicas, m.scaling) for m in store.list_models()}


def test_a_disaggregated_profile_writes_the_model_and_both_pools(ctx: SimpleNamespace) -> None:
    model, created = _deploy(ctx, profile="pd")
    assert not created
    decode_policy = ctx.store.get_model("m#decode").scaling
    assert _rows(ctx.store) == {
        "m": ("pd", 0, {}),
        "m#prefill": ("pd", 1, {}),
        "m#decode": ("pd", 1, decode_policy),
    }
    assert (decode_policy["min"], decode_policy["max"]) == (1, 4)
    prefill = ctx.store.get_model("m#prefill")
    # The pool's profiles: every disaggregated profile of the model, the pool's side of it.
    assert sorted(prefill.profiles) == ["pd", "pd2"]
    assert prefill.profiles["pd"]["role"] == "prefill"
    assert prefill.profiles["pd"]["args"] == ["--chunk", "512"]
    assert "disaggregated" not in prefill.profiles["pd"]
    assert ctx.store.get_model("m#decode").profiles["pd"]["gpus"] == 2
    event = ctx.store.list_events(limit=1)[0]
    assert (event.kind, event.actor) == ("model_deployed", "alice")
    assert "prefill 1, decode 1-4" in event.message
    data = model_json(cast(AdminContext, ctx), model)
    assert data["replicas"] == 0
    assert data["pools"]["prefill"]["replicas"] == 1
    assert data["pools"]["decode"]["scaling"]["max"] == 4


def test_the_pools_are_listed_under_their_model_only(ctx: SimpleNamespace) -> None:
    _deploy(ctx, profile="pd")
    assert [m.name for m in listed_models(ctx.store)] == ["m"]
    assert list(catalog_json(cast(AdminContext, ctx))) == ["m"]


def test_overrides_set_each_pool_and_a_redeploy_keeps_them(ctx: SimpleNamespace) -> None:
    _deploy(ctx, profile="pd", pools={"prefill": 3, "decode": {"min": 2, "max": 6}})
    assert ctx.store.get_model("m#prefill").replicas == 3
    decode = ctx.store.get_model("m#decode")
    assert (decode.replicas, decode.scaling["min"], decode.scaling["max"]) == (2, 2, 6)
    # One pool scaled alone: the other keeps its count.
    _deploy(ctx, pools={"prefill": 1})
    assert ctx.store.get_model("m#prefill").replicas == 1
    assert ctx.store.get_model("m#decode").scaling["max"] == 6
    _deploy(ctx)  # a redeploy of the same profile keeps both
    assert ctx.store.get_model("m#prefill").replicas == 1
    assert ctx.store.get_model("m#decode").scaling["max"] == 6


def test_each_pools_target_tokens_is_stored_with_its_policy(ctx: SimpleNamespace) -> None:
    pools = {
        "prefill": {"min": 1, "max": 4, "target_tokens": 16000},
        "decode": {"min": 1, "max": 8, "target_tokens": 4096},
    }
    _deploy(ctx, profile="pd", pools=pools)
    assert ctx.store.get_model("m#prefill").scaling["target_tokens"] == 16000
    assert ctx.store.get_model("m#decode").scaling["target_tokens"] == 4096
    event = ctx.store.list_events(limit=1)[0]
    assert "1-4 by demand (8 in flight or 16000 tokens each)" in event.message
    with pytest.raises(BadRequest, match=r"pools\.decode\.target_tokens: must be a whole"):
        _deploy(ctx, pools={"decode": {"min": 1, "max": 8, "target_tokens": -1}})
    assert ctx.store.get_model("m#decode").scaling["target_tokens"] == 4096  # unchanged


def test_switching_to_aggregated_removes_the_pools_and_back(
    ctx: SimpleNamespace, cp: SchedulerRig
) -> None:
    _deploy(ctx, profile="pd")
    replica = cp.store.add_replica("m#prefill")
    assert "#" not in replica.id  # ids go into URL paths
    _deploy(ctx, profile="agg", replicas=2)
    assert _rows(ctx.store) == {"m": ("agg", 2, {})}
    assert replica.id in cp.removed
    own = cp.store.add_replica("m")
    _deploy(ctx, profile="pd2")
    assert _rows(ctx.store) == {
        "m": ("pd2", 0, {}),
        "m#prefill": ("pd2", 2, {}),
        "m#decode": ("pd2", 3, {}),
    }
    assert own.id in cp.removed  # the model's own replicas give way to its pools


def test_switching_between_disaggregated_profiles_rolls_the_pools(
    ctx: SimpleNamespace, cp: SchedulerRig
) -> None:
    _deploy(ctx, profile="pd")
    replica = cp.store.add_replica("m#decode")
    _deploy(ctx, profile="pd2")
    assert _rows(ctx.store)["m#decode"] == ("pd2", 3, {})
    # The running replica of profile pd stays until the scheduler's roll replaces it.
    assert cp.store.get_replica(replica.id).profile == "pd"
    assert replica.id not in cp.removed


def test_undeploy_removes_the_model_and_both_pools(ctx: SimpleNamespace, cp: SchedulerRig) -> None:
    _deploy(ctx, profile="pd")
    replicas = [cp.store.add_replica("m#prefill").id, cp.store.add_replica("m#decode").id]
    undeploy(cast(AdminContext, ctx), "m", actor="alice")
    assert _rows(ctx.store) == {}
    assert sorted(cp.removed) == sorted(replicas)
    assert sorted(ctx.router.removed) == ["m", "m#decode", "m#prefill"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"name": "m#prefill", "replicas": 2},
            r"prefill pool of the disaggregated model m.*--prefill",
        ),
        ({"name": "m#decode", "profile": "pd"}, r"decode pool of .* model m.*--decode N\|MIN-MAX"),
    ],
)
def test_a_pool_is_not_deployed_or_scaled_on_its_own(
    ctx: SimpleNamespace, body: dict[str, Any], message: str
) -> None:
    _deploy(ctx, profile="pd")
    before = _rows(ctx.store)
    with pytest.raises(BadRequest, match=message):
        deploy(cast(AdminContext, ctx), body, actor="alice")
    assert _rows(ctx.store) == before


def test_a_pool_is_not_undeployed_on_its_own(ctx: SimpleNamespace) -> None:
    _deploy(ctx, profile="pd")
    with pytest.raises(BadRequest, match=r"'llmgw ctl undeploy m' removes the model with both"):
        undeploy(cast(AdminContext, ctx), "m#decode", actor="alice")
    assert len(_rows(ctx.store)) == 3


def test_replicas_is_refused_for_a_disaggregated_profile(ctx: SimpleNamespace) -> None:
    with pytest.raises(BadRequest, match=r"profile pd is disaggregated.*--prefill N\|MIN-MAX"):
        _deploy(ctx, profile="pd", replicas=2)
    _deploy(ctx, profile="pd")
    with pytest.raises(BadRequest, match="instead of --replicas"):
        _deploy(ctx, replicas={"min": 1, "max": 3})
    assert _rows(ctx.store)["m"] == ("pd", 0, {})


def test_pools_are_refused_for_an_aggregated_profile(ctx: SimpleNamespace) -> None:
    with pytest.raises(BadRequest, match=r"not disaggregated.*give --replicas"):
        _deploy(ctx, profile="agg", pools={"decode": 2})
    assert _rows(ctx.store) == {"m": ("pd", 0, {})}


@pytest.mark.parametrize(
    ("pools", "message"),
    [
        ({"mixed": 1}, "pools has no 'mixed'"),
        ({"decode": -1}, r"pools\.decode.*whole number"),
        ({"decode": {"min": 3, "max": 1}}, r"min \(3\) is above max \(1\)"),
        ([1, 2], "pools must be an object with prefill and/or decode"),
        ({}, "pools must be an object"),
    ],
)
def test_bad_pool_counts_are_refused(ctx: SimpleNamespace, pools: Any, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        _deploy(ctx, profile="pd", pools=pools)
    assert _rows(ctx.store) == {"m": ("pd", 0, {})}


def test_a_failure_midway_leaves_nothing_written(
    ctx: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One transaction: the model's row and its first pool are taken back with the second."""
    real = ctx.store.set_scaling

    def failing(name: str, scaling: dict[str, Any], *, replicas: int) -> Any:
        if name == "m#decode":
            raise RuntimeError("the database went away")
        return real(name, scaling, replicas=replicas)

    _deploy(ctx, profile="agg", replicas=1)
    monkeypatch.setattr(ctx.store, "set_scaling", failing)
    with pytest.raises(RuntimeError):
        _deploy(ctx, profile="pd")
    assert _rows(ctx.store) == {"m": ("agg", 1, {})}


def test_an_adhoc_model_may_be_disaggregated(ctx: SimpleNamespace) -> None:
    deploy(
        cast(AdminContext, ctx),
        {
            "name": "adhoc",
            "engine": "sim",
            "params": {},
            "disaggregated": {"prefill": {"gpus": 0}, "decode": {"gpus": 0, "replicas": 2}},
        },
        actor="alice",
    )
    assert _rows(ctx.store)["adhoc#decode"] == ("default", 2, {})
    rows = replica_rows(cast(AdminContext, ctx), "adhoc")
    assert rows == []
    with pytest.raises(BadRequest, match="cannot disaggregate"):
        deploy(
            cast(AdminContext, ctx),
            {
                "name": "other",
                "engine": "llamacpp",
                "source": "llama-3-8b",
                "params": {},
                "disaggregated": {"prefill": {"gpus": 0}, "decode": {"gpus": 0}},
            },
            actor="alice",
        )
    with pytest.raises(NotFound):
        ctx.store.get_model("other")


def test_a_catalog_change_reaches_the_deployed_pools(ctx: SimpleNamespace) -> None:
    _apply(ctx, {"pd": PD, "pd2": PD2, "agg": AGG})  # unchanged: no pools appear
    assert _rows(ctx.store) == {"m": ("pd", 0, {})}
    _deploy(ctx, profile="pd", pools={"prefill": 2})
    more = {**PD, "disaggregated": {**PD["disaggregated"], "prefill": {"gpus": 1, "replicas": 5}}}
    (row,) = _apply(ctx, {"pd": more, "pd2": PD2, "agg": AGG})
    assert row["change"] == "updated"
    assert ctx.store.get_model("m#prefill").replicas == 5  # the catalog's count now
    assert ctx.store.get_model("m#prefill").profiles["pd"]["gpus"] == 1


def test_a_catalog_that_deploys_a_disaggregated_model_writes_its_pools(
    ctx: SimpleNamespace,
) -> None:
    _apply(ctx, {"pd2": PD2}, replicas=4)
    assert _rows(ctx.store) == {
        "m": ("pd2", 0, {}),
        "m#prefill": ("pd2", 2, {}),
        "m#decode": ("pd2", 3, {}),
    }


def test_a_catalog_that_makes_the_profile_aggregated_removes_the_pools(
    ctx: SimpleNamespace, cp: SchedulerRig
) -> None:
    _deploy(ctx, profile="pd")
    replica = cp.store.add_replica("m#decode")
    _apply(ctx, {"pd": AGG, "pd2": PD2}, replicas=2)
    assert _rows(ctx.store) == {"m": ("pd", 2, {})}
    assert cp.removed == [replica.id]


def test_a_catalog_may_not_drop_the_deployed_disaggregated_profile(ctx: SimpleNamespace) -> None:
    _deploy(ctx, profile="pd")
    with pytest.raises(Conflict, match=r"disaggregated profile pd deployed .* drop it"):
        _apply(ctx, {"pd2": PD2, "agg": AGG})
    assert len(_rows(ctx.store)) == 3
