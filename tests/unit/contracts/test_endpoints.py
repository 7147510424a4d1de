"""The gateway's endpoint table: what each path needs, what each engine serves per task,
and refusals that say which profile or engine would serve the path."""

from __future__ import annotations

import pytest

from llmgw.contracts.endpoints import (
    ANY_TASK,
    PATHS,
    endpoint_refusal,
    path_task,
    served_paths,
)
from llmgw.engines.launch import engine_module
from llmgw.engines.registry import ENGINES, TASKS

GENERATE = {"/v1/chat/completions", "/v1/completions", "/v1/responses"}
TOKENS = {"/tokenize", "/detokenize"}


def test_each_path_needs_one_task_or_any() -> None:
    assert {path: path_task(path) for path in PATHS} == {
        "/v1/chat/completions": "generate",
        "/v1/completions": "generate",
        "/v1/responses": "generate",
        "/v1/embeddings": "embed",
        "/v1/rerank": "rerank",
        "/v1/score": "rerank",
        "/tokenize": ANY_TASK,
        "/detokenize": ANY_TASK,
    }
    with pytest.raises(KeyError):
        path_task("/v1/images/generations")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_each_engine_row_is_consistent_with_the_table(engine: str) -> None:
    row = ENGINES[engine]
    assert set(row.endpoints) <= set(TASKS)
    for task, paths in row.endpoints.items():
        for path in paths:
            # Listed only under a task that path can be asked of.
            assert PATHS[path] in (ANY_TASK, task), (task, path)
    assert row.default_tasks and set(row.default_tasks) <= set(TASKS)
    assert row.can_serve_together(row.default_tasks)
    for together in row.task_sets:
        assert together <= set(TASKS)
    assert set(engine_module(engine).TASK_FLAGS) <= set(TASKS)


@pytest.mark.parametrize(
    ("engine", "tasks", "paths"),
    [
        ("sim", TASKS, set(PATHS)),
        ("vllm", ("generate",), GENERATE | TOKENS),
        ("vllm", ("embed",), {"/v1/embeddings"} | TOKENS),
        ("vllm", ("embed", "rerank"), {"/v1/embeddings", "/v1/rerank", "/v1/score"} | TOKENS),
        ("sglang", ("generate",), GENERATE | TOKENS),
        # SGLang's /v1/score is another API (label-token probabilities), not vLLM's.
        ("sglang", ("rerank",), {"/v1/rerank"} | TOKENS),
        ("llamacpp", ("generate",), GENERATE | TOKENS),
        ("llamacpp", ("embed",), {"/v1/embeddings"} | TOKENS),
        ("llamacpp", ("rerank",), {"/v1/rerank"} | TOKENS),
        ("tgi", ("generate",), set()),
        ("vllm", (), set()),
    ],
)
def test_served_paths(engine: str, tasks: tuple[str, ...], paths: set[str]) -> None:
    assert served_paths(engine, tasks) == frozenset(paths)


def test_a_path_the_profiles_task_lacks_names_the_task_that_serves_it() -> None:
    assert endpoint_refusal("bge", "/v1/rerank", "vllm", ["embed"]) == (
        "model 'bge' does not serve /v1/rerank (it serves /v1/embeddings, /tokenize, "
        "/detokenize); deploy a profile with task: [rerank] (llmgw ctl deploy bge --profile "
        "NAME), or add rerank to the task of the profile it runs"
    )


def test_a_task_the_engine_cannot_add_says_to_deploy_another_model() -> None:
    assert endpoint_refusal("llama", "/v1/embeddings", "vllm", ["generate"]) == (
        "model 'llama' does not serve /v1/embeddings (it serves /v1/chat/completions, "
        "/v1/completions, /v1/responses, /tokenize, /detokenize); one vllm replica cannot do "
        "embed beside generate: deploy the weights again as another model whose profile has "
        "task: [embed] (e.g. llama-embed)"
    )


def test_a_path_the_engine_lacks_names_the_engines_that_have_it() -> None:
    assert endpoint_refusal("rr", "/v1/score", "sglang", ["rerank"]) == (
        "model 'rr' does not serve /v1/score (it serves /v1/rerank, /tokenize, /detokenize): "
        "engine sglang has no /v1/score; it answers /v1/rerank for rerank; deploy the model "
        "with an engine that has it (sim, vllm)"
    )


def test_an_unknown_path_or_engine() -> None:
    assert endpoint_refusal("m", "/v1/audio", "sim", TASKS).startswith(
        "/v1/audio is not an endpoint llmgw routes to a model; it routes /v1/chat/completions, "
    )
    assert endpoint_refusal("m", "/tokenize", "tgi", ["generate"]) == (
        "model 'm' does not serve /tokenize (it serves none of the model endpoints): its "
        "engine 'tgi' is not one this llmgw knows; deploy the model with one of sim, vllm, "
        "sglang, llamacpp"
    )
