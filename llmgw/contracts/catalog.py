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

This module is the catalog's table: its objects, each key of a model and a profile and the
order they are read in, sidecars, and what the rest of llmgw reads of a stored profile. The
checks of the keys that say how a profile's engine runs it (engine, source, shape, args,
task, routing, sleep, its files) and the value checks all keys share are
:mod:`llmgw.contracts.profile_keys`'.

The same parser checks the file in ``llmgw ctl models apply`` and the body of
``PUT /api/catalog`` on the control plane: a contract of both, so it imports neither
``llmgw.server`` nor ``sqlite3``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
from llmgw.contracts.model_sources import SourceSpec
from llmgw.contracts.profile_keys import (
    DEFAULT_ROUTING,
    ROUTINGS,
    FileRef,
    Routing,
    check_engine,
    check_engine_args,
    check_file_ref,
    check_memory,
    check_named,
    check_routing,
    check_shape,
    check_sleep,
    check_source,
    check_strings,
    check_tasks,
    check_url,
    check_whole,
)
from llmgw.contracts.resuming import parse_resume, resume_value
from llmgw.contracts.sandbox import SandboxPolicy, parse_sandbox
from llmgw.contracts.scaling import ScalingPolicy, parse_replicas
from llmgw.engines.launch import sleep_args, task_args
from llmgw.engines.registry import (
    TASKS,
    Engine,
    get_engine,
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
    for name, value in check_named(check, top["models"], "models").items():
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
    named = check_named(check, raw["profiles"], pkey)
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

    engine = check_engine(check, raw, at)
    source = check_source(check, raw, at, engine)
    gpus, nodes, memory = check_shape(check, raw, at, engine)
    args, params = check_engine_args(check, raw, at, engine)
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
        task = check_tasks(check, raw["task"], at("task"))
        try:
            task_args(engine, task)
        except EngineError as exc:
            check.fail(at("task"), exc.message)
    max_concurrency = None
    if raw.get("max_concurrency") is not None:
        max_concurrency = check_whole(
            check, raw["max_concurrency"], at("max_concurrency"), minimum=1
        )
    tokenizer = None
    if raw.get("tokenizer") is not None:
        tokenizer = check_file_ref(check, raw["tokenizer"], at("tokenizer"), "tokenizer.json")
    chat_template = None
    if raw.get("chat_template") is not None:
        chat_template = check_file_ref(
            check, raw["chat_template"], at("chat_template"), "chat_template.jinja"
        )
    routing = None
    if raw.get("routing") is not None:
        routing = check_routing(check, raw["routing"], at("routing"), engine, tokenizer)
    sandbox = SandboxPolicy()
    if raw.get("sandbox") is not None:
        sandbox = parse_sandbox(check, raw["sandbox"], at("sandbox"))
    sleep_level = None
    if raw.get("sleep") is not None:
        sleep_level = check_sleep(check, raw["sleep"], at("sleep"), engine, nodes)
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
        host_memory_mib=None if host is None else check_memory(check, host, at("host_memory")),
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
    command = check_strings(check, raw["command"], at("command"), non_empty=True)
    program = command[0]
    if "/" in program and not program.startswith("/"):
        check.fail(
            index_key(at("command"), 0),
            f"{program!r} is a relative path; give an absolute path on the node, or a bare "
            "name looked up in PATH",
        )
    health = None
    if raw.get("health") is not None:
        health = check_url(check, raw["health"], at("health"))
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
