"""The model catalog (``catalog.yaml``): each model's named profiles, parsed and checked into
typed objects before anything is stored.

A profile says how to run a model: engine, weights (``source``: a name under the node's
models_root, a path in it, or a URL and its SHA-256, as :mod:`llmgw.contracts.model_sources`
defines them), GPUs per
shard, shards per replica (``nodes``), memory per GPU, extra engine arguments and
parameters, placement, sidecars started before the engine (a model's sidecars go to
each of its profiles; a profile's own sidecar of the same name replaces it), what a replica
does (``task``: generate, embed, rerank; the endpoints that follow are
:mod:`llmgw.contracts.endpoints`) and how many requests the gateway sends it at once
(``max_concurrency``) and what a process engine's sandbox also sees (``sandbox``:
:mod:`llmgw.contracts.sandbox`). Every error is a
:class:`~llmgw.errors.ConfigError` naming the file and the dotted key, which holds the model
and the profile: ``catalog.yaml: models.llama-3-8b.profiles.big.nodes: ...``.

The same parser checks the file in ``llmgw ctl models apply`` and the body of
``PUT /api/catalog`` on the control plane: a contract of both, so it imports neither
``llmgw.server`` nor ``sqlite3``.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn

from llmgw.configfile import (
    Checker,
    index_key,
    join_key,
    load_yaml,
    type_name,
    unknown_key_message,
)
from llmgw.contracts.disagg import (
    Disaggregation,
    parse_disaggregated,
    parse_role,
)
from llmgw.contracts.memory import parse_memory_mib
from llmgw.contracts.model_sources import SourceSpec, parse_source
from llmgw.contracts.resuming import parse_resume, resume_value
from llmgw.contracts.sandbox import SandboxPolicy, parse_sandbox
from llmgw.contracts.scaling import ScalingPolicy, parse_replicas
from llmgw.engines.launch import check_params, sleep_args, task_args
from llmgw.engines.registry import (
    TASKS,
    Engine,
    engine_names,
    get_engine,
    multi_node_engines,
)
from llmgw.errors import ConfigError, EngineError

__all__ = [
    "DEFAULT_PROFILE",
    "DEFAULT_ROUTING",
    "MODEL_NAME",
    "PLACEMENTS",
    "ROUTINGS",
    "STORED",
    "Catalog",
    "FileRef",
    "ModelSpec",
    "Profile",
    "Routing",
    "Sidecar",
    "adhoc_profile",
    "deployed_profile",
    "load_catalog",
    "parse_catalog",
    "parse_memory_mib",
    "parse_profile",
    "profile_body_limit",
    "profile_file",
    "profile_max_concurrency",
    "profile_routing",
    "profile_sleep_level",
    "profile_tasks",
]

DEFAULT_PROFILE = "default"
"""The profile a model deploys when none is named (the store's column default, and the one
profile of a model deployed without the catalog)."""

MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
"""Model names, as the admin API and the gateway's ``model`` field take them."""

_PROFILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PARAM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")

PLACEMENTS: tuple[str, ...] = ("binpack", "spread")

STORED = "<store>"
"""The source a profile read back from the store is parsed under (the one that may carry a
pool's ``role``)."""

MAX_BODY_LIMIT = 1024**3
"""The most a profile's ``max_request_body`` may say (1 GiB)."""

_TOP_KEYS = ("models",)
_MODEL_KEYS = ("profiles", "sidecars", "replicas")
_PROFILE_KEYS = (
    "engine",
    "source",
    "gpus",
    "nodes",
    "gpu_memory",
    "args",
    "params",
    "placement",
    "sidecars",
    "max_request_body",
    "task",
    "max_concurrency",
    "routing",
    "tokenizer",
    "chat_template",
    "sandbox",
    "sleep",
    "host_memory",
    "resume",
    "disaggregated",
    # A disaggregated model's pools' own stored profiles only (llmgw.contracts.disagg).
    "role",
)
_FILE_KEYS = ("url", "path", "sha256")
_SLEEP_KEYS = ("level",)


class Routing(StrEnum):
    """How the gateway picks a replica of a model (a profile's ``routing``): the fewest
    requests in flight (the default); in turn; the replica a conversation (``user`` or
    ``x-session-id``) last used; the replica the gateway last sent the prompt's prefix to; the
    replica whose engine reports holding the most of the prompt's prefix in its KV cache. Each
    weighs the load too (:mod:`llmgw.server.gateway.policies`)."""

    LEAST_OUTSTANDING = "least-outstanding"
    ROUND_ROBIN = "round-robin"
    SESSION = "session"
    PREFIX_APPROX = "prefix-approx"
    KV_EVENTS = "kv-events"


