"""Admin route of the gateway's recent traffic: a model's last hour of requests per second,
errors and TTFT p50/p99 (:mod:`llmgw.server.gateway.history`), as this instance's gateway saw them.

A model is known when it is deployed or has a request in the last hour; a deployed model
without traffic answers its hour of zeros, any other name 404 naming the known ones."""

from __future__ import annotations

from aiohttp import web

from llmgw.errors import NotFound
from llmgw.server.admin.context import AdminContext, BadRequest
from llmgw.server.gateway.history import BUCKET_S

__all__ = ["MetricsRoutes"]

_NAMED = 20  # known models named at most in a 404


class MetricsRoutes:
    """``GET /api/metrics/history?model=M[&step=S]``."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    async def history(self, request: web.Request) -> web.Response:
        model = request.query.get("model", "")
        if not model:
            raise BadRequest("name the model: /api/metrics/history?model=NAME")
        step_text = request.query.get("step", str(BUCKET_S))
        try:
            step = int(step_text)
        except ValueError:
            raise BadRequest(f"step must be whole seconds, not {step_text[:40]!r}") from None
        history = self.ctx.history
        known = sorted({*self.ctx.serving.models, *history.models()})
        if model not in known:
            names = ", ".join(known[:_NAMED]) + (" ..." if len(known) > _NAMED else "")
            raise NotFound(
                f"no model {model!r} deployed or served in the last hour; "
                + (f"known: {names}" if known else "none is ('llmgw ctl models' lists them)")
            )
        try:
            points = history.series(model, step=step)
        except ValueError as exc:
            raise BadRequest(str(exc)) from None
        return web.json_response(
            {
                "model": model,
                "step_s": step,
                "points": [
                    {
                        "t": p.t,
                        "rps": p.rps,
                        "requests": p.requests,
                        "errors": p.errors,
                        "ttft_p50": p.ttft_p50,
                        "ttft_p99": p.ttft_p99,
                    }
                    for p in points
                ],
            }
        )
