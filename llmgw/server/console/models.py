"""The Models pages: the catalog (every model the control plane knows, each profile with its
engine, tasks and what it needs), the deployed models with their ready and desired replicas
and why the scheduler cannot place them, and a model's page with its replicas live; and
their actions: deploy a catalog profile, scale (a disaggregated model: each of its pools,
as ``ctl deploy --prefill/--decode``), switch profile (a rolling replacement the scheduler
does one replica at a time), undeploy.

What is shown and done is the admin API's own code (:mod:`llmgw.server.admin.models`); a
refusal comes back as the page again with what is wrong and the operator's input kept."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from llmgw.contracts.catalog import profile_tasks
from llmgw.contracts.disagg import ROLES
from llmgw.errors import ConfigError, Conflict, LlmgwError, NotFound
from llmgw.log import kv
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest
from llmgw.server.admin.models import (
    catalog_json,
    deploy,
    listed_models,
    model_json,
    replica_rows,
    undeploy,
)
from llmgw.server.admin.pools import count_text, pools_of
from llmgw.server.console.auth import form_of
from llmgw.server.console.charts import Line, line_chart
from llmgw.server.console.pages import RECENT_EVENTS, Pages, event_json, model_path
from llmgw.server.console.site import SESSION, Site

__all__ = ["MODEL_ACTIONS", "ModelPages"]

log = logging.getLogger("llmgw.server.console")

MODEL_ACTIONS: Final = ("scale", "profile", "undeploy")
"""The actions of a model's page, each ``POST /ui/models/{name}/{action}``."""
MAX_REPLICAS: Final = 1000


def _needs(spec: Mapping[str, Any]) -> str:
    """What a profile needs to be placed, in a few words: ``2 GPUs x 2 nodes, 40 GiB per
    GPU``; ``no GPU``."""
    gpus = spec.get("gpus") or 0
    nodes = spec.get("nodes") or 1
    if not gpus:
        text = "no GPU"
    else:
        text = f"{gpus} GPU{'s' if gpus != 1 else ''}"
    if nodes != 1:
        text += f" x {nodes} nodes"
    memory = spec.get("gpu_memory")
    if isinstance(memory, int) and memory > 0:
        text += f", {memory / 1024:.0f} GiB per GPU"
    return text


def _source(spec: Mapping[str, Any]) -> str:
    source = spec.get("source")
    if isinstance(source, Mapping):
        return str(source.get("url", ""))
    return "" if source is None else str(source)


def _replicas_value(raw: str) -> int | dict[str, int]:
    """A form's replicas: a whole number from 0 to 1000, or MIN-MAX (``0-8``) to scale by
    demand between them (the API checks the bounds); refused (BadRequest) otherwise."""
    text = raw.strip()
    low, dash, high = text.partition("-")
    if dash and low.isdigit() and high.isdigit():
        return {"min": int(low), "max": int(high)}
    if not text.isdigit() or int(text) > MAX_REPLICAS:
        raise BadRequest(
            f"replicas must be a whole number from 0 to {MAX_REPLICAS} (or MIN-MAX, e.g. 0-8, "
            f"to scale by demand); got {text[:20]!r}"
        )
    return int(text)


def _with_prefetch(replicas: int | dict[str, Any], form: Mapping[str, str]) -> int | dict[str, Any]:
    """The scale form's replicas with its prefetch checkbox: a range with ``prefetch: true``
    when ticked (a count N as ``{min: N, max: N}``, which cannot move, as ctl sends it)."""
    if not form.get("prefetch"):
        return replicas
    if isinstance(replicas, int):
        return {"min": replicas, "max": replicas, "prefetch": True}
    return {**replicas, "prefetch": True}


def _prefetch_shown(model: Mapping[str, Any]) -> bool:
    """Whether the scale form's prefetch checkbox starts ticked: the model's policy asks."""
    scaling = model.get("scaling")
    return isinstance(scaling, Mapping) and scaling.get("prefetch") is True