ROUTINGS: tuple[str, ...] = tuple(Routing)
"""The names of :class:`Routing`, in the order the errors list them."""
DEFAULT_ROUTING = Routing.LEAST_OUTSTANDING
_SIDECAR_KEYS = ("name", "command", "health", "timeout", "ready_after")


# --- the parsed catalog --------------------------------------------------------------------


@dataclass(frozen=True)
class Sidecar:
    """A helper process started on the node before the engine, and stopped after it."""

    name: str
    command: tuple[str, ...]
    health: str | None = None
    timeout_s: float = 60.0
    ready_after_s: float = 2.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "command": list(self.command)}
        if self.health is not None:
            out["health"] = self.health
        out["timeout"] = self.timeout_s
        out["ready_after"] = self.ready_after_s
        return out


@dataclass(frozen=True)
class FileRef:
    """A file the control plane reads for a profile (its tokenizer, its chat template): an
    absolute path on the control plane, or a URL fetched once and checked by its SHA-256
    (a path may give one too, and is then checked as well)."""

    location: str
    sha256: str = ""

    @property
    def is_url(self) -> bool:
        return "://" in self.location

    def to_value(self) -> dict[str, str]:
        out = {"url" if self.is_url else "path": self.location}
        if self.sha256:
            out["sha256"] = self.sha256
        return out


@dataclass(frozen=True)
class Profile:
    """One way to run a model. ``gpus`` and ``gpu_memory_mib`` are per shard and per GPU;
    a replica has ``nodes`` shards, one per node."""

    engine: str
    # The weights as the profile names them (name, path or URL); a URL has its SHA-256.
    source: str | None = None
    gpus: int = 0
    nodes: int = 1
    gpu_memory_mib: int | None = None
    args: tuple[str, ...] = ()
    params: dict[str, str] = field(default_factory=dict)
    placement: str = "binpack"
    sidecars: tuple[Sidecar, ...] = ()
    # The largest request body the gateway (and the data plane) take for the model while
    # this profile is deployed, in bytes; None: server.yaml's max_request_body.
    max_request_body: int | None = None
    source_sha256: str = ""
    # As the catalog gives them; None: the engine's defaults (:attr:`tasks`, :attr:`concurrency`).
    task: tuple[str, ...] | None = None
    max_concurrency: int | None = None
    routing: str | None = None
    # What the gateway keys a prompt's blocks with for routing: kv-events (vLLM, SGLang).
    tokenizer: FileRef | None = None
    chat_template: FileRef | None = None
    # What a process engine's sandbox sees beyond the agent's choice (contracts.sandbox).
    sandbox: SandboxPolicy = field(default_factory=SandboxPolicy)
    # ``sleep: {level: N}``: its replicas may be put to sleep at level N (llmgw.engines.sleep);
    # None: they are only started and stopped.
    sleep_level: int | None = None
    # ``host_memory``: the node memory (MiB) a replica needs beside its GPUs; placement
    # checks it against what the node's sleepers and replicas hold. None: not checked.
    host_memory_mib: int | None = None
    # ``resume``: how many times the gateway continues one of its streams on another replica
    # (llmgw.contracts.resuming; 0: off); None: the default.
    max_resumes: int | None = None
    # ``disaggregated``: its replicas in a prefill and a decode pool (llmgw.contracts.disagg).
    disaggregated: Disaggregation | None = None
    # A pool's own profile (stored, made by contracts.disagg.pool_profile): its role.
    role: str | None = None

    @property
    def routing_policy(self) -> str:
        """How the gateway picks a replica: ``routing``, else least-outstanding."""
        return self.routing or DEFAULT_ROUTING

    @property
    def tasks(self) -> tuple[str, ...]:
        """What a replica of this profile does: ``task``, else the engine's default."""
        return self.task if self.task is not None else get_engine(self.engine).default_tasks

    @property
    def concurrency(self) -> int:
        """The requests the gateway sends one replica at once: ``max_concurrency``, else the
        engine's default for these params and args (llama.cpp: its slots)."""
        if self.max_concurrency is not None:
            return self.max_concurrency
        return get_engine(self.engine).max_concurrency_for(self.params, self.args)

    @property
    def engine_args(self) -> tuple[str, ...]:
        """The extra arguments a shard's engine gets: the flags of the profile's task (e.g.
        llama.cpp's --embedding), then ``args``. They travel as StartShard's extra_args, so
        an agent of any version runs the engine in that mode."""
        sleep = sleep_args(self.engine, self.sleep_level) if self.sleep_level else []
        return (*task_args(self.engine, self.tasks), *sleep, *self.args)

    @property
    def source_spec(self) -> SourceSpec | None:
        """The source as placement and the agent check it; None when the profile has none."""
        return None if self.source is None else SourceSpec(self.source, self.source_sha256)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, in the catalog's own form: parsing it again gives this profile."""
        out: dict[str, Any] = {"engine": self.engine}
        if self.source_spec is not None:
            out["source"] = self.source_spec.to_value()
        out["gpus"] = self.gpus
        out["nodes"] = self.nodes
        if self.gpu_memory_mib is not None:
            out["gpu_memory"] = self.gpu_memory_mib
        out["args"] = list(self.args)
        out["params"] = dict(self.params)
        out["placement"] = self.placement
        out["sidecars"] = [s.to_dict() for s in self.sidecars]
        if self.max_request_body is not None:
            out["max_request_body"] = self.max_request_body
        # Only when given, so that a stored profile of before these keys and the same
        # profile applied again compare equal (and its default follows the engine's).
        if self.task is not None:
            out["task"] = list(self.task)
        if self.max_concurrency is not None:
            out["max_concurrency"] = self.max_concurrency
        if self.routing is not None:
            out["routing"] = self.routing
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer.to_value()
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template.to_value()
        if not self.sandbox.is_default:
            out["sandbox"] = self.sandbox.to_value()
        if self.sleep_level is not None:
            out["sleep"] = {"level": self.sleep_level}
        if self.host_memory_mib is not None:
            out["host_memory"] = self.host_memory_mib
        if self.max_resumes is not None:
            out["resume"] = resume_value(self.max_resumes)
        if self.disaggregated is not None:
            out["disaggregated"] = self.disaggregated.to_dict()
        if self.role is not None:
            out["role"] = self.role
        return out


