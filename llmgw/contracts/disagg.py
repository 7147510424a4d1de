"""A disaggregated profile: a model served by two pools of replicas, one computing prompts
(prefill) and one generating (decode), the KV cache moved from the first to the second.

A profile says ``disaggregated: {prefill: {...}, decode: {...}}``; each pool gives its GPUs
per replica and its replicas (a fixed count or a scaling policy, :mod:`llmgw.contracts.scaling`),
optionally ``args`` added to the profile's for that pool alone and its ``max_concurrency``.
Beside the pools: ``transfer_timeout`` (how long the gateway waits for a decode replica's
first token, the KV transfer included, before it runs the request whole on a decode replica:
the aggregated fallback), ``backend`` (SGLang's transfer backend; vLLM and the sim have
one each) and ``kv_bytes_per_token`` (the bytes one token's KV cache takes on the wire, so
that the gateway counts the bytes each hand-over moves, ``llmgw_disagg_transfer_bytes_total``).
vLLM and SGLang do not report the bytes they move per request, so the operator computes it
for the model: 2 (keys and values) x layers x KV heads x head dim x the KV dtype's bytes, e.g.
Llama-3-8B in fp16: 2 * 32 * 8 * 128 * 2 = 131072. The sim's default is its own
``kv_bytes_per_token`` param; without either, the tokens moved are counted, not the bytes.

The control plane stores such a deployment as three models: the one clients name (its
replicas 0: it places nothing, the gateway drives the hand-over between its pools) and one
per pool, named ``MODEL#prefill`` and ``MODEL#decode`` (``#`` is in no model name a client
may give, so no client names a pool), each with a profile of its own (:func:`pool_profile`:
the model's profile with the pool's GPUs and args, and ``role``), placed, scaled, moved and
rebuilt as any model is. One parser for the catalog, the admin API and ctl; which hand-over
each engine speaks is the engine registry's (:func:`handover_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.configfile import join_key, type_name
from llmgw.contracts.scaling import ScalingPolicy, parse_replicas
from llmgw.durations import format_duration, parse_duration
from llmgw.engines.registry import disaggregating_engines, engine_names, get_engine
from llmgw.errors import ConfigError

__all__ = [
    "BACKENDS",
    "DEFAULT_TRANSFER_TIMEOUT",
    "POOL_SEP",
    "ROLES",
    "Disaggregation",
    "Pool",
    "handover_of",
    "parse_disaggregated",
    "parse_role",
    "pool_name",
    "pool_profile",
    "served_name",
    "split_pool",
]

ROLES: tuple[str, ...] = ("prefill", "decode")
POOL_SEP = "#"
"""Between a model's name and its pool's role in the pool's own model name."""

BACKENDS: tuple[str, ...] = ("nixl", "mooncake")
"""SGLang's transfer backends llmgw starts it with (its --disaggregation-transfer-backend)."""

DEFAULT_TRANSFER_TIMEOUT = 30.0
_KEYS = ("prefill", "decode", "transfer_timeout", "backend", "kv_bytes_per_token")
_POOL_KEYS = ("gpus", "replicas", "args", "max_concurrency")
_EXAMPLE = (
    "e.g. disaggregated: {prefill: {gpus: 1, replicas: 1}, decode: {gpus: 1, replicas: {min: 1, "
    "max: 4}}}"
)


@dataclass(frozen=True)
class Pool:
    """One pool of a disaggregated profile: what each of its replicas runs on, and how many."""

    role: str
    gpus: int
    replicas: int | ScalingPolicy = 1
    args: tuple[str, ...] = ()
    max_concurrency: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpus": self.gpus}
        out["replicas"] = (
            self.replicas if isinstance(self.replicas, int) else self.replicas.to_json()
        )
        if self.args:
            out["args"] = list(self.args)
        if self.max_concurrency is not None:
            out["max_concurrency"] = self.max_concurrency
        return out


