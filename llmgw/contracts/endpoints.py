"""The gateway's model endpoints and what a replica needs to answer one: the task its
profile does (a catalog profile's ``task``) and an engine that has the endpoint.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` need ``generate``,
``/v1/embeddings`` ``embed``, ``/v1/rerank`` and ``/v1/score`` ``rerank``; ``/tokenize`` and
``/detokenize`` any task, on an engine that has them. Which paths each engine serves per task
is its row in :mod:`llmgw.engines.registry` (with what its documentation says). The gateway
routes a request by its body's ``model`` to replicas whose engine and profile serve the path
(:func:`served_paths`), and refuses the others in words that say the fix
(:func:`endpoint_refusal`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from llmgw.engines.registry import ENGINES, TASKS

__all__ = [
    "ALIASES",
    "ANY_TASK",
    "PATHS",
    "TASKS",
    "endpoint_refusal",
    "path_task",
    "served_paths",
]

ANY_TASK = None
"""The task of a path any replica answers whose engine has it (``/tokenize``)."""

PATHS: Mapping[str, str | None] = MappingProxyType(
    {
        "/v1/chat/completions": "generate",
        "/v1/completions": "generate",
        "/v1/responses": "generate",
        "/v1/embeddings": "embed",
        "/v1/rerank": "rerank",
        "/v1/score": "rerank",
        "/tokenize": ANY_TASK,
        "/detokenize": ANY_TASK,
    }
)
"""Every path the gateway routes by the body's ``model`` -> the task it needs (``ANY_TASK``:
none in particular), in the order refusals list them."""


ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "/rerank": "/v1/rerank",
        "/v2/rerank": "/v1/rerank",
        "/score": "/v1/score",
    }
)
"""Other paths clients call for an endpoint of :data:`PATHS` -> that endpoint. vLLM serves
rerank at ``/rerank``, ``/v1/rerank`` and ``/v2/rerank`` (Jina's and Cohere's clients) with
one handler, and score at ``/score`` and ``/v1/score``
(vllm/entrypoints/openai/api_server.py); the gateway routes each alias as its endpoint and
forwards it to the engine under the endpoint's own path, which every engine with it serves."""


def path_task(path: str) -> str | None:
    """The task ``path`` needs (None: any); KeyError for a path not in :data:`PATHS`."""
    return PATHS[path]


def served_paths(engine: str, tasks: Iterable[str]) -> frozenset[str]:
    """The paths of :data:`PATHS` a replica of ``engine`` deployed for ``tasks`` answers (the
    engine's row has them for one of its tasks). An engine this llmgw does not know serves
    none."""
    row = ENGINES.get(engine)
    if row is None:
        return frozenset()
    wanted = set(tasks)
    return frozenset(
        path
        for task in TASKS
        if task in wanted
        for path in row.endpoints.get(task, ())
        if path in PATHS and PATHS[path] in (ANY_TASK, task)
    )


def endpoint_refusal(model: str, path: str, engine: str, tasks: Iterable[str]) -> str:
    """Why ``model`` (a replica of ``engine`` deployed for ``tasks``) does not answer
    ``path``, and what to do: the paths it does serve, then the profile or the engine that
    would serve this one. For a path not in :func:`served_paths`."""
    tasks = tuple(tasks)
    served = served_paths(engine, tasks)
    listed = ", ".join(p for p in PATHS if p in served) or "none of the model endpoints"
    if path not in PATHS:
        return f"{path} is not an endpoint llmgw routes to a model; it routes {', '.join(PATHS)}"
    need = PATHS[path]
    head = f"model '{model}' does not serve {path} (it serves {listed})"
    row = ENGINES.get(engine)
    if row is None:
        return (
            f"{head}: its engine {engine!r} is not one this llmgw knows; deploy the model "
            f"with one of {', '.join(ENGINES)}"
        )
    has = [t for t in TASKS if path in row.endpoints.get(t, ())]
    if not has:
        others = [
            name for name, e in ENGINES.items() if any(path in p for p in e.endpoints.values())
        ]
        alike = [p for p in PATHS if p in served and need is not None and PATHS[p] == need]
        instead = f"; it answers {' and '.join(alike)} for {need}" if alike else ""
        return (
            f"{head}: engine {engine} has no {path}{instead}; deploy the model with an "
            f"engine that has it ({', '.join(others)})"
        )
    task = need if need is not None else has[0]
    if row.can_serve_together((*tasks, task)):
        return (
            f"{head}; deploy a profile with task: [{task}] (llmgw ctl deploy {model} "
            f"--profile NAME), or add {task} to the task of the profile it runs"
        )
    return (
        f"{head}; one {engine} replica cannot do {task} beside {', '.join(tasks)}: deploy "
        f"the weights again as another model whose profile has task: [{task}] (e.g. "
        f"{model}-{task})"
    )
