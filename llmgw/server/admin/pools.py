"""A disaggregated model's pools as the admin API keeps them: the pool rows (``MODEL#prefill``,
``MODEL#decode``) written, rescaled or removed with their model, the refusals of a pool named
on its own, the operator's overrides of the pools' counts, and what the API shows of them.

A model whose deployed profile says ``disaggregated`` places nothing itself (its replicas 0):
each pool is a model row of its own (:mod:`llmgw.contracts.disagg`), whose profiles are the
pool's side of every disaggregated profile of the model (so that a switch between two of them
rolls the pools' replicas as any profile switch does), whose deployed profile is the model's,
and whose replicas are the pool's fixed count or by its scaling policy. Callers hold the
store's transaction around :func:`sync_pools` so that the model and its pools change together.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from llmgw.contracts.catalog import (
    DEFAULT_PROFILE,
    STORED,
    Profile,
    adhoc_profile,
    parse_profile,
)
from llmgw.contracts.disagg import ROLES, Disaggregation, pool_name, pool_profile, split_pool
from llmgw.contracts.scaling import ScalingPolicy, parse_replicas, policy_of
from llmgw.errors import ConfigError, NotFound
from llmgw.server.admin.context import BadRequest
from llmgw.server.store import Model, Store

__all__ = [
    "Overrides",
    "count_text",
    "disaggregation_of",
    "parse_overrides",
    "pools_of",
    "refuse_pool",
    "remove_pools",
    "sync_pools",
]

Overrides = Mapping[str, int | ScalingPolicy]
"""The operator's count or policy per role, for this deploy (the profile's otherwise)."""

RemoveReplica = Callable[[str, str], None]
"""Stops a replica and forgets it (replica id, why): the scheduler's removal."""


def refuse_pool(name: object, action: str) -> None:
    """:class:`BadRequest` for ``action`` (deploy, scale, undeploy) named at a pool rather
    than its model, naming the model and the fix."""
    if not isinstance(name, str):
        return
    pair = split_pool(name)
    if pair is None:
        return
    model, role = pair
    if action == "undeploy":
        fix = (
            f"'llmgw ctl undeploy {model}' removes the model with both pools, or deploy an "
            f"aggregated profile of {model} ('llmgw ctl deploy {model} --profile P')"
        )
    else:
        fix = f"'llmgw ctl deploy {model} --{role} N|MIN-MAX' (API: pools: {{{role}: ...}})"
    raise BadRequest(
        f"{name} is the {role} pool of the disaggregated model {model}; a pool is not "
        f"{'undeployed' if action == 'undeploy' else 'deployed or scaled'} on its own: {fix}"
    )


def parse_overrides(value: object) -> dict[str, int | ScalingPolicy]:
    """The API's ``pools: {prefill: N|{min, max, ...}, decode: ...}`` (either or both)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not value:
        raise BadRequest(
            "pools must be an object with prefill and/or decode, each a count or "
            '{min, max, ...}, e.g. {"decode": {"min": 1, "max": 4}}'
        )
    out: dict[str, int | ScalingPolicy] = {}
    for role, given in value.items():
        if role not in ROLES:
            raise BadRequest(
                f"pools has no {role!r}: a disaggregated model's pools are prefill and decode"
            )
        try:
            out[role] = parse_replicas(given, key=f"pools.{role}")
        except ConfigError as exc:
            raise BadRequest(str(exc)) from None
    return out


def disaggregation_of(name: str, spec: Mapping[str, Any]) -> Disaggregation | None:
    """The ``disaggregated`` of a stored profile of model ``name`` (None: aggregated)."""
    if spec.get("disaggregated") is None:
        return None
    profile: Profile = parse_profile(dict(spec), model=name, profile="?", source=STORED)
    return profile.disaggregated


def _profiles_of(model: Model) -> dict[str, Any]:
    return model.profiles or {DEFAULT_PROFILE: adhoc_profile(model.engine, model.params)}


def pools_of(store: Store, name: str) -> dict[str, Model]:
    """The pool rows of model ``name`` there are, by role."""
    out = {}
    for role in ROLES:
        try:
            out[role] = store.get_model(pool_name(name, role))
        except NotFound:
            continue
    return out


def sync_pools(
    store: Store,
    model: Model,
    remove_replica: RemoveReplica,
    overrides: Overrides | None = None,
    *,
    keep: bool = True,
) -> dict[str, Model]:
    """Make ``model``'s pool rows follow its deployed profile (call it in a transaction):
    written for a disaggregated one, removed (their replicas stopped) for an aggregated one.
    Each pool's count: ``overrides``' for its role, else, with ``keep``, what a pool of the
    same deployed profile has now (as a redeploy keeps a model's count), else the profile's
    pool's (its policy's min, or a count a policy keeps within its bounds). The pools after."""
    overrides = overrides or {}
    profiles = _profiles_of(model)
    disagg = disaggregation_of(model.name, profiles[model.profile])
    existing = pools_of(store, model.name)
    if disagg is None:
        if existing:
            why = f"{model.name} deployed profile {model.profile}, which is not disaggregated"
            remove_pools(store, model.name, remove_replica, why)
        return {}
    # The model's own replicas (of an aggregated profile before) give way to its pools.
    for replica in store.list_replicas(model.name):
        remove_replica(
            replica.id, f"{model.name} deployed profile {model.profile}: its pools serve it"
        )
    out = {}
    for role in ROLES:
        name = pool_name(model.name, role)
        own = {
            p: pool_profile(spec, role)
            for p, spec in profiles.items()
            if spec.get("disaggregated") is not None
        }
        before = existing.get(role)
        store.put_catalog_model(name, own)
        if role in overrides:
            wanted: int | ScalingPolicy = overrides[role]
        elif keep and before is not None and before.profile == model.profile:
            out[role] = store.deploy_model(name, profile=model.profile, replicas=before.replicas)
            continue
        else:
            wanted = disagg.pool(role).replicas
        if isinstance(wanted, ScalingPolicy):
            start = wanted.clamp(before.replicas) if before is not None else wanted.min
            scaling, count = wanted.to_json(), start
        else:
            scaling, count = {}, wanted
        store.deploy_model(name, profile=model.profile, replicas=count)
        out[role] = store.set_scaling(name, scaling, replicas=count)
    return out


def remove_pools(store: Store, name: str, remove_replica: RemoveReplica, why: str) -> list[str]:
    """Stop every replica of model ``name``'s pools and delete the pool rows (in the
    caller's transaction); the pools removed."""
    gone = []
    for pool in pools_of(store, name).values():
        for replica in store.list_replicas(pool.name):
            remove_replica(replica.id, why)
        store.delete_model(pool.name)
        gone.append(pool.name)
    return gone


def count_text(pool: Model) -> str:
    """A pool's count as events and ctl say it: ``2``, or ``1-4 by demand (...)``."""
    try:
        policy = policy_of(pool.scaling)
    except ConfigError:
        policy = None
    return policy.describe() if policy is not None else str(pool.replicas)