@dataclass(frozen=True)
class Disaggregation:
    prefill: Pool
    decode: Pool
    transfer_timeout: float = DEFAULT_TRANSFER_TIMEOUT
    backend: str = ""
    # One token's KV cache in bytes (None: not given; the bytes moved are not counted).
    kv_bytes_per_token: int | None = None

    def pool(self, role: str) -> Pool:
        if role == "prefill":
            return self.prefill
        if role == "decode":
            return self.decode
        raise ValueError(f"no pool {role!r}: a disaggregated profile has {', '.join(ROLES)}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefill": self.prefill.to_dict(), "decode": self.decode.to_dict()}
        if self.transfer_timeout != DEFAULT_TRANSFER_TIMEOUT:
            out["transfer_timeout"] = format_duration(self.transfer_timeout)
        if self.backend:
            out["backend"] = self.backend
        if self.kv_bytes_per_token is not None:
            out["kv_bytes_per_token"] = self.kv_bytes_per_token
        return out


def pool_name(model: str, role: str) -> str:
    """The model name a pool's replicas are stored and routed under."""
    if role not in ROLES:
        raise ValueError(f"no pool {role!r}: a disaggregated profile has {', '.join(ROLES)}")
    return f"{model}{POOL_SEP}{role}"


def split_pool(name: str) -> tuple[str, str] | None:
    """(model, role) for a pool's model name; None for any other name."""
    model, sep, role = name.rpartition(POOL_SEP)
    if not sep or not model or role not in ROLES:
        return None
    return model, role


def served_name(name: str) -> str:
    """The model name a replica's engine answers to: a pool's model's (the name clients give
    and the gateway sends both pools), else the name itself."""
    pair = split_pool(name)
    return name if pair is None else pair[0]


def handover_of(engine: str) -> str | None:
    """The hand-over protocol ``engine`` speaks (the registry's ``disagg_handover``): ``vllm``
    (the prefill returns ``kv_transfer_params`` that the decode request carries: vLLM's
    NixlConnector, and the sim, which speaks it over TCP) or ``sglang`` (both sent at once
    with the prefill's bootstrap host, port and a room); None: it cannot disaggregate (or is
    no engine llmgw knows)."""
    if engine not in engine_names():
        return None
    handover = get_engine(engine).disagg_handover
    return None if handover is None else str(handover)


def parse_disaggregated(value: object, *, key: str, engine: str, nodes: int = 1) -> Disaggregation:
    """A profile's ``disaggregated`` mapping, checked; :class:`ConfigError` naming the key
    and what to write instead."""
    if handover_of(engine) is None:
        able = ", ".join(disaggregating_engines())
        raise ConfigError(
            f"engine {engine} cannot disaggregate prefill and decode; use one of {able}, or "
            "drop 'disaggregated'",
            key=key,
        )
    if nodes > 1:
        raise ConfigError(
            f"a disaggregated profile's replicas run on one node each (nodes is {nodes}); "
            "drop nodes or 'disaggregated'",
            key=key,
        )
    if not isinstance(value, Mapping):
        raise ConfigError(f"must be a mapping with prefill and decode ({_EXAMPLE})", key=key)
    unknown = sorted(str(k) for k in value if k not in _KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r}; disaggregated takes {', '.join(_KEYS)}", key=key
        )
    missing = [role for role in ROLES if role not in value]
    if missing:
        raise ConfigError(
            f"needs both prefill and decode, {missing[0]} is missing ({_EXAMPLE})", key=key
        )
    pools = {role: _pool(value[role], role, join_key(key, role)) for role in ROLES}
    timeout = DEFAULT_TRANSFER_TIMEOUT
    if value.get("transfer_timeout") is not None:
        timeout = _duration(value["transfer_timeout"], join_key(key, "transfer_timeout"))
    backend = ""
    if value.get("backend") is not None:
        backend = value["backend"]
        if engine != "sglang":
            raise ConfigError(
                f"is SGLang's transfer backend; engine {engine} has one of its own: drop it",
                key=join_key(key, "backend"),
            )
        if backend not in BACKENDS:
            raise ConfigError(
                f"must be one of {', '.join(BACKENDS)}; got {backend!r}",
                key=join_key(key, "backend"),
            )
    kv_bytes = value.get("kv_bytes_per_token")
    if kv_bytes is not None and (
        isinstance(kv_bytes, bool) or not isinstance(kv_bytes, int) or kv_bytes < 1
    ):
        raise ConfigError(
            f"must be a whole number of bytes >= 1 (2 x layers x KV heads x head dim x dtype "
            f"bytes, e.g. 131072 for Llama-3-8B in fp16), or left out; got "
            f"{type_name(kv_bytes)} {kv_bytes!r}",
            key=join_key(key, "kv_bytes_per_token"),
        )
    return Disaggregation(
        prefill=pools["prefill"],
        decode=pools["decode"],
        transfer_timeout=timeout,
        backend=str(backend),
        kv_bytes_per_token=kv_bytes,
    )


