"""What the gateway's request path reads instead of the store: the active API keys (by the
hash of their secret, with their policy) and the deployed models (what each serves, its
replicas' concurrency limit, the request-body limit its profile raises). The admin API
refreshes them after every change it makes to keys or models; a standby's follower after
every change it reads."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.contracts.catalog import (
    DEFAULT_ROUTING,
    FileRef,
    Routing,
    adhoc_profile,
    profile_body_limit,
    profile_file,
    profile_max_concurrency,
    profile_routing,
    profile_tasks,
)
from llmgw.contracts.disagg import handover_of, parse_disaggregated, pool_name, split_pool
from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.resuming import profile_max_resumes
from llmgw.contracts.scaling import policy_of
from llmgw.errors import ConfigError
from llmgw.server.gateway.prefixes import APPROX_CAPACITY, APPROX_CHUNK
from llmgw.server.store import Store
from llmgw.server.store.rows import ApiKey, Model
from llmgw.sim.config import SimConfig

__all__ = ["Handover", "ServedModel", "ServingCache"]


@dataclass(frozen=True)
class Handover:
    """How a disaggregated model is served by its pools (:mod:`llmgw.contracts.disagg`): the
    pools' model names, the hand-over protocol its engine speaks (``vllm`` or ``sglang``), and
    how long a decode replica may take to its first token, the KV transfer included; and the
    bytes one token's KV takes, to count the bytes a hand-over moves (None: not known)."""

    prefill: str
    decode: str
    protocol: str
    transfer_timeout: float
    kv_bytes_per_token: int | None = None


@dataclass(frozen=True)
class ServedModel:
    """A deployed model as the request path needs it."""

    name: str
    engine: str
    tasks: tuple[str, ...]
    # The gateway paths its replicas answer (llmgw.contracts.endpoints).
    paths: frozenset[str]
    max_concurrency: int
    body_limit: int | None
    # How the gateway picks its replica, and the files it keys a prompt with
    # (llmgw.server.gateway.tokenizing): the profile's routing, tokenizer and chat_template.
    routing: Routing = DEFAULT_ROUTING
    tokenizer: FileRef | None = None
    chat_template: FileRef | None = None
    # A replica's prefix capacity in chunks of the approximate index (prefix-approx).
    approx_capacity: int = APPROX_CAPACITY
    # The most tokens one answer may have, as the profile says (llmgw.server.gateway.metering);
    # None: not said.
    output_cap: int | None = None
    # How long a request waits for a replica to exist (a model that scales by demand: its
    # cold_start_timeout, llmgw.contracts.scaling); None: server.yaml's replica_wait.
    cold_start_timeout: float | None = None
    # How many times one of its streams is resumed at most (the profile's resume; 0: off;
    # None: the default, llmgw.server.gateway.resume).
    max_resumes: int | None = None
    # A disaggregated model: served by its pools, the gateway driving the hand-over
    # (llmgw.server.gateway.disagg); None: served by its own replicas.
    handover: Handover | None = None

    @property
    def is_pool(self) -> bool:
        """Whether it is a disaggregated model's pool (``MODEL#role``): never a client's."""
        return split_pool(self.name) is not None

    @classmethod
    def of(cls, model: Model) -> ServedModel:
        profile: Mapping[str, Any] = model.profiles.get(model.profile) or adhoc_profile(
            model.engine, model.params
        )
        tasks = profile_tasks(profile)
        return cls(
            name=model.name,
            engine=model.engine,
            tasks=tasks,
            paths=served_paths(model.engine, tasks),
            max_concurrency=profile_max_concurrency(profile),
            body_limit=profile_body_limit(profile),
            routing=profile_routing(profile),
            tokenizer=profile_file(profile, "tokenizer"),
            chat_template=profile_file(profile, "chat_template"),
            approx_capacity=_approx_capacity(profile),
            output_cap=_output_cap(model.engine, profile),
            cold_start_timeout=_cold_start_timeout(model),
            max_resumes=profile_max_resumes(profile),
            handover=_handover(model.name, model.engine, profile),
        )


def _handover(name: str, engine: str, profile: Mapping[str, Any]) -> Handover | None:
    raw = profile.get("disaggregated")
    protocol = handover_of(engine)
    if raw is None or protocol is None:
        return None
    try:
        disagg = parse_disaggregated(raw, key="disaggregated", engine=engine)
    except ConfigError:
        # Stored by an llmgw that read it otherwise: served as a model of its own, which has
        # no replicas (its requests are refused as having none, not sent to a pool blindly).
        return None
    return Handover(
        prefill=pool_name(name, "prefill"),
        decode=pool_name(name, "decode"),
        protocol=protocol,
        transfer_timeout=disagg.transfer_timeout,
        kv_bytes_per_token=_kv_bytes(engine, profile, disagg.kv_bytes_per_token),
    )


