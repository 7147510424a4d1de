"""Admin routes about models: the deployed models, the catalog of their profiles,
deploying and undeploying, and their replicas."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from llmgw.contracts.catalog import (
    DEFAULT_PROFILE,
    MODEL_NAME,
    adhoc_profile,
    deployed_profile,
    parse_catalog,
    parse_profile,
    profile_routing,
    profile_sleep_level,
)
from llmgw.contracts.catalog import Profile as CatalogProfile
from llmgw.contracts.disagg import split_pool
from llmgw.contracts.scaling import ScalingPolicy, parse_replicas, policy_of
from llmgw.engines.registry import engine_names
from llmgw.errors import ConfigError, Conflict, NotFound
from llmgw.server.accounts.principals import principal_of
from llmgw.server.admin.context import AdminContext, BadRequest, read_json
from llmgw.server.admin.handover import handover_json, pool_load
from llmgw.server.admin.pools import (
    count_text,
    disaggregation_of,
    parse_overrides,
    pools_of,
    refuse_pool,
    remove_pools,
    sync_pools,
)
from llmgw.server.fleet.meeting import transfer_addr
from llmgw.server.store import Model, Shard, Store

__all__ = ["ModelRoutes"]


def _profiles_of(model: Model) -> dict[str, Any]:
    """A model's profiles; one stored without them has its engine and params as its
    ``default``."""
    return model.profiles or {DEFAULT_PROFILE: adhoc_profile(model.engine, model.params)}


def _is_adhoc(model: Model) -> bool:
    """Deployed without the catalog: no profiles, or just the one an ad-hoc deploy makes."""
    return _profiles_of(model) == {DEFAULT_PROFILE: adhoc_profile(model.engine, model.params)}


def model_json(ctx: AdminContext, model: Model) -> dict[str, Any]:
    """A model as ``GET /api/models`` lists it: its profile, ready (routable) and desired
    replicas, and why the scheduler cannot place it (None when it can); a disaggregated
    one with its pools (``pools``: role -> the pool's own, its ready, desired, scaling,
    unplaceable reason and ``load``; its ``unplaceable`` the first pool's that has one) and
    its ``handover`` as this instance's gateway saw it (:mod:`.handover`; None: aggregated)."""
    out = _model_json(ctx, model)
    pools = pools_of(ctx.store, model.name)
    out["pools"] = None
    out["handover"] = None
    if pools:
        out["pools"] = {
            role: {**_model_json(ctx, pool), "load": pool_load(ctx.router, pool.name)}
            for role, pool in pools.items()
        }
        out["handover"] = handover_json(ctx.metrics, model.name)
        out["unplaceable"] = next(
            (
                f"{role} pool: {pool['unplaceable']}"
                for role, pool in out["pools"].items()
                if pool["unplaceable"]
            ),
            out["unplaceable"],
        )
    return out


def _model_json(ctx: AdminContext, model: Model) -> dict[str, Any]:
    ready = len(ctx.router.endpoints(model.name))
    unplaceable = ctx.scheduler.unplaceable.get(model.name)
    profiles = _profiles_of(model)
    spec = profiles.get(model.profile, {})
    return {
        "name": model.name,
        "profile": model.profile,
        "profiles": sorted(profiles),
        "engine": model.engine,
        "gpus": spec.get("gpus", 0),
        "nodes": spec.get("nodes", 1),
        # The deployed profile's weights: a name, a path, or {url, sha256}; None if none.
        "source": spec.get("source"),
        "replicas": model.replicas,
        "ready": ready,
        # The scaling policy with the planner's view (demand, wanted, why it holds back);
        # None: a fixed count.
        "scaling": _scaling_json(ctx, model),
        "params": model.params,
        "unplaceable": (
            None
            if unplaceable is None
            else f"replacing replicas of an older profile waits for room: {unplaceable.reason}"
            if model.name in ctx.scheduler.rolling
            else unplaceable.reason
        ),
        # Replicas of another profile still running while a profile switch rolls.
        "older_profile_replicas": sum(
            1
            for r in ctx.store.list_replicas(model.name)
            if r.profile is not None and r.profile != model.profile
        ),
        "created_at": model.created_at,
        # How the gateway picks a replica, and the share of prompt tokens the replicas'
        # engines had cached (None before any was reported; this instance's gateway only).
        "routing": profile_routing(
            deployed_profile(profiles, model.profile, model.engine, model.params)
        ),
        "cache_hit_rate": ctx.metrics.hit_ratio(model.name),
        "tokenizer_problem": ctx.tokenizer_problem(model.name),
    }


def _scaling_json(ctx: AdminContext, model: Model) -> dict[str, Any] | None:
    try:
        policy = policy_of(model.scaling)
    except ConfigError as exc:
        return {"error": str(exc)}
    if policy is None:
        return None
    plan = ctx.planner.plans.get(model.name) if ctx.planner is not None else None
    return plan.to_json() if plan is not None else policy.to_json()


def _catalog_replicas(store: Store, model: Model, replicas: int | ScalingPolicy) -> Model | None:
    """The catalog's ``replicas`` for ``model``, stored as a deploy's would be (a range: its
    scaling policy, from its count within the bounds; a count: fixed); None when the model
    has it already."""
    if isinstance(replicas, ScalingPolicy):
        scaling, count = replicas.to_json(), replicas.clamp(model.replicas)
    else:
        scaling, count = {}, replicas
    if model.scaling == scaling and model.replicas == count:
        return None
    return store.set_scaling(model.name, scaling, replicas=count)


def _pools_follow(store: Store, model: Model, deploys: bool, deployed: bool) -> bool:
    """Whether a catalog's ``model`` has pools to keep: its deployed profile is
    disaggregated, and it has pools already or the catalog gives replicas (deploys it)."""
    try:
        disagg = disaggregation_of(model.name, _profiles_of(model)[model.profile])
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    return disagg is not None and (deployed or deploys)


def _count_text(model: Model) -> str:
    """A model's replicas as ctl and the events say them: ``2``, or ``0-8 by demand (...)``."""
    try:
        policy = policy_of(model.scaling)
    except ConfigError:
        policy = None
    return policy.describe() if policy is not None else str(model.replicas)


def catalog_json(ctx: AdminContext) -> dict[str, dict[str, Any]]:
    """Every model the control plane knows (from the catalog or deployed ad hoc), deployed
    or not, with its profiles: ``{name: {"profiles": {profile: spec}}}``."""
    return {m.name: {"profiles": _profiles_of(m)} for m in listed_models(ctx.store)}


def listed_models(store: Store) -> list[Model]:
    """The models an operator sees at the top level: all but disaggregated models' pools
    (shown under their model)."""
    models = store.list_models()
    names = {m.name for m in models}
    return [m for m in models if not _pool_of(m.name, names)]


def _pool_of(name: str, names: set[str]) -> bool:
    pair = split_pool(name)
    return pair is not None and pair[0] in names


def apply_catalog(ctx: AdminContext, body: Any, *, actor: str) -> list[dict[str, Any]]:
    """Add or update every model of the catalog, all or none; models it does not name are
    left as they are. A model deployed with a disaggregated profile has its pools follow
    (written, or removed when its profile is no longer disaggregated). One row per model:
    its change, profiles, profile and replicas, and a note for running replicas."""
    try:
        catalog = parse_catalog(body, source="catalog")
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    store = ctx.store
    changes: list[dict[str, Any]] = []
    with store.transaction():
        for name, spec in catalog.models.items():
            profiles = spec.to_dict()["profiles"]
            try:
                before: Model | None = store.get_model(name)
            except NotFound:
                before = None
            pools = pools_of(store, name)
            if before is not None and before.profiles == profiles:
                change, after = "unchanged", before
            else:
                change = "added" if before is None else "updated"
                if pools and before is not None and before.profile not in profiles:
                    raise Conflict(
                        f"model {name} has the disaggregated profile {before.profile} "
                        f"deployed and the new profiles ({', '.join(sorted(profiles))}) "
                        f"drop it; keep profile {before.profile}, or deploy another "
                        f"profile first ('llmgw ctl deploy {name} --profile P')"
                    )
                after = store.put_catalog_model(name, profiles)
            if _pools_follow(store, after, spec.replicas is not None, bool(pools)):
                # Deployed disaggregated (or the catalog deploys it): the pools follow a
                # changed profile, their counts the catalog's; the model places nothing.
                if after.replicas or after.scaling:
                    after = store.set_scaling(name, {}, replicas=0)
                if change != "unchanged" or not pools:
                    sync_pools(store, after, _remover(ctx), keep=False)
            else:
                if pools:
                    remove_pools(
                        store,
                        name,
                        _remover(ctx),
                        f"{name}'s profile {after.profile} is not disaggregated now",
                    )
                if spec.replicas is not None:
                    scaled = _catalog_replicas(store, after, spec.replicas)
                    if scaled is not None:
                        after = scaled
                        change = "updated" if change == "unchanged" else change
            running = len(store.list_replicas(name))
            note = None
            if (
                before is not None
                and running
                and _profiles_of(before).get(before.profile) != profiles[after.profile]
            ):
                note = (
                    f"{running} running replica(s) of profile {after.profile} keep the "
                    "settings they started with until they are replaced"
                )
            changes.append(
                {
                    "name": name,
                    "change": change,
                    "profiles": sorted(profiles),
                    "profile": after.profile,
                    "replicas": _count_text(after),
                    "note": note,
                }
            )
    for row in changes:
        if row["change"] != "unchanged":
            store.add_event(
                "catalog_applied",
                row["name"],
                f"{row['change']}: profiles {', '.join(row['profiles'])}; "
                f"{row['replicas']} replicas",
                actor,
            )
    ctx.serving.refresh_models()
    ctx.scheduler.kick()
    if ctx.planner is not None:
        ctx.planner.kick()
    return changes


def deploy(ctx: AdminContext, body: Mapping[str, Any], *, actor: str) -> tuple[Model, bool]:
    """Deploy a catalog model's profile (``{"name", "profile", "replicas"}``), scale a
    model (``{"name", "replicas"}``), or deploy an ad-hoc model (``{"name", "engine",
    "replicas", "params"}``), which gets a single ``default`` profile. The model deployed, and whether it is new. ``BadRequest``
    for a value that cannot be used, ``NotFound`` for a model or profile there is not."""
    name = body.get("name")
    refuse_pool(name, "deploy")
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        raise BadRequest(
            "model name must be 1-128 characters of letters, digits and . _ : / -, "
            "starting with a letter or digit"
        )
    given = body.get("replicas")
    policy: ScalingPolicy | None = None
    if given is not None:
        try:
            parsed = parse_replicas(given)
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
        policy = parsed if isinstance(parsed, ScalingPolicy) else None
    profile = body.get("profile")
    adhoc = "engine" in body or "params" in body
    if profile is not None and adhoc:
        raise BadRequest(
            "give either 'profile' (a profile of a catalog model) or 'engine' and 'params' "
            "(a model deployed without the catalog), not both"
        )
    if profile is not None and (not isinstance(profile, str) or not profile):
        raise BadRequest("profile must be the name of one of the model's profiles")
    overrides = parse_overrides(body.get("pools"))
    try:
        existing = ctx.store.get_model(name)
    except NotFound:
        existing = None
    disagg = _disaggregated(name, body, profile, adhoc, existing)
    if disagg is not None and given is not None:
        raise BadRequest(
            f"{name}'s profile {disagg} is disaggregated: its replicas are its prefill and "
            "decode pools'; give --prefill N|MIN-MAX and/or --decode N|MIN-MAX (API: "
            "pools: {prefill: ..., decode: ...}) instead of --replicas"
        )
    if disagg is None and overrides:
        raise BadRequest(
            f"{name}'s profile is not disaggregated: --prefill/--decode (API: pools) set the "
            "pools of a disaggregated profile; give --replicas N|MIN-MAX"
        )
    if given is None:
        # Not given: a deployed model keeps its count or policy (e.g. a profile switch), a
        # new one gets one replica.
        replicas = existing.replicas if existing is not None else 1
    elif policy is not None:
        # By demand: from the count it has, within the bounds (a new one: its min).
        replicas = policy.clamp(existing.replicas if existing is not None else policy.min)
    else:
        assert isinstance(given, int)
        replicas = given
    if disagg is not None:
        replicas = 0  # the model places nothing: its pools do
    # The model and its pools change together, or not at all.
    with ctx.store.transaction():
        if not adhoc and (profile is not None or existing is not None):
            if existing is None:
                raise NotFound(
                    f"no model named {name}; add it to the catalog with 'llmgw ctl models apply "
                    "-f catalog.yaml' ('llmgw ctl models' lists the models there are)"
                )
            model = ctx.store.deploy_model(
                name, profile=profile or existing.profile, replicas=replicas
            )
            what = f"profile {model.profile} ({model.engine})"
        else:
            model = _deploy_adhoc(ctx, name, body, replicas, existing)
            what = model.engine
        if disagg is not None:
            model = ctx.store.set_scaling(name, {}, replicas=0)
        elif given is not None:
            model = ctx.store.set_scaling(
                name, policy.to_json() if policy is not None else {}, replicas=replicas
            )
        pools = sync_pools(ctx.store, model, _remover(ctx), overrides)
    scaling = policy_of(model.scaling) if given is None else policy
    count = scaling.describe() if scaling is not None else f"{replicas}"
    if pools:
        count = ", ".join(f"{role} {count_text(pool)}" for role, pool in pools.items())
    ctx.serving.refresh_models()
    ctx.store.add_event("model_deployed", name, f"{what}, {count} replicas", actor)
    if ctx.planner is not None:
        ctx.planner.kick()
    ctx.scheduler.kick()
    return model, existing is None


def _disaggregated(
    name: str,
    body: Mapping[str, Any],
    profile: str | None,
    adhoc: bool,
    existing: Model | None,
) -> str | None:
    """The name of the profile a deploy would deploy when it is disaggregated; None for an
    aggregated one (or one there is not: the deploy itself refuses it)."""
    if adhoc or existing is None:
        if body.get("disaggregated") is None:
            return None
        # Checked whole, as the deploy stores it, before anything is written.
        return DEFAULT_PROFILE if _adhoc_spec(name, body)[2].disaggregated else None
    else:
        chosen = profile or existing.profile
        found = _profiles_of(existing).get(chosen)
        if found is None:
            return None
        spec = found
    try:
        return chosen if disaggregation_of(name, spec) is not None else None
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None


def _remover(ctx: AdminContext) -> Callable[[str, str], None]:
    """The scheduler's removal of a replica (its shards stopped, its row deleted)."""
    return lambda replica_id, why: ctx.scheduler.remove_replica(replica_id, why=why)


def _adhoc_spec(
    name: str, body: Mapping[str, Any]
) -> tuple[str, dict[str, Any], CatalogProfile, dict[str, Any]]:
    """An ad-hoc deploy's engine, params and its one profile (parsed, and as stored);
    BadRequest saying what is wrong."""
    engine = body.get("engine", "sim")
    if engine not in engine_names():
        raise BadRequest(f"unknown engine {engine!r}; choose one of {', '.join(engine_names())}")
    params = body.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise BadRequest("params must be an object of name: value")
    for key, value in params.items():
        if key == "extra_args":
            if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise BadRequest("params.extra_args must be a list of strings")
        elif not isinstance(value, str | int | float) or isinstance(value, bool):
            raise BadRequest(f"params.{key} must be a string or a number")
    # An ad-hoc deploy is a catalog model with one "default" profile: check it as one.
    profile = adhoc_profile(engine, params)
    for key in ("source", "gpus", "nodes", "gpu_memory", "placement", "disaggregated"):
        if body.get(key) is not None:
            profile[key] = body[key]
    try:
        parsed = parse_profile(profile, model=name, profile=DEFAULT_PROFILE, source="request")
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    return engine, params, parsed, profile


def _deploy_adhoc(
    ctx: AdminContext, name: str, body: Mapping[str, Any], replicas: int, existing: Model | None
) -> Model:
    engine, params, _parsed, profile = _adhoc_spec(name, body)
    if existing is not None and not _is_adhoc(existing):
        raise Conflict(
            f"model {name} comes from the catalog (profiles "
            f"{', '.join(sorted(existing.profiles))}); deploy one of them with "
            f"'llmgw ctl deploy {name} --profile P', or change them in the catalog and "
            "'llmgw ctl models apply -f catalog.yaml'"
        )
    if existing is not None and (existing.engine != engine or existing.params != params):
        if ctx.store.list_replicas(name):
            raise Conflict(
                f"model {name} is deployed with engine {existing.engine} and other params; "
                f"'llmgw ctl undeploy {name}' first, or deploy it under another name"
            )
    return ctx.store.put_model(
        name,
        engine=engine,
        params=params,
        replicas=replicas,
        profiles={DEFAULT_PROFILE: profile},
    )


def undeploy(ctx: AdminContext, name: str, *, actor: str) -> None:
    """Stop every replica of ``name`` (and of its pools) and forget the model with its pools
    (``NotFound`` when there is none; a pool is refused, naming its model)."""
    refuse_pool(name, "undeploy")
    ctx.store.get_model(name)
    why = f"undeployed {name}"
    with ctx.store.transaction():
        gone = remove_pools(ctx.store, name, _remover(ctx), why)
        for replica in ctx.store.list_replicas(name):
            ctx.scheduler.remove_replica(replica.id, why=why)
        ctx.store.delete_model(name)
    for pool in gone:
        ctx.router.remove_model(pool)
    ctx.router.remove_model(name)
    ctx.serving.refresh_models()
    ctx.store.add_event("model_undeployed", name, "undeployed", actor)


def sleep_replica(
    ctx: AdminContext, replica_id: str, level: int | None, *, actor: str
) -> dict[str, Any]:
    """Order a ready replica to sleep (at ``level``, else its profile's); NotFound, or
    Conflict saying why it cannot (llmgw.server.fleet.sleeps)."""
    if level is None:
        replica = ctx.store.get_replica(replica_id)
        model = ctx.store.get_model(replica.model)
        stored = deployed_profile(
            model.profiles, replica.profile or model.profile, model.engine, model.params
        )
        level = profile_sleep_level(stored) or 1
    op_id = ctx.scheduler.sleep_replica(replica_id, level, why="an operator's order", actor=actor)
    return {"replica": replica_id, "level": level, "state": "falling_asleep", "op_id": op_id}


def wake_replica(ctx: AdminContext, replica_id: str, *, actor: str) -> dict[str, Any]:
    """Order an asleep replica to wake; NotFound, or Conflict saying why it cannot."""
    op_id = ctx.scheduler.wake_replica(replica_id, why="an operator's order", actor=actor)
    return {"replica": replica_id, "state": "waking", "op_id": op_id}


def replica_rows(ctx: AdminContext, model: str | None = None) -> list[dict[str, Any]]:
    """Every shard of every replica (of ``model`` and its pools, else of all models), with
    its node, state, restarts and last reason, and its pool's role (a disaggregated
    model's: prefill, decode; else None), as ``GET /api/replicas`` lists them."""
    names: list[str | None] = [model]
    if model is not None:
        ctx.store.get_model(model)
        names += [pool.name for pool in pools_of(ctx.store, model).values()]
    out = []
    # Each read once for the whole list (a fleet's is thousands of shards).
    shards: dict[str, list[Shard]] = {}
    for shard in ctx.store.list_shards():
        shards.setdefault(shard.replica_id, []).append(shard)
    endpoints = {e.shard_id: e for name in names for e in ctx.router.endpoints(name)}
    replicas = [r for name in names for r in ctx.store.list_replicas(name)]
    for replica in replicas:
        pair = split_pool(replica.model)
        for shard in shards.get(replica.id, []):
            ep = endpoints.get(shard.id)
            out.append(
                {
                    "replica": replica.id,
                    "model": pair[0] if pair is not None else replica.model,
                    "role": pair[1] if pair is not None else None,
                    "pool": replica.model if pair is not None else None,
                    "profile": replica.profile,
                    "state": shard.state,
                    "node": shard.node_id,
                    "gpus": list(shard.gpus),
                    "shard": shard.id,
                    "rank": shard.rank,
                    "port": shard.port,
                    "pid": shard.pid,
                    "restarts": shard.restarts,
                    "exit_code": shard.exit_code,
                    "reason": shard.reason,
                    "inflight": ep.inflight if ep else 0,
                    "routable": ep is not None,
                    "sleep_level": shard.sleep_level,
                    "host_memory_mib": shard.host_memory_mib,
                    # A pool replica's KV transfer address (host:port), else ''.
                    "transfer_addr": transfer_addr(replica.model, shard.dist_init_addr),
                }
            )
    return out


class ModelRoutes:
    """Models, the catalog and replicas."""

    def __init__(self, ctx: AdminContext) -> None:
        self.ctx = ctx

    # -- models ---------------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response([model_json(self.ctx, m) for m in listed_models(self.ctx.store)])

    async def catalog(self, request: web.Request) -> web.Response:
        return web.json_response({"models": catalog_json(self.ctx)})

    async def apply_catalog(self, request: web.Request) -> web.Response:
        """``PUT /api/catalog``: :func:`apply_catalog`."""
        body = await read_json(self.ctx, request)
        changes = apply_catalog(self.ctx, body, actor=principal_of(request).actor)
        return web.json_response({"models": changes})

    async def deploy(self, request: web.Request) -> web.Response:
        """``POST /api/models``: :func:`deploy`."""
        body = await read_json(self.ctx, request)
        model, created = deploy(self.ctx, body, actor=principal_of(request).actor)
        return web.json_response(model_json(self.ctx, model), status=201 if created else 200)

    async def undeploy(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        undeploy(self.ctx, name, actor=principal_of(request).actor)
        return web.json_response({"name": name, "undeployed": True})

    # -- replicas -------------------------------------------------------------------------------

    async def replicas(self, request: web.Request) -> web.Response:
        return web.json_response(replica_rows(self.ctx, request.query.get("model") or None))

    async def sleep(self, request: web.Request) -> web.Response:
        """``POST /api/replicas/{replica}/sleep`` with ``{"level": N}`` (default: the level
        its profile sleeps at): :func:`sleep_replica`."""
        body = await read_json(self.ctx, request)
        level = body.get("level")
        if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
            raise BadRequest("level must be 1 or 2")
        replica = request.match_info["replica"]
        actor = principal_of(request).actor
        return web.json_response(sleep_replica(self.ctx, replica, level, actor=actor))

    async def wake(self, request: web.Request) -> web.Response:
        """``POST /api/replicas/{replica}/wake``: :func:`wake_replica`."""
        replica = request.match_info["replica"]
        actor = principal_of(request).actor
        return web.json_response(wake_replica(self.ctx, replica, actor=actor))