def parse_role(value: object, *, key: str, engine: str) -> str:
    """A pool's stored profile's ``role`` (set by :func:`pool_profile`, never a catalog's)."""
    if value not in ROLES:
        raise ConfigError(f"must be one of {', '.join(ROLES)}; got {value!r}", key=key)
    if handover_of(engine) is None:
        raise ConfigError(f"engine {engine} cannot disaggregate prefill and decode", key=key)
    return str(value)


def pool_profile(profile: Mapping[str, Any], role: str) -> dict[str, Any]:
    """The stored profile of ``role``'s pool from a disaggregated profile as stored (its
    ``to_dict``): the same engine, weights, params and settings, the pool's GPUs, the
    profile's args then the pool's (then SGLang's ``--disaggregation-transfer-backend`` when
    ``backend`` names one), the pool's max_concurrency, and ``role``."""
    raw = profile.get("disaggregated")
    if not isinstance(raw, Mapping):
        raise ValueError("not a disaggregated profile: it has no 'disaggregated' mapping")
    pool = raw[role]
    out = {k: v for k, v in profile.items() if k not in ("disaggregated", "role")}
    out["gpus"] = pool["gpus"]
    out["args"] = [*profile.get("args", ()), *pool.get("args", ())]
    if pool.get("max_concurrency") is not None:
        out["max_concurrency"] = pool["max_concurrency"]
    if role == "decode":
        # Decode replicas are chosen by their load (the tokens they are generating); the
        # profile's routing (a prefix cache) is the prefill pool's, where prompts are computed.
        out.pop("routing", None)
    out["role"] = role
    if raw.get("backend"):
        # After llmgw's own flags: the last --disaggregation-transfer-backend is SGLang's.
        out["args"] += ["--disaggregation-transfer-backend", raw["backend"]]
    return out


def _pool(value: object, role: str, key: str) -> Pool:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"must be a mapping with gpus and replicas, e.g. {{gpus: 1, replicas: 2}}; "
            f"got {type_name(value)}",
            key=key,
        )
    unknown = sorted(str(k) for k in value if k not in _POOL_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown key {unknown[0]!r}; a pool takes {', '.join(_POOL_KEYS)}", key=key
        )
    if "gpus" not in value:
        raise ConfigError(
            f"is missing: the GPUs each {role} replica runs on (0 runs it without GPUs)",
            key=join_key(key, "gpus"),
        )
    gpus = _whole(value["gpus"], join_key(key, "gpus"), 0)
    replicas = parse_replicas(value.get("replicas", 1), key=join_key(key, "replicas"))
    args: tuple[str, ...] = ()
    if value.get("args") is not None:
        given = value["args"]
        if not isinstance(given, list) or not all(isinstance(a, str) for a in given):
            raise ConfigError(
                "must be a list of strings (the engine's arguments for this pool alone)",
                key=join_key(key, "args"),
            )
        args = tuple(given)
    concurrency = None
    if value.get("max_concurrency") is not None:
        concurrency = _whole(value["max_concurrency"], join_key(key, "max_concurrency"), 1)
    return Pool(role=role, gpus=gpus, replicas=replicas, args=args, max_concurrency=concurrency)


def _whole(value: object, key: str, lowest: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ConfigError(f"must be a whole number from {lowest}; got {value!r}", key=key)
    return value


def _duration(value: object, key: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"must be a duration (e.g. 10s, 500ms); got {value!r}", key=key)
    try:
        seconds = parse_duration(value)
    except ConfigError as exc:
        raise ConfigError(str(exc), key=key) from None
    if seconds <= 0:
        raise ConfigError(f"must be above 0 (e.g. 10s); got {value!r}", key=key)
    return seconds