def _kv_bytes(engine: str, profile: Mapping[str, Any], given: int | None) -> int | None:
    """One token's KV bytes: the profile's ``disaggregated.kv_bytes_per_token``, else the
    sim's own (its param, or its default: what its transfers move); None for a real engine
    without it (vLLM and SGLang report no bytes per request)."""
    if given is not None or engine != "sim":
        return given
    params = profile.get("params")
    raw = params.get("kv_bytes_per_token") if isinstance(params, Mapping) else None
    try:
        return int(str(raw)) if raw is not None else SimConfig.kv_bytes_per_token
    except ValueError:
        return SimConfig.kv_bytes_per_token


_CAP_PARAMS = ("max_model_len", "context_length", "ctx_size", "max_tokens", "max_length")
"""The profile params that bound one answer's tokens: vLLM's and SGLang's context length,
llama.cpp's context (all its slots'), the sim's default limit or its context."""


def _cold_start_timeout(model: Model) -> float | None:
    try:
        policy = policy_of(model.scaling)
    except ConfigError:
        return None  # a policy this llmgw cannot read: the planner says so; wait as fixed
    return policy.cold_start_timeout if policy is not None else None


def _output_cap(engine: str, profile: Mapping[str, Any]) -> int | None:
    params = profile.get("params")
    params = params if isinstance(params, Mapping) else {}
    for name in _CAP_PARAMS:
        with contextlib.suppress(TypeError, ValueError):
            if (cap := int(str(params.get(name)))) > 0:
                return cap
    return SimConfig.max_length if engine == "sim" else None


def _approx_capacity(profile: Mapping[str, Any]) -> int:
    """What a replica's engine keeps of prompts, in chunks of the approximate index: a
    llama.cpp profile's ``ctx_size`` (the KV cache its slots share, in tokens; about 4 bytes
    of text a token), else :data:`APPROX_CAPACITY`."""
    params = profile.get("params")
    ctx = params.get("ctx_size") if isinstance(params, Mapping) else None
    try:
        tokens = int(str(ctx)) if ctx is not None else 0
    except ValueError:
        tokens = 0
    return max(1, tokens * 4 // APPROX_CHUNK) if tokens > 0 else APPROX_CAPACITY


class ServingCache:
    """In-memory copies of what the request path needs, refreshed from ``store``."""

    def __init__(
        self,
        store: Store,
        *,
        max_request_body: int,
        on_keys: Callable[[set[str]], None] = lambda _ids: None,
        on_models: Callable[[list[ServedModel]], None] = lambda _served: None,
    ) -> None:
        self.store = store
        self.max_request_body = max_request_body
        # The active keys by the hex SHA-256 of their secret.
        self.keys: dict[str, ApiKey] = {}
        # Told the ids of the active keys at each refresh (the limits forget the others).
        self.on_keys = on_keys
        # Told the deployed models at each refresh (their tokenizers load in the background).
        self.on_models = on_models
        self.models: dict[str, ServedModel] = {}
        # Request body limits raised by a deployed profile (model -> bytes), and the
        # largest limit of any model.
        self.body_limits: dict[str, int] = {}
        self.largest_body_limit = max_request_body

    def refresh_keys(self) -> None:
        self.set_keys(self.store.active_api_keys())

    def set_keys(self, active: list[ApiKey]) -> None:
        """The active keys are ``active``."""
        keys = {key.hash: key for key in active}
        old = self.keys
        # An unchanged key keeps its row object, so the limits see no change of policy.
        self.keys = {h: old[h] if old.get(h) == key else key for h, key in keys.items()}
        self.on_keys({key.id for key in keys.values()})

    def refresh_models(self) -> None:
        self.set_models([ServedModel.of(m) for m in self.store.list_models()])

    def set_models(self, served: list[ServedModel]) -> None:
        """The deployed models are ``served``."""
        self.models = {m.name: m for m in served}
        self.body_limits = {m.name: m.body_limit for m in served if m.body_limit is not None}
        self.largest_body_limit = max([self.max_request_body, *self.body_limits.values()])
        self.on_models(served)

    def for_client(self, model: str) -> ServedModel | None:
        """The model a client may name (a disaggregated model's pools are not)."""
        served = self.models.get(model)
        return None if served is None or served.is_pool else served

    def cold_start_timeout(self, model: str) -> float | None:
        served = self.models.get(model)
        return served.cold_start_timeout if served is not None else None

    def max_concurrency(self, model: str) -> int:
        served = self.models.get(model)
        return served.max_concurrency if served is not None else 1