@dataclass(frozen=True)
class ModelSpec:
    name: str
    profiles: dict[str, Profile]
    # How many replicas it runs when deployed without saying (llmgw.contracts.scaling): a
    # fixed count, or a range by demand; None: the catalog does not say.
    replicas: int | ScalingPolicy | None = None

    def to_dict(self) -> dict[str, Any]:
        """Model-level sidecars are already folded into each profile."""
        out: dict[str, Any] = {"profiles": {name: p.to_dict() for name, p in self.profiles.items()}}
        if isinstance(self.replicas, ScalingPolicy):
            out["replicas"] = self.replicas.to_json()
        elif self.replicas is not None:
            out["replicas"] = self.replicas
        return out


@dataclass(frozen=True)
class Catalog:
    models: dict[str, ModelSpec]

    def to_dict(self) -> dict[str, Any]:
        return {"models": {name: m.to_dict() for name, m in self.models.items()}}


def adhoc_profile(engine: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The single ``default`` profile (as stored) of a model deployed without the catalog,
    from its engine and ``params`` (where ``extra_args`` is the list of extra arguments)."""
    extra = params.get("extra_args", [])
    return Profile(
        engine=engine,
        args=tuple(str(a) for a in extra) if isinstance(extra, list | tuple) else (),
        params={k: str(v) for k, v in params.items() if k != "extra_args"},
    ).to_dict()


def deployed_profile(
    profiles: Mapping[str, Any] | None, profile: str, engine: str, params: Mapping[str, Any]
) -> Mapping[str, Any]:
    """The stored profile a model runs: ``profiles[profile]`` (a catalog model), else the
    :func:`adhoc_profile` of its ``engine`` and ``params`` (a model deployed without the
    catalog, whose ``profiles`` are empty). What :func:`profile_tasks` and
    :func:`profile_max_concurrency` read, so that an ad-hoc sim model gets sim's defaults."""
    stored = profiles.get(profile) if profiles else None
    return stored if isinstance(stored, Mapping) else adhoc_profile(engine, params)


# --- loading -------------------------------------------------------------------------------


def load_catalog(path: Path) -> Catalog:
    """Read and check a catalog file; every problem is a ConfigError naming it."""
    data = load_yaml(
        path, missing_hint="give the path of the catalog file (models and their profiles)"
    )
    return parse_catalog(data, source=str(path))


def parse_catalog(data: object, *, source: str) -> Catalog:
    """Check parsed catalog data (from YAML or JSON); ``source`` names it in errors."""
    check = Checker(file=source, base_dir=Path("/"))
    if data is None:
        check.fail("", "is empty; a catalog is 'models:' with each model's profiles")
    top = check.mapping(data, "", accepted=_TOP_KEYS)
    if "models" not in top:
        check.fail("models", "is missing: give 'models:', a mapping of model name to profiles")
    models: dict[str, ModelSpec] = {}
    for name, value in _named(check, top["models"], "models").items():
        key = join_key("models", name)
        if not MODEL_NAME.fullmatch(name):
            check.fail(
                key,
                "is not a valid model name: 1-128 letters, digits and . _ : / -, starting "
                "with a letter or digit",
            )
        models[name] = _model(check, name, value, key)
    return Catalog(models)


def parse_profile(data: object, *, model: str, profile: str, source: str) -> Profile:
    """Check one profile on its own, as stored (``Model.profiles[name]``) or as in a
    catalog; errors name ``models.MODEL.profiles.PROFILE.KEY`` and ``source``."""
    check = Checker(file=source, base_dir=Path("/"))
    return _profile(check, data, f"models.{model}.profiles.{profile}", ())


def _model(check: Checker, name: str, value: object, key: str) -> ModelSpec:
    raw = check.mapping(value, key, accepted=_MODEL_KEYS)
    shared: tuple[Sidecar, ...] = ()
    if raw.get("sidecars") is not None:
        shared = _sidecars(check, raw["sidecars"], join_key(key, "sidecars"))
    pkey = join_key(key, "profiles")
    if "profiles" not in raw:
        check.fail(pkey, f"is missing: model {name} needs at least one profile, e.g. 'default:'")
    named = _named(check, raw["profiles"], pkey)
    if not named:
        check.fail(pkey, f"is empty: model {name} needs at least one profile, e.g. 'default:'")
    profiles: dict[str, Profile] = {}
    for pname, pvalue in named.items():
        if not _PROFILE_NAME.fullmatch(pname):
            check.fail(
                join_key(pkey, pname),
                "is not a valid profile name: 1-64 letters, digits and . _ -, starting with "
                "a letter or digit",
            )
        profiles[pname] = _profile(check, pvalue, join_key(pkey, pname), shared)
    replicas: int | ScalingPolicy | None = None
    if raw.get("replicas") is not None:
        try:
            replicas = parse_replicas(raw["replicas"], key=join_key(key, "replicas"))
        except ConfigError as exc:
            raise ConfigError(str(exc), file=check.file) from None
    return ModelSpec(name, profiles, replicas)


def _profile(check: Checker, value: object, key: str, shared: tuple[Sidecar, ...]) -> Profile:
    raw = check.mapping(value, key, accepted=_PROFILE_KEYS)

    def at(name: str) -> str:
        return join_key(key, name)

    engine = _profile_engine(check, raw, at)
    source = _profile_source(check, raw, at, engine)
    gpus, nodes, memory = _profile_shape(check, raw, at, engine)
    args, params = _profile_engine_args(check, raw, at, engine)
    placement = "binpack"
    if raw.get("placement") is not None:
        given = raw["placement"]
        if not isinstance(given, str):
            check.fail(at("placement"), f"must be a string, got {type_name(given)}")
        if given not in PLACEMENTS:
            check.fail(at("placement"), unknown_key_message(given, PLACEMENTS, noun="placement"))
        placement = given

    sidecars = shared
    if raw.get("sidecars") is not None:
        sidecars = _merge(shared, _sidecars(check, raw["sidecars"], at("sidecars")))
    max_body = None
    if raw.get("max_request_body") is not None:
        max_body = check.size(
            raw["max_request_body"], at("max_request_body"), minimum=1024, maximum=MAX_BODY_LIMIT
        )
    task = None
    if raw.get("task") is not None:
        task = _tasks(check, raw["task"], at("task"))
        try:
            task_args(engine, task)
        except EngineError as exc:
            check.fail(at("task"), exc.message)
    max_concurrency = None
    if raw.get("max_concurrency") is not None:
        max_concurrency = _whole(check, raw["max_concurrency"], at("max_concurrency"), minimum=1)
    tokenizer = None
    if raw.get("tokenizer") is not None:
        tokenizer = _file_ref(check, raw["tokenizer"], at("tokenizer"), "tokenizer.json")
    chat_template = None
    if raw.get("chat_template") is not None:
        chat_template = _file_ref(
            check, raw["chat_template"], at("chat_template"), "chat_template.jinja"
        )
    routing = None
    if raw.get("routing") is not None:
        routing = _routing(check, raw["routing"], at("routing"), engine, tokenizer)
    sandbox = SandboxPolicy()
    if raw.get("sandbox") is not None:
        sandbox = parse_sandbox(check, raw["sandbox"], at("sandbox"))
    sleep_level = None
    if raw.get("sleep") is not None:
        sleep_level = _sleep(check, raw["sleep"], at("sleep"), engine, nodes)
    host = raw.get("host_memory")
    max_resumes = None
    if raw.get("resume") is not None:
        try:
            max_resumes = parse_resume(raw["resume"])
        except ValueError as exc:
            check.fail(at("resume"), str(exc))
    disaggregated, role = _disaggregation(check, raw, at, engine, nodes)
    return Profile(
        engine=engine,
        source=source.text if source is not None else None,
        source_sha256=source.sha256 if source is not None else "",
        gpus=gpus,
        nodes=nodes,
        gpu_memory_mib=memory,
        args=args,
        params=params,
        placement=placement,
        sidecars=sidecars,
        max_request_body=max_body,
        task=task,
        max_concurrency=max_concurrency,
        routing=routing,
        tokenizer=tokenizer,
        chat_template=chat_template,
        sandbox=sandbox,
        sleep_level=sleep_level,
        host_memory_mib=None if host is None else _memory(check, host, at("host_memory")),
        max_resumes=max_resumes,
        disaggregated=disaggregated,
        role=role,
    )


def _disaggregation(
    check: Checker, raw: Mapping[str, Any], at: Callable[[str], str], engine: str, nodes: int
) -> tuple[Disaggregation | None, str | None]:
    """``disaggregated`` (a catalog's or a deployment's), or a pool's own ``role`` (stored
    by the control plane only, never in a catalog)."""
    disaggregated = role = None
    if raw.get("disaggregated") is not None:
        try:
            disaggregated = parse_disaggregated(
                raw["disaggregated"], key=at("disaggregated"), engine=engine, nodes=nodes
            )
        except ConfigError as exc:
            raise ConfigError(str(exc), file=check.file) from None
    if raw.get("role") is not None:
        if check.file != STORED:
            check.fail(
                at("role"),
                "is set by llmgw on a disaggregated model's pools; declare "
                "disaggregated: {prefill: {...}, decode: {...}} instead",
            )
        if disaggregated is not None:
            check.fail(at("role"), "a pool's profile cannot itself be disaggregated")
        try:
            role = parse_role(raw["role"], key=at("role"), engine=engine)
        except ConfigError as exc:
            raise ConfigError(str(exc), file=check.file) from None
    return disaggregated, role


def _sleep(check: Checker, value: object, key: str, engine: str, nodes: int) -> int:
    """``sleep: {level: N}``: the level, one the engine sleeps at, on one node."""
    raw = check.mapping(value, key, accepted=_SLEEP_KEYS)
    if "level" not in raw:
        check.fail(join_key(key, "level"), "is missing: give 1 (weights kept in host memory) or 2")
    level = _whole(check, raw["level"], join_key(key, "level"), minimum=1)
    try:
        sleep_args(engine, level)
    except EngineError as exc:
        check.fail(key, exc.message)
    if nodes > 1:
        check.fail(
            key,
            f"a replica of {nodes} nodes cannot sleep (only one node's engine serves the sleep "
            "routes); drop 'sleep' or use nodes: 1",
        )
    return level


def _profile_engine(check: Checker, raw: Mapping[str, Any], at: Callable[[str], str]) -> str:
    """The profile's engine: given, and one llmgw knows."""
    if "engine" not in raw:
        check.fail(at("engine"), f"is missing: choose one of {', '.join(engine_names())}")
    engine = raw["engine"]
    if not isinstance(engine, str):
        check.fail(at("engine"), f"must be a string, got {type_name(engine)}")
    if engine not in engine_names():
        check.fail(at("engine"), unknown_key_message(engine, engine_names(), noun="engine"))
    return engine


def _profile_source(
    check: Checker, raw: Mapping[str, Any], at: Callable[[str], str], engine: str
) -> SourceSpec | None:
    """Where the weights come from; only a built-in engine needs none."""
    if raw.get("source") is not None:
        try:
            return parse_source(raw["source"])
        except ConfigError as exc:
            _relay(check, at("source"), exc)
    if not get_engine(engine).builtin:
        check.fail(
            at("source"),
            f"is missing: engine {engine} needs its weights: a name under the node's "
            "models_root (e.g. llama-3-8b), or {url: https://…, sha256: …}",
        )
    return None


def _profile_shape(
    check: Checker, raw: Mapping[str, Any], at: Callable[[str], str], engine: str
) -> tuple[int, int, int | None]:
    """GPUs per shard, nodes per replica, and the memory each GPU must have (MiB, or None)."""
    if "gpus" in raw:
        gpus = _whole(check, raw["gpus"], at("gpus"), minimum=0)
    elif get_engine(engine).builtin:
        gpus = 0
    else:
        check.fail(
            at("gpus"),
            f"is missing: engine {engine} needs the number of GPUs per shard (0 runs it "
            "without GPUs)",
        )
    nodes = 1 if raw.get("nodes") is None else _whole(check, raw["nodes"], at("nodes"), minimum=1)
    if nodes > 1 and gpus < 1:
        check.fail(
            at("nodes"),
            f"{nodes} nodes need gpus >= 1 (multi-node replicas shard GPUs across nodes)",
        )
    if nodes > 1 and not get_engine(engine).multi_node:
        check.fail(
            at("nodes"),
            f"engine {engine} has no multi-node form; use nodes: 1 or one of "
            f"{', '.join(multi_node_engines())}",
        )
    memory = None
    if raw.get("gpu_memory") is not None:
        memory = _memory(check, raw["gpu_memory"], at("gpu_memory"))
        if gpus == 0:
            check.fail(
                at("gpu_memory"),
                "is memory per GPU but gpus is 0; give gpus >= 1 or drop gpu_memory",
            )
    return gpus, nodes, memory


def _profile_engine_args(
    check: Checker, raw: Mapping[str, Any], at: Callable[[str], str], engine: str
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The engine's extra arguments and its parameters, checked against the engine."""
    args: tuple[str, ...] = ()
    if raw.get("args") is not None:
        args = _strings(check, raw["args"], at("args"))
    params: dict[str, str] = {}
    if raw.get("params") is not None:
        params = _params(check, raw["params"], at("params"))
    if "model_path" in params:
        check.fail(
            join_key(at("params"), "model_path"),
            "is the profile's source; give the weights' path there",
        )
    try:
        check_params(engine, params)
    except EngineError as exc:
        check.fail(at("params"), exc.message)
    return args, params


def _routing(
    check: Checker, value: object, key: str, engine: str, tokenizer: FileRef | None
) -> str:
    if not isinstance(value, str):
        check.fail(key, f"must be one of {', '.join(ROUTINGS)}; got {type_name(value)}")
    if value not in ROUTINGS:
        check.fail(key, unknown_key_message(value, ROUTINGS, noun="routing"))
    if value == "kv-events":
        spec = get_engine(engine)
        if not spec.kv_events:
            with_events = ", ".join(n for n in engine_names() if get_engine(n).kv_events)
            check.fail(
                key,
                f"kv-events needs an engine that publishes its KV cache events ({with_events}); "
                f"engine {engine} does not: use routing: prefix-approx",
            )
        if spec.tokenizer_needed and tokenizer is None:
            check.fail(
                key,
                f"kv-events with engine {engine} needs the model's tokenizer, so that the "
                "gateway keys a prompt as the engine does: add tokenizer: {url: https://…/"
                "tokenizer.json, sha256: …} (or an absolute path on the control plane)",
            )
    return value


def _file_ref(check: Checker, value: object, key: str, example: str) -> FileRef:
    """An absolute path on the control plane, or {url, sha256} (or {path, sha256})."""
    if isinstance(value, str):
        value = {"url" if "://" in value else "path": value}
    if not isinstance(value, Mapping):
        check.fail(
            key,
            f"must be an absolute path on the control plane or {{url: https://…/{example}, "
            f"sha256: …}}; got {type_name(value)}",
        )
    raw = check.mapping(value, key, accepted=_FILE_KEYS)
    url, path, sha256 = raw.get("url"), raw.get("path"), raw.get("sha256")
    if (url is None) == (path is None):
        check.fail(
            key,
            f"give one of url (with its sha256) or path, e.g. {{url: https://…/{example}, sha256: …}}",
        )
    digest = ""
    if sha256 is not None:
        digest = check.string(sha256, join_key(key, "sha256")).lower()
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            check.fail(join_key(key, "sha256"), "must be 64 hexadecimal digits (a SHA-256)")
    if url is not None:
        location = _url(check, url, join_key(key, "url"))
        if not digest:
            check.fail(
                join_key(key, "sha256"),
                f"is missing: a fetched file is checked by its SHA-256 (sha256sum {example})",
            )
        return FileRef(location, digest)
    location = check.string(path, join_key(key, "path"))
    if not location.startswith("/") or "\0" in location:
        check.fail(
            join_key(key, "path"), f"{location!r} must be an absolute path on the control plane"
        )
    return FileRef(location, digest)


def _tasks(check: Checker, value: object, key: str) -> tuple[str, ...]:
    """A list of tasks; a single name is a list of one."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        check.fail(
            key, f"must be a task or a list of tasks ({', '.join(TASKS)}), got {type_name(value)}"
        )
    if not value:
        check.fail(
            key,
            f"is empty: give at least one of {', '.join(TASKS)}, or drop the key "
            "for the engine's default",
        )
    tasks: list[str] = []
    for index, item in enumerate(value):
        ikey = index_key(key, index)
        if not isinstance(item, str):
            check.fail(ikey, f"must be a string, one of {', '.join(TASKS)}; got {type_name(item)}")
        if item not in TASKS:
            check.fail(ikey, unknown_key_message(item, TASKS, noun="task"))
        if item in tasks:
            check.fail(ikey, f"task {item!r} is listed twice")
        tasks.append(item)
    return tuple(tasks)


def profile_body_limit(profile: Mapping[str, Any] | None) -> int | None:
    """A stored profile's (:meth:`Profile.to_dict`) ``max_request_body``, or None."""
    value = profile.get("max_request_body") if profile else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def profile_tasks(profile: Mapping[str, Any] | None) -> tuple[str, ...]:
    """A stored profile's (:meth:`Profile.to_dict`) tasks: its ``task``, else its engine's
    default (a profile stored before ``task`` existed has none). Give it
    :func:`deployed_profile` of the model, so that a model deployed without the catalog gets
    its engine's default; None and an engine this llmgw does not know: ``("generate",)``."""
    value = profile.get("task") if profile else None
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value and all(t in TASKS for t in value):
        return tuple(dict.fromkeys(value))
    return _stored_engine(profile).default_tasks


def profile_max_concurrency(profile: Mapping[str, Any] | None) -> int:
    """A stored profile's (:meth:`Profile.to_dict`) ``max_concurrency``, else its engine's
    default for its params and args (llama.cpp: its slots, ``params.parallel`` or ``-np`` /
    ``--parallel`` in args, else llama-server's 4). None and an unknown engine: 256."""
    value = profile.get("max_concurrency") if profile else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    params = profile.get("params") if profile else None
    args = profile.get("args") if profile else None
    return _stored_engine(profile).max_concurrency_for(
        params if isinstance(params, Mapping) else {},
        [str(a) for a in args] if isinstance(args, list) else [],
    )


def profile_routing(profile: Mapping[str, Any] | None) -> Routing:
    """A stored profile's (:meth:`Profile.to_dict`) ``routing``, else least-outstanding."""
    value = profile.get("routing") if profile else None
    return Routing(value) if isinstance(value, str) and value in ROUTINGS else DEFAULT_ROUTING


def profile_sleep_level(profile: Mapping[str, Any] | None) -> int:
    """A stored profile's (:meth:`Profile.to_dict`) sleep level; 0 when its replicas
    cannot sleep (no ``sleep``, or a level its engine does not sleep at)."""
    value = profile.get("sleep") if profile else None
    level = value.get("level") if isinstance(value, Mapping) else None
    if not isinstance(level, int) or isinstance(level, bool):
        return 0
    return level if level in _stored_engine(profile).sleep_levels else 0


def profile_file(profile: Mapping[str, Any] | None, key: str) -> FileRef | None:
    """A stored profile's (:meth:`Profile.to_dict`) file ``key`` (``tokenizer``,
    ``chat_template``) as a FileRef; None when it has none (or not in that form)."""
    value = profile.get(key) if profile else None
    if not isinstance(value, Mapping):
        return None
    location = value.get("url", value.get("path"))
    sha256 = value.get("sha256", "")
    if not isinstance(location, str) or not location or not isinstance(sha256, str):
        return None
    return FileRef(location, sha256)


_UNKNOWN_ENGINE = Engine("", "", multi_node=False)


def _stored_engine(profile: Mapping[str, Any] | None) -> Engine:
    engine = profile.get("engine") if profile else None
    try:
        return get_engine(engine) if isinstance(engine, str) else _UNKNOWN_ENGINE
    except EngineError:
        return _UNKNOWN_ENGINE


def _merge(shared: tuple[Sidecar, ...], own: tuple[Sidecar, ...]) -> tuple[Sidecar, ...]:
    """The model's sidecars, a profile's one of the same name replacing it, then the
    profile's others."""
    mine = {s.name: s for s in own}
    merged = [mine.pop(s.name, s) for s in shared]
    return (*merged, *(s for s in own if s.name in mine))


def _sidecars(check: Checker, value: object, key: str) -> tuple[Sidecar, ...]:
    out: list[Sidecar] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(check.items(value, key)):
        ikey = index_key(key, index)
        sidecar = _sidecar(check, item, ikey)
        if sidecar.name in seen:
            check.fail(
                join_key(ikey, "name"),
                f"sidecar {sidecar.name!r} is listed twice (also {seen[sidecar.name]})",
            )
        seen[sidecar.name] = ikey
        out.append(sidecar)
    return tuple(out)


def _sidecar(check: Checker, value: object, key: str) -> Sidecar:
    raw = check.mapping(value, key, accepted=_SIDECAR_KEYS)

    def at(name: str) -> str:
        return join_key(key, name)

    if "name" not in raw:
        check.fail(at("name"), "is missing: each sidecar needs a name, e.g. tokenizer")
    name = check.string(raw["name"], at("name"))
    if not _PROFILE_NAME.fullmatch(name):
        check.fail(
            at("name"),
            f"{name!r} is not a valid sidecar name: 1-64 letters, digits and . _ -, starting "
            "with a letter or digit",
        )
    if "command" not in raw:
        check.fail(at("command"), "is missing: the program and its arguments, as a list")
    command = _strings(check, raw["command"], at("command"), non_empty=True)
    program = command[0]
    if "/" in program and not program.startswith("/"):
        check.fail(
            index_key(at("command"), 0),
            f"{program!r} is a relative path; give an absolute path on the node, or a bare "
            "name looked up in PATH",
        )
    health = None
    if raw.get("health") is not None:
        health = _url(check, raw["health"], at("health"))
    timeout = 60.0
    if raw.get("timeout") is not None:
        timeout = check.duration(raw["timeout"], at("timeout"))
        if timeout <= 0:
            check.fail(at("timeout"), "must be more than 0 s")
    ready_after = 2.0
    if raw.get("ready_after") is not None:
        ready_after = check.duration(raw["ready_after"], at("ready_after"))
    return Sidecar(
        name=name, command=command, health=health, timeout_s=timeout, ready_after_s=ready_after
    )


# --- values --------------------------------------------------------------------------------


def _named(check: Checker, value: object, key: str) -> dict[str, object]:
    """A mapping whose keys are names the caller checks."""
    if not isinstance(value, Mapping):
        check.fail(key, f"must be a mapping of name to settings, got {type_name(value)}")
    for name in value:
        if not isinstance(name, str):
            check.fail(key, f"names must be strings, got {type_name(name)} {name!r}")
    return dict(value)


def _whole(check: Checker, value: object, key: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        check.fail(key, f"must be a whole number, got {type_name(value)} {value!r}")
    if value < minimum:
        check.fail(key, f"must be at least {minimum}, got {value}")
    return value


def _strings(
    check: Checker, value: object, key: str, *, non_empty: bool = False
) -> tuple[str, ...]:
    """A list of strings; numbers are refused with the quoting that fixes them (YAML would
    otherwise turn 010 into 8 and 1.10 into 1.1)."""
    items = check.items(value, key, non_empty=non_empty)
    for index, item in enumerate(items):
        _string(check, item, index_key(key, index))
    return tuple(str(item) for item in items)


def _string(check: Checker, value: object, key: str) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        check.fail(key, f'must be a string; quote the number: "{value}"')
    if not isinstance(value, str):
        check.fail(key, f"must be a string, got {type_name(value)}")
    if not value:
        check.fail(key, "must not be empty")
    return value


def _params(check: Checker, value: object, key: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, item in _named(check, value, key).items():
        nkey = join_key(key, name)
        if name == "extra_args":
            check.fail(nkey, "is reserved; give extra engine arguments as the profile's args")
        if not _PARAM_NAME.fullmatch(name):
            check.fail(nkey, "is not a valid parameter name: letters, digits and _ . -")
        out[name] = _string(check, item, nkey)
    return out


def _url(check: Checker, value: object, key: str) -> str:
    text = check.string(value, key)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        check.fail(key, f"{text!r} is not an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        check.fail(key, f"{text!r} has an invalid port")
    return text


def _memory(check: Checker, value: object, key: str) -> int:
    try:
        return parse_memory_mib(value)
    except ConfigError as exc:
        _relay(check, key, exc)


def _relay(check: Checker, key: str, exc: ConfigError) -> NoReturn:
    check.fail(key, exc.message)