def _replicas_shown(model: Mapping[str, Any]) -> str:
    """What the scale form shows: the count, or the range of a model that scales by demand."""
    scaling = model.get("scaling")
    if isinstance(scaling, Mapping) and "min" in scaling:
        if scaling["min"] == scaling["max"]:
            return str(scaling["min"])  # a count with prefetch: the box says the rest
        return f"{scaling['min']}-{scaling['max']}"
    return str(model["replicas"])


class ModelPages:
    """``/ui/models``, ``/ui/models/{name}`` and their actions."""

    def __init__(self, site: Site, pages: Pages) -> None:
        self.site = site
        self.pages = pages

    @property
    def ctx(self) -> AdminContext:
        return self.site.ctx

    # -- reading ------------------------------------------------------------------------------

    def _catalog(self) -> list[dict[str, Any]]:
        """One row per profile of every model, the deployed one marked."""
        store = self.ctx.store
        deployed = {m.name: m for m in listed_models(store)}
        rows = []
        for name, entry in sorted(catalog_json(self.ctx).items()):
            model = deployed.get(name)
            # A disaggregated model places nothing itself: its pools do.
            serving = model is not None and (model.replicas > 0 or bool(pools_of(store, name)))
            for profile, spec in sorted(entry["profiles"].items()):
                rows.append(
                    {
                        "model": name,
                        "profile": profile,
                        "engine": spec.get("engine", ""),
                        "tasks": ", ".join(profile_tasks(spec)),
                        "needs": _needs(spec),
                        "source": _source(spec),
                        "deployed": serving and model is not None and model.profile == profile,
                    }
                )
        return rows

    def _deployed(self) -> dict[str, Any]:
        """The models with replicas wanted or still running, each with its replicas' states."""
        ctx = self.ctx
        running = Counter(r.model for r in ctx.store.list_replicas())
        models = [
            m
            for m in (model_json(ctx, model) for model in listed_models(ctx.store))
            if m["replicas"] > 0 or running.get(m["name"]) or m["pools"]
        ]
        states: dict[str, Counter[str]] = {}
        for row in replica_rows(ctx):
            if row["rank"] == 0:
                states.setdefault(row["model"], Counter())[row["state"]] += 1
        for model in models:
            model["states"] = sorted(states.get(model["name"], Counter()).items())
            model["url"] = model_path(model["name"])
        return {"deployed": models}

    def _models_page(
        self,
        request: web.Request,
        *,
        status: int = 200,
        problem: str = "",
        form: Mapping[str, str] | None = None,
    ) -> web.Response:
        catalog = self._catalog()
        choices: dict[str, list[str]] = {}
        for row in catalog:
            choices.setdefault(row["model"], []).append(row["profile"])
        wanted = form if form is not None else request.query
        return self.pages.answer(
            request,
            "models.html",
            {"deployed": "_models_deployed.html"},
            self._deployed,
            status=status,
            page="models",
            catalog=catalog,
            choices=choices,
            is_admin=principal_of(request).is_admin,
            problem=problem,
            chosen={
                "name": str(wanted.get("name", "")),
                "profile": str(wanted.get("profile", "")),
                "replicas": str(wanted.get("replicas", "1")),
            },
        )

    async def models(self, request: web.Request) -> web.Response:
        return self._models_page(request)

    def _model_values(self, name: str) -> dict[str, Any]:
        ctx = self.ctx
        model = model_json(ctx, ctx.store.get_model(name))  # NotFound: the 404 page names it
        replicas = replica_rows(ctx, name)
        return {
            "model": model,
            "replicas": replicas,
            "scaling_chart": self._scaling_chart(name),
            "events": [
                event_json(e) for e in ctx.store.list_events(limit=RECENT_EVENTS, subject=name)
            ],
        }

    def _scaling_chart(self, name: str) -> str:
        """A model that scales by demand: its replicas (wanted, ready) against its demand
        over the last hour, as the planner sampled them; '' for a fixed count."""
        planner = self.ctx.planner
        samples = planner.history.get(name) if planner is not None else None
        if not samples:
            return ""
        return line_chart(
            f"{name}: replicas and demand",
            [
                Line("wanted", [(p.t, float(p.replicas)) for p in samples]),
                Line("ready", [(p.t, float(p.ready)) for p in samples]),
                Line("demand", [(p.t, float(p.demand)) for p in samples]),
            ],
            unit="",
            now=samples[-1].t,
        )

    def _model_page(
        self,
        request: web.Request,
        name: str,
        *,
        status: int = 200,
        problem: str = "",
        form: Mapping[str, str] | None = None,
    ) -> web.Response:
        values = self._model_values(name)  # read once, for the page or its live part
        model = values["model"]
        return self.pages.answer(
            request,
            "model.html",
            {"detail": "_model_detail.html"},
            lambda: values,
            status=status,
            page="models",
            is_admin=principal_of(request).is_admin,
            problem=problem,
            action_url=model_path(name),
            other_profiles=[p for p in model["profiles"] if p != model["profile"]],
            chosen={
                "replicas": (form or {}).get("replicas", _replicas_shown(model)),
                # A refused form keeps what the operator ticked (an unticked box sends nothing).
                "prefetch": bool(form.get("prefetch")) if form else _prefetch_shown(model),
                "profile": (form or {}).get("profile", ""),
                # A disaggregated model's form: each pool's count or range.
                **{
                    role: (form or {}).get(role, _replicas_shown(pool))
                    for role, pool in (model["pools"] or {}).items()
                },
            },
        )

    async def model(self, request: web.Request) -> web.Response:
        return self._model_page(request, request.match_info["name"])

    # -- acting -------------------------------------------------------------------------------

    def _redirect(self, request: web.Request, location: str, message: str) -> web.Response:
        token, _session = request[SESSION]
        self.site.flash.put(token, message)
        return web.Response(status=303, headers={"Location": location})

    async def deploy(self, request: web.Request) -> web.StreamResponse:
        """``POST /ui/models``: deploy a catalog model's profile with a replica count."""
        form = form_of(request)
        actor = principal_of(request).actor
        name, profile = form.get("name", "").strip(), form.get("profile", "").strip()
        try:
            if not name or not profile:
                raise BadRequest(
                    "choose a model of the catalog and one of its profiles; a model not in "
                    "the catalog is added with 'llmgw ctl models apply -f catalog.yaml'"
                )
            body: dict[str, Any] = {"name": name, "profile": profile}
            spec = catalog_json(self.ctx).get(name, {}).get("profiles", {}).get(profile, {})
            split = spec.get("disaggregated") is not None
            if not split:
                # A disaggregated profile's counts are its pools' (its catalog's).
                body["replicas"] = _replicas_value(form.get("replicas", ""))
            model, created = deploy(self.ctx, body, actor=actor)
        except (BadRequest, ConfigError, NotFound, Conflict) as exc:
            return self._models_page(request, status=_status(exc), problem=str(exc), form=form)
        log.info(
            "a console action",
            extra=kv(action="deploy", model=name, profile=profile, actor=actor, created=created),
        )
        wanted = (
            "its prefill and decode pools as the profile counts them"
            if split
            else f"{model.replicas} replica(s)"
        )
        return self._redirect(
            request,
            model_path(model.name),
            f"model {model.name}: profile {model.profile}, {wanted} wanted; "
            "the scheduler places them",
        )

    async def act(self, request: web.Request) -> web.StreamResponse:
        """``POST /ui/models/{name}/{action}``: scale, switch profile or undeploy."""
        name, action = request.match_info["name"], request.match_info["action"]
        if action not in MODEL_ACTIONS:
            raise NotFound(
                f"a model has no action {action[:40]!r}; its page's buttons are "
                f"{', '.join(MODEL_ACTIONS)}"
            )
        form = form_of(request)
        actor = principal_of(request).actor
        self.ctx.store.get_model(name)  # NotFound: the 404 page names it
        try:
            message, location = self._done(name, action, form, actor)
        except (BadRequest, ConfigError, NotFound, Conflict) as exc:
            return self._model_page(
                request, name, status=_status(exc), problem=f"nothing done: {exc}", form=form
            )
        except LlmgwError as exc:
            return self._model_page(
                request, name, status=500, problem=f"{action} failed: {exc}", form=form
            )
        log.info("a console action", extra=kv(action=action, model=name, actor=actor))
        return self._redirect(request, location, message)

    def _done(self, name: str, action: str, form: Mapping[str, str], actor: str) -> tuple[str, str]:
        """What ``action`` did (the flash message) and where the operator goes next."""
        ctx = self.ctx
        if action == "undeploy":
            if form.get("confirm", "").strip() != name:
                raise BadRequest(
                    f"to undeploy model {name}, confirm with its name ({name!r}) in the "
                    "form's confirmation field"
                )
            undeploy(ctx, name, actor=actor)
            return f"model {name} is undeployed: its replicas are stopping", "/ui/models"
        if action == "scale" and pools_of(ctx.store, name):
            return self._scale_pools(name, form, actor), model_path(name)
        if action == "scale":
            replicas = _with_prefetch(_replicas_value(form.get("replicas", "")), form)
            if isinstance(replicas, dict):
                replicas = _keep_policy(ctx.store.get_model(name).scaling, replicas)
            model, _created = deploy(ctx, {"name": name, "replicas": replicas}, actor=actor)
            if isinstance(replicas, int):
                return f"model {name}: {model.replicas} replica(s) wanted", model_path(name)
            prefetch = ", prefetch" if replicas.get("prefetch") else ""
            if replicas["min"] == replicas["max"] and prefetch:
                text = f"model {name}: {model.replicas} replica(s) wanted{prefetch}"
            else:
                text = (
                    f"model {name}: {replicas['min']}-{replicas['max']} replicas by demand "
                    f"({model.replicas} now){prefetch}"
                )
            return text, model_path(name)
        profile = form.get("profile", "").strip()
        if not profile:
            raise BadRequest(f"choose the profile model {name} should run")
        before = ctx.store.get_model(name)
        if profile == before.profile:
            raise BadRequest(f"model {name} runs profile {profile} already; choose another")
        model, _created = deploy(ctx, {"name": name, "profile": profile}, actor=actor)
        return (
            f"model {name} switches to profile {model.profile}: the scheduler replaces its "
            f"replicas of profile {before.profile} one at a time, each after its successor "
            "is ready",
            model_path(name),
        )

    def _scale_pools(self, name: str, form: Mapping[str, str], actor: str) -> str:
        """Scale a disaggregated model's pools from the page's Prefill and Decode fields
        (either or both; each a count or MIN-MAX), as ``ctl deploy --prefill/--decode``
        does and with its refusals; the flash message."""
        ctx = self.ctx
        given = {role: form.get(role, "").strip() for role in ROLES}
        if not any(given.values()):
            what = (
                f"model {name} is disaggregated: its replicas are its prefill and decode "
                "pools', scaled each on its own"
                if form.get("replicas", "").strip()
                else f"no count given for model {name}'s pools"
            )
            raise BadRequest(
                f"{what}; give the Prefill and/or Decode field of its page a count, or "
                "MIN-MAX (e.g. 1-4) to scale that pool by demand"
            )
        pools = pools_of(ctx.store, name)
        wanted: dict[str, int | dict[str, Any]] = {}
        for role, text in given.items():
            if not text:
                continue  # that pool keeps its count
            try:
                value = _replicas_value(text)
            except BadRequest as exc:
                raise BadRequest(f"the {role} pool's {exc}") from None
            if isinstance(value, dict) and role in pools:
                value = _keep_policy(pools[role].scaling, value)
            wanted[role] = value
        deploy(ctx, {"name": name, "pools": wanted}, actor=actor)
        counts = ", ".join(
            f"{role} {count_text(pool)}" for role, pool in pools_of(ctx.store, name).items()
        )
        return f"model {name}'s pools: {counts}"


def _keep_policy(scaling: Mapping[str, Any] | None, wanted: dict[str, Any]) -> dict[str, Any]:
    """The form's range (and prefetch) over the rest of the policy a model (or pool) has:
    its target, windows, priority and sleep stay as ctl or the API set them."""
    kept = {k: v for k, v in (scaling or {}).items() if k not in ("min", "max", "prefetch")}
    return {**kept, **wanted}


def _status(exc: Exception) -> int:
    if isinstance(exc, NotFound):
        return 404
    if isinstance(exc, Conflict):
        return 409
    return 400
