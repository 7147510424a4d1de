"""The checks of a catalog profile's keys that say how its engine runs it: ``engine``,
``source``, the shape (``gpus``, ``nodes``, ``gpu_memory``), ``args`` and ``params``,
``task``, ``routing`` (:class:`Routing`), ``sleep``, and the files the gateway reads
(``tokenizer``, ``chat_template``: :class:`FileRef`); with the value checks every key of
the catalog shares (names, whole numbers, strings, URLs, memory sizes).

Each takes the catalog's :class:`~llmgw.configfile.Checker` and the dotted key, and fails
with a :class:`~llmgw.errors.ConfigError` naming both; :mod:`llmgw.contracts.catalog` calls
them in its profile's table, in the order of its keys.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NoReturn

from llmgw.configfile import Checker, index_key, join_key, type_name, unknown_key_message
from llmgw.contracts.memory import parse_memory_mib
from llmgw.contracts.model_sources import SourceSpec, parse_source
from llmgw.engines.launch import check_params, sleep_args
from llmgw.engines.registry import TASKS, engine_names, get_engine, multi_node_engines
from llmgw.errors import ConfigError, EngineError

__all__ = [
    "DEFAULT_ROUTING",
    "ROUTINGS",
    "FileRef",
    "Routing",
    "check_engine",
    "check_engine_args",
    "check_engine_params",
    "check_file_ref",
    "check_memory",
    "check_named",
    "check_routing",
    "check_shape",
    "check_sleep",
    "check_source",
    "check_string",
    "check_strings",
    "check_tasks",
    "check_url",
    "check_whole",
]

_PARAM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")

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


def check_sleep(check: Checker, value: object, key: str, engine: str, nodes: int) -> int:
    """``sleep: {level: N}``: the level, one the engine sleeps at, on one node."""
    raw = check.mapping(value, key, accepted=_SLEEP_KEYS)
    if "level" not in raw:
        check.fail(join_key(key, "level"), "is missing: give 1 (weights kept in host memory) or 2")
    level = check_whole(check, raw["level"], join_key(key, "level"), minimum=1)
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


def check_engine(check: Checker, raw: Mapping[str, Any], at: Callable[[str], str]) -> str:
    """The profile's engine: given, and one llmgw knows."""
    if "engine" not in raw:
        check.fail(at("engine"), f"is missing: choose one of {', '.join(engine_names())}")
    engine = raw["engine"]
    if not isinstance(engine, str):
        check.fail(at("engine"), f"must be a string, got {type_name(engine)}")
    if engine not in engine_names():
        check.fail(at("engine"), unknown_key_message(engine, engine_names(), noun="engine"))
    return engine


def check_source(
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


def check_shape(
    check: Checker, raw: Mapping[str, Any], at: Callable[[str], str], engine: str
) -> tuple[int, int, int | None]:
    """GPUs per shard, nodes per replica, and the memory each GPU must have (MiB, or None)."""
    if "gpus" in raw:
        gpus = check_whole(check, raw["gpus"], at("gpus"), minimum=0)
    elif get_engine(engine).builtin:
        gpus = 0
    else:
        check.fail(
            at("gpus"),
            f"is missing: engine {engine} needs the number of GPUs per shard (0 runs it "
            "without GPUs)",
        )
    nodes = (
        1 if raw.get("nodes") is None else check_whole(check, raw["nodes"], at("nodes"), minimum=1)
    )
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
        memory = check_memory(check, raw["gpu_memory"], at("gpu_memory"))
        if gpus == 0:
            check.fail(
                at("gpu_memory"),
                "is memory per GPU but gpus is 0; give gpus >= 1 or drop gpu_memory",
            )
    return gpus, nodes, memory


def check_engine_args(
    check: Checker, raw: Mapping[str, Any], at: Callable[[str], str], engine: str
) -> tuple[tuple[str, ...], dict[str, str]]:
    """The engine's extra arguments and its parameters, checked against the engine."""
    args: tuple[str, ...] = ()
    if raw.get("args") is not None:
        args = check_strings(check, raw["args"], at("args"))
    params: dict[str, str] = {}
    if raw.get("params") is not None:
        params = check_engine_params(check, raw["params"], at("params"))
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


def check_routing(
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


def check_file_ref(check: Checker, value: object, key: str, example: str) -> FileRef:
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
        location = check_url(check, url, join_key(key, "url"))
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


def check_tasks(check: Checker, value: object, key: str) -> tuple[str, ...]:
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


# --- values --------------------------------------------------------------------------------


def check_named(check: Checker, value: object, key: str) -> dict[str, object]:
    """A mapping whose keys are names the caller checks."""
    if not isinstance(value, Mapping):
        check.fail(key, f"must be a mapping of name to settings, got {type_name(value)}")
    for name in value:
        if not isinstance(name, str):
            check.fail(key, f"names must be strings, got {type_name(name)} {name!r}")
    return dict(value)


def check_whole(check: Checker, value: object, key: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        check.fail(key, f"must be a whole number, got {type_name(value)} {value!r}")
    if value < minimum:
        check.fail(key, f"must be at least {minimum}, got {value}")
    return value


def check_strings(
    check: Checker, value: object, key: str, *, non_empty: bool = False
) -> tuple[str, ...]:
    """A list of strings; numbers are refused with the quoting that fixes them (YAML would
    otherwise turn 010 into 8 and 1.10 into 1.1)."""
    items = check.items(value, key, non_empty=non_empty)
    for index, item in enumerate(items):
        check_string(check, item, index_key(key, index))
    return tuple(str(item) for item in items)


def check_string(check: Checker, value: object, key: str) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        check.fail(key, f'must be a string; quote the number: "{value}"')
    if not isinstance(value, str):
        check.fail(key, f"must be a string, got {type_name(value)}")
    if not value:
        check.fail(key, "must not be empty")
    return value


def check_engine_params(check: Checker, value: object, key: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, item in check_named(check, value, key).items():
        nkey = join_key(key, name)
        if name == "extra_args":
            check.fail(nkey, "is reserved; give extra engine arguments as the profile's args")
        if not _PARAM_NAME.fullmatch(name):
            check.fail(nkey, "is not a valid parameter name: letters, digits and _ . -")
        out[name] = check_string(check, item, nkey)
    return out


def check_url(check: Checker, value: object, key: str) -> str:
    text = check.string(value, key)
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        check.fail(key, f"{text!r} is not an http:// or https:// URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        check.fail(key, f"{text!r} has an invalid port")
    return text


def check_memory(check: Checker, value: object, key: str) -> int:
    try:
        return parse_memory_mib(value)
    except ConfigError as exc:
        _relay(check, key, exc)


def _relay(check: Checker, key: str, exc: ConfigError) -> NoReturn:
    check.fail(key, exc.message)
