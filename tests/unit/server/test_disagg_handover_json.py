"""A disaggregated model's ``handover`` and its pools' ``load`` in the admin API's model JSON
(:mod:`llmgw.server.admin.handover`), from this instance's gateway metrics and router; and
the quantiles read from a histogram's buckets."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmgw.contracts.catalog import parse_catalog
from llmgw.server.admin.context import AdminContext
from llmgw.server.admin.models import deploy, model_json
from llmgw.server.common.metrics import Histogram, Metrics
from llmgw.server.gateway.routing import Endpoint, Router
from tests.unit.server.scheduler_rig import SchedulerRig

PD = {
    "engine": "sim",
    "gpus": 1,
    "disaggregated": {"prefill": {"gpus": 1, "replicas": 1}, "decode": {"gpus": 1, "replicas": 2}},
}


@pytest.fixture
def ctx(cp: SchedulerRig) -> SimpleNamespace:
    catalog = parse_catalog(
        {"models": {"m": {"profiles": {"pd": PD, "agg": {"engine": "sim", "gpus": 1}}}}},
        source="catalog",
    )
    cp.store.put_catalog_model("m", catalog.models["m"].to_dict()["profiles"])
    return SimpleNamespace(
        store=cp.store,
        scheduler=cp.scheduler(),
        router=Router(),
        serving=SimpleNamespace(refresh_models=lambda: None),
        planner=None,
        metrics=Metrics(),
        tokenizer_problem=lambda name: None,
    )


def _json(ctx: SimpleNamespace, **body: Any) -> dict[str, Any]:
    model, _ = deploy(cast(AdminContext, ctx), {"name": "m", **body}, actor="alice")
    return model_json(cast(AdminContext, ctx), model)


def test_the_handover_shows_what_this_gateway_counted(ctx: SimpleNamespace) -> None:
    m: Metrics = ctx.metrics
    m.disagg_requests.inc(("m", "handed_over"), 9)
    m.disagg_requests.inc(("m", "fallback"), 3)
    m.disagg_requests.inc(("other", "handed_over"), 50)  # another model's: not this one's
    m.disagg_fallbacks.inc(("m", "transfer_timeout"), 2)
    m.disagg_fallbacks.inc(("m", "no_prefill"))
    m.disagg_prefill_retries.inc(("m",))
    for seconds in (0.02,) * 9 + (4.0,):
        m.disagg_handover.observe(("m",), seconds)
    m.disagg_transfer_tokens.inc(("m",), 900)
    m.disagg_transfer_bytes.inc(("m",), 900 * 1024)
    handover = _json(ctx, profile="pd")["handover"]
    assert handover["requests"] == {"fallback": 3, "handed_over": 9}
    assert handover["handed_over"] == 9
    assert handover["fallbacks"] == {"no_prefill": 1, "transfer_timeout": 2}
    assert handover["prefill_retries"] == 1
    seconds = handover["handover_seconds"]
    assert seconds["count"] == 10
    assert 0.01 <= seconds["p50"] <= 0.025
    assert 2.5 <= seconds["p99"] <= 5.0
    assert (handover["transfer_tokens"], handover["transfer_bytes"]) == (900, 921600)
    assert handover["seen_by"] == "this instance's gateway"


def test_before_any_request_the_handover_is_zero_and_bytes_unknown(ctx: SimpleNamespace) -> None:
    handover = _json(ctx, profile="pd")["handover"]
    assert handover["requests"] == {} and handover["fallbacks"] == {}
    assert handover["handover_seconds"] == {"p50": None, "p99": None, "count": 0}
    assert (handover["transfer_tokens"], handover["transfer_bytes"]) == (0, None)


def test_each_pools_load_is_its_ready_replicas_requests_and_tokens(ctx: SimpleNamespace) -> None:
    router: Router = ctx.router
    for shard, pool, inflight, tokens, decoding in (
        ("p0", "m#prefill", 2, 3000, 0),
        ("d0", "m#decode", 4, 400, 350),
        ("d1", "m#decode", 1, 100, 90),
        ("x0", "m", 7, 7, 7),  # the model's own name: no pool's
    ):
        router.set_ready(
            Endpoint(pool, shard, shard, "n1", "127.0.0.1:1", inflight, 0, decoding, tokens)
        )
    pools = _json(ctx, profile="pd")["pools"]
    assert pools["prefill"]["load"] == {"inflight": 2, "tokens": 3000, "decoding": 0}
    assert pools["decode"]["load"] == {"inflight": 5, "tokens": 500, "decoding": 440}


def test_an_aggregated_model_has_no_handover(ctx: SimpleNamespace) -> None:
    data = _json(ctx, profile="agg", replicas=1)
    assert data["pools"] is None and data["handover"] is None


def test_quantiles_interpolate_within_the_buckets() -> None:
    h = Histogram("h", "h", ("m",), buckets=(1.0, 2.0, 4.0))
    assert h.quantile(("a",), 0.5) is None
    for value in (0.5, 1.5, 1.5, 3.0):
        h.observe(("a",), value)
    assert h.quantile(("a",), 0.25) == pytest.approx(1.0)
    assert h.quantile(("a",), 0.5) == pytest.approx(1.5)
    assert h.quantile(("a",), 1.0) == pytest.approx(4.0)
    h.observe(("a",), 100.0)  # beyond the last bound: read as that bound
    assert h.quantile(("a",), 1.0) == pytest.approx(4.0)
