"""A profile's task and max_concurrency: parsed, refused with the fix, stored only when
given, and read back from stored profiles (older ones without them too)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.contracts.catalog import (
    Profile,
    adhoc_profile,
    deployed_profile,
    parse_catalog,
    parse_profile,
    profile_max_concurrency,
    profile_tasks,
)
from llmgw.errors import ConfigError

P = "models.m.profiles.p"
SOURCES = {"sim": None, "vllm": "org/model", "sglang": "org/model", "llamacpp": "m.gguf"}


def _profile(engine: str = "sim", **keys: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"engine": engine}
    if SOURCES[engine] is not None:
        base.update(source=SOURCES[engine], gpus=1 if engine != "llamacpp" else 0)
    return {**base, **keys}


def _parse(profile: dict[str, Any]) -> Profile:
    catalog = parse_catalog({"models": {"m": {"profiles": {"p": profile}}}}, source="c.yaml")
    return catalog.models["m"].profiles["p"]


def _refusal(profile: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        _parse(profile)
    return str(info.value)


# --------------------------------------------------------------------------- task


@pytest.mark.parametrize(
    ("engine", "tasks"),
    [
        ("sim", ("generate", "embed", "rerank")),
        ("vllm", ("generate",)),
        ("sglang", ("generate",)),
        ("llamacpp", ("generate",)),
    ],
)
def test_without_a_task_a_profile_does_what_its_engine_does_by_default(
    engine: str, tasks: tuple[str, ...]
) -> None:
    profile = _parse(_profile(engine))
    assert profile.task is None and profile.tasks == tasks
    assert "task" not in profile.to_dict()
    assert profile_tasks(profile.to_dict()) == tasks


def test_a_single_task_is_a_list_of_one_and_round_trips() -> None:
    profile = _parse(_profile("llamacpp", task="embed"))
    assert profile.tasks == ("embed",)
    stored = json.loads(json.dumps(profile.to_dict()))
    assert stored["task"] == ["embed"]
    assert parse_profile(stored, model="m", profile="p", source="<store>") == profile
    assert profile_tasks(stored) == ("embed",)


def test_tasks_one_replica_can_do_together() -> None:
    assert _parse(_profile("vllm", task=["embed", "rerank"])).tasks == ("embed", "rerank")
    assert _parse(_profile("sim", task=["rerank", "generate"])).tasks == ("rerank", "generate")


@pytest.mark.parametrize(
    ("task", "key", "message"),
    [
        ([], "task", "is empty: give at least one of generate, embed, rerank"),
        ("embedding", "task[0]", "unknown task 'embedding'; did you mean 'embed'?"),
        (["generate", "chat"], "task[1]", "unknown task 'chat'"),
        ([3], "task[0]", "must be a string, one of generate, embed, rerank; got int"),
        (["embed", "embed"], "task[1]", "task 'embed' is listed twice"),
        ({"embed": True}, "task", "must be a task or a list of tasks"),
    ],
)
def test_a_bad_task_is_refused_naming_the_known_ones(task: Any, key: str, message: str) -> None:
    text = _refusal(_profile("sim", task=task))
    assert text.startswith(f"c.yaml: {P}.{key}: "), text
    assert message in text, text


@pytest.mark.parametrize(
    ("engine", "tasks", "together"),
    [
        ("vllm", ["generate", "embed"], " (it can do embed + rerank together)"),
        ("sglang", ["embed", "rerank"], ""),
        ("llamacpp", ["embed", "rerank"], ""),
        ("llamacpp", ["generate", "embed"], ""),
    ],
)
def test_tasks_an_engine_cannot_do_in_one_process_are_refused_with_the_fix(
    engine: str, tasks: list[str], together: str
) -> None:
    assert _refusal(_profile(engine, task=tasks)) == (
        f"c.yaml: {P}.task: one {engine} replica cannot do {' and '.join(tasks)} at once"
        f"{together}; give each task a profile of its own and deploy them as two models "
        "(e.g. NAME and NAME-embed)"
    )


@pytest.mark.parametrize(
    ("engine", "task", "flags"),
    [
        ("llamacpp", "embed", ("--embedding",)),
        ("llamacpp", "rerank", ("--reranking",)),
        ("llamacpp", "generate", ()),
        ("vllm", ["embed", "rerank"], ("--runner", "pooling")),
        ("vllm", "rerank", ("--runner", "pooling")),
        ("sglang", "embed", ("--is-embedding",)),
        ("sim", ["generate", "embed", "rerank"], ()),
    ],
)
def test_the_task_flags_go_before_the_profiles_args(
    engine: str, task: Any, flags: tuple[str, ...]
) -> None:
    profile = _parse(_profile(engine, task=task, args=["--seed-arg", "1"]))
    assert profile.engine_args == (*flags, "--seed-arg", "1")


def test_profile_tasks_of_stored_profiles_older_or_odd() -> None:
    assert profile_tasks({"engine": "llamacpp", "args": []}) == ("generate",)
    assert profile_tasks({"engine": "sim"}) == ("generate", "embed", "rerank")
    assert profile_tasks({"engine": "vllm", "task": "embed"}) == ("embed",)
    # What this llmgw cannot read falls back to the engine's default, never raises.
    assert profile_tasks({"engine": "vllm", "task": ["summarise"]}) == ("generate",)
    assert profile_tasks({"engine": "tgi"}) == ("generate",)
    assert profile_tasks(None) == ("generate",)
    assert profile_tasks(adhoc_profile("sim", {})) == ("generate", "embed", "rerank")


# --------------------------------------------------------------------------- max_concurrency


@pytest.mark.parametrize(
    ("engine", "keys", "limit"),
    [
        ("sim", {}, 64),
        ("vllm", {}, 256),
        ("vllm", {"params": {"max_num_seqs": "32"}}, 32),
        ("vllm", {"args": ["--max-num-seqs=48"]}, 48),
        ("sglang", {}, 256),
        ("sglang", {"params": {"max_running_requests": "16"}}, 16),
        # llama.cpp: its slots; llama-server's own default (-1, auto) is 4.
        ("llamacpp", {}, 4),
        ("llamacpp", {"params": {"parallel": "8"}}, 8),
        ("llamacpp", {"args": ["-np", "3"]}, 3),
        ("llamacpp", {"args": ["--parallel", "6"]}, 6),
        # The args come after the params on the command line: the engine takes them.
        ("llamacpp", {"params": {"parallel": "8"}, "args": ["--parallel=2"]}, 2),
        ("llamacpp", {"args": ["-np", "-1"]}, 4),
        ("llamacpp", {"args": ["-np"]}, 4),
        ("llamacpp", {"args": ["-np", "many"]}, 4),
        # Given, it is the limit whatever the engine's slots.
        ("llamacpp", {"params": {"parallel": "8"}, "max_concurrency": 2}, 2),
        ("vllm", {"max_concurrency": 1000}, 1000),
    ],
)
def test_max_concurrency_given_or_the_engines_default(
    engine: str, keys: dict[str, Any], limit: int
) -> None:
    profile = _parse(_profile(engine, **keys))
    assert profile.concurrency == limit
    stored = json.loads(json.dumps(profile.to_dict()))
    assert profile_max_concurrency(stored) == limit
    assert ("max_concurrency" in stored) == ("max_concurrency" in keys)
    assert parse_profile(stored, model="m", profile="p", source="<store>") == profile


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "must be at least 1, got 0"),
        (-4, "must be at least 1, got -4"),
        ("8", "must be a whole number, got string '8'"),
        (2.5, "must be a whole number, got float 2.5"),
        (True, "must be a whole number, got bool True"),
    ],
)
def test_a_bad_max_concurrency_is_refused(value: Any, message: str) -> None:
    assert _refusal(_profile("sim", max_concurrency=value)) == (
        f"c.yaml: {P}.max_concurrency: {message}"
    )


def test_profile_max_concurrency_of_stored_profiles_older_or_odd() -> None:
    assert profile_max_concurrency({"engine": "llamacpp", "params": {"parallel": "12"}}) == 12
    assert profile_max_concurrency({"engine": "sim", "max_concurrency": 0}) == 64
    assert profile_max_concurrency({"engine": "sim", "max_concurrency": True}) == 64
    assert profile_max_concurrency({"engine": "llamacpp", "params": None, "args": "-np 2"}) == 4
    assert profile_max_concurrency({"engine": "tgi"}) == 256
    assert profile_max_concurrency(None) == 256
    assert profile_max_concurrency(adhoc_profile("llamacpp", {"parallel": 5})) == 5


def test_deployed_profile_is_the_catalogs_or_the_adhoc_one() -> None:
    catalog = {"default": {"engine": "llamacpp", "task": ["embed"]}, "big": {"engine": "vllm"}}
    assert deployed_profile(catalog, "big", "sim", {}) == {"engine": "vllm"}
    assert profile_tasks(deployed_profile(catalog, "default", "sim", {})) == ("embed",)
    # A model deployed without the catalog (llmgw ctl deploy m --engine sim): no profiles.
    adhoc = deployed_profile({}, "default", "sim", {"ttft_ms": 5})
    assert adhoc == adhoc_profile("sim", {"ttft_ms": 5})
    assert profile_tasks(adhoc) == ("generate", "embed", "rerank")
    assert (
        profile_max_concurrency(deployed_profile(None, "default", "llamacpp", {"parallel": 3})) == 3
    )
