"""A disaggregated model's hand-over as the admin API shows it: what this instance's gateway
counted of it (requests handed over, fallbacks by reason, prefill retries, the hand-over's
time, tokens and bytes moved; :mod:`llmgw.server.gateway.disagg`) and each pool's load now
(requests in flight and the tokens they weigh, the figures the planner scales a pool by).

All of it is this instance's gateway's: a standby's gateway counts its own requests, so an
operator behind several gateways reads each one's (or their ``/metrics``, summed).
"""

from __future__ import annotations

from typing import Any

from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.routing import Router

__all__ = ["handover_json", "pool_load"]


def handover_json(metrics: Metrics, model: str) -> dict[str, Any]:
    """Model ``model``'s hand-overs as this instance's gateway saw them: ``requests`` by
    outcome (handed_over, failed, fallback), ``fallbacks`` by reason, ``prefill_retries``,
    ``handover_seconds`` (p50 and p99 from the histogram's buckets: the prefill's answer to
    the decode's first streamed token; None before any), ``transfer_tokens`` and
    ``transfer_bytes`` (None: the model's KV bytes per token are not known)."""
    outcomes = {
        outcome: int(value)
        for (name, outcome), value in sorted(metrics.disagg_requests.values.items())
        if name == model and value
    }
    fallbacks = {
        reason: int(value)
        for (name, reason), value in sorted(metrics.disagg_fallbacks.values.items())
        if name == model and value
    }
    key = (model,)
    moved_bytes = metrics.disagg_transfer_bytes.values.get(key)
    return {
        "requests": outcomes,
        "handed_over": outcomes.get("handed_over", 0),
        "fallbacks": fallbacks,
        "prefill_retries": int(metrics.disagg_prefill_retries.values.get(key, 0)),
        "handover_seconds": {
            "p50": metrics.disagg_handover.quantile(key, 0.5),
            "p99": metrics.disagg_handover.quantile(key, 0.99),
            "count": sum(metrics.disagg_handover.counts.get(key) or ()),
        },
        "transfer_tokens": int(metrics.disagg_transfer_tokens.values.get(key, 0)),
        "transfer_bytes": None if moved_bytes is None else int(moved_bytes),
        "seen_by": "this instance's gateway",
    }


def pool_load(router: Router, pool: str) -> dict[str, int]:
    """A pool's load on this instance's gateway now: its ready replicas' requests in flight
    and the tokens they weigh (a prefill pool's: prompts; a decode pool's: outputs; what
    the planner's ``target_tokens`` compares), and a decode pool's output tokens still to
    generate (what its replicas are chosen by)."""
    eps = router.endpoints(pool)
    return {
        "inflight": sum(ep.inflight for ep in eps),
        "tokens": sum(ep.tokens for ep in eps),
        "decoding": sum(ep.decoding for ep in eps),
    }
