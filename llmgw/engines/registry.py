"""The one table of the engines llmgw can run: name -> builder module and capabilities.

Like uvicorn's protocol table, each entry names the module that builds the engine's command
by its dotted path, imported on first use (so the builders can import
:mod:`llmgw.engines.spec` without a cycle through here). Everything that needs the engine
list reads it here: the CLI's choices, the catalog's validation, the launcher, the
scheduler's rendezvous (who dials whom), engine installs, the agent's configuration and its
discovery of the engines on a node.

Adding an engine: write its builder module (see :class:`~llmgw.engines.spec.EngineModule`)
and add a row to :data:`ENGINES`; set a capability only when the builder implements it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import cast

from llmgw.engines.disagg import Handover
from llmgw.engines.sleep import SleepApi
from llmgw.engines.spec import EngineModule
from llmgw.errors import EngineError

__all__ = [
    "AVAILABLE_ENGINES",
    "ENGINES",
    "TASKS",
    "Engine",
    "disaggregating_engines",
    "engine_names",
    "get_engine",
    "installable_engines",
    "multi_node_engines",
    "sleeping_engines",
]


TASKS: tuple[str, ...] = ("generate", "embed", "rerank")
"""What a replica may be deployed to do (a catalog profile's ``task``): generate text (chat,
completions, responses), embed text (``/v1/embeddings``), or score text pairs (``/v1/rerank``,
``/v1/score``)."""

# The gateway paths each engine serves, per task, as its own server documents them. The
# gateway's table of which task a path needs is llmgw.contracts.endpoints.
_CHAT = ("/v1/chat/completions", "/v1/completions")
_TOKENS = ("/tokenize", "/detokenize")

# vLLM (docs.vllm.ai, serving/openai_compatible_server.html): /v1/responses beside chat and
# completions for generative models; /v1/embeddings for pooling models run as embedders;
# /v1/score and /v1/rerank (also /rerank, /v2/rerank) for cross-encoders, and for embedding
# models by the similarity of their embeddings ("the score API falls back to the embed task",
# models/pooling_models.html), so one pooling replica may do both; /tokenize and /detokenize
# whatever the runner.
_VLLM_ENDPOINTS = {
    "generate": (*_CHAT, "/v1/responses", *_TOKENS),
    "embed": ("/v1/embeddings", *_TOKENS),
    "rerank": ("/v1/rerank", "/v1/score", *_TOKENS),
}
# SGLang (docs.sglang.io, basic_usage/native_api and supported_models/rerank_models): the
# OpenAI chat and completions routes and /v1/responses (entrypoints/openai/serving_responses,
# written for gpt-oss); /v1/embeddings and, for cross-encoders, /v1/rerank, both with
# --is-embedding; /tokenize and /detokenize. Its /v1/score is another API (a decoder-only
# model's label-token probabilities over query + items), not vLLM's text_1/text_2 score, so
# it is not routed here.
_SGLANG_ENDPOINTS = {
    "generate": (*_CHAT, "/v1/responses", *_TOKENS),
    "embed": ("/v1/embeddings", *_TOKENS),
    "rerank": ("/v1/rerank", *_TOKENS),
}
# llama-server (ggml-org/llama.cpp tools/server/README.md): chat and completions; /v1/responses
# translated to chat (ggml-org/llama.cpp#18486, mirrored as /responses by #19873; builds
# before 2026 lack it); /v1/embeddings with --embedding; /v1/rerank (and /rerank, /reranking)
# with --reranking; /tokenize and /detokenize always.
_LLAMACPP_ENDPOINTS = {
    "generate": (*_CHAT, "/v1/responses", *_TOKENS),
    "embed": ("/v1/embeddings", *_TOKENS),
    "rerank": ("/v1/rerank", *_TOKENS),
}
# sim (llmgw.sim.server) serves every one of them, whatever the profile's task.
_SIM_ENDPOINTS = {
    "generate": (*_CHAT, "/v1/responses", *_TOKENS),
    "embed": ("/v1/embeddings", *_TOKENS),
    "rerank": ("/v1/rerank", "/v1/score", *_TOKENS),
}


@dataclass(frozen=True)
class Engine:
    """One engine llmgw can run, and what it can do.

    ``multi_node``: the builder has a form that spreads one replica over several nodes (the
    catalog refuses ``nodes`` > 1 and the launcher a multi-node spec otherwise).
    ``dials_workers``: rank 0 dials its workers (llama.cpp's ``rpc-server``): each worker
    binds an endpoint on its own node, at the replica's port, and rank 0 is started once
    they are up. False: the workers dial rank 0's ``dist_init_addr``, which rank 0 binds.
    Either way the scheduler picks the replica's one port inside the ``multinode_ports`` of
    all its nodes (:mod:`llmgw.contracts.ports`).
    ``builtin``: the engine is this llmgw (``llmgw engine sim``): nothing to install or
    configure, no weights and no GPUs needed. ``installable``: ``llmgw ctl engines install``
    can put it on a node. ``program_setting``: the agent.yaml key under ``engines.NAME``
    that names its program (None: it takes no settings).

    How the agent's discovery finds the engine when agent.yaml names no program:
    ``on_path``: it looks for the builder's ``PROGRAM`` on PATH (False for sglang, whose
    program is the Python that has SGLang: the first python3 on PATH rarely is; for sim, built
    in). Then it runs the program with each of ``probes`` in turn until one exits 0; the
    first probe's output is the version.

    ``archive_program``: for an installable engine, the path an install archive holds the
    program at, matched against the end of each member's path (``("bin", "python")``: a
    Python environment's interpreter); ``archive_holds`` says it in words for a refusal.

    What a replica serves: ``endpoints`` maps each task of :data:`TASKS` to the gateway paths
    the engine answers when it runs for that task; ``default_tasks`` is a profile's ``task``
    when it names none; ``task_sets`` are the tasks one replica may do together (any single
    task may always run alone; the builder module's ``TASK_FLAGS`` are what puts the engine
    in that mode).

    ``default_max_concurrency``: the requests the gateway sends a replica at once when the
    profile says no ``max_concurrency``, unless the profile sets the engine's own limit on
    concurrent sequences: the parameter ``slots_param`` or, in the profile's args, one of
    ``slots_flags`` (the args come after the parameters on the command line, so they win).

    ``kv_events``: the builder can make the engine publish its KV cache events in vLLM's
    format (:mod:`llmgw.engines.kvevents`), so a profile may route on them (``routing:
    kv-events``). ``tokenizer_needed``: the gateway needs the model's tokenizer to key a
    prompt's blocks (False for sim, whose tokenizer is this llmgw's own).

    ``sleep_api``: the protocol of the engine's sleep mode (:mod:`llmgw.engines.sleep`);
    None: it cannot sleep (it scales by start and stop only). ``sleep_levels``: the levels
    llmgw runs it at; the builder module's ``SLEEP_FLAGS`` are what enable each.

    ``disagg_handover``: the protocol by which the gateway hands a request from a prefill
    replica to a decode replica of this engine (:class:`~llmgw.engines.disagg.Handover`);
    None: it cannot disaggregate (a shard with a role is refused). The builder adds what a
    role needs (:mod:`llmgw.engines.disagg`).
    """

    name: str
    builder: str
    multi_node: bool
    dials_workers: bool = False
    builtin: bool = False
    installable: bool = False
    program_setting: str | None = None
    on_path: bool = False
    probes: tuple[tuple[str, ...], ...] = (("--version",), ("--help",))
    archive_program: tuple[str, ...] = ()
    archive_holds: str = ""
    endpoints: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    default_tasks: tuple[str, ...] = ("generate",)
    task_sets: tuple[frozenset[str], ...] = ()
    default_max_concurrency: int = 256
    slots_param: str | None = None
    slots_flags: tuple[str, ...] = ()
    kv_events: bool = False
    tokenizer_needed: bool = True
    sleep_api: SleepApi | None = None
    sleep_levels: tuple[int, ...] = ()
    disagg_handover: Handover | None = None

    def can_serve_together(self, tasks: Sequence[str]) -> bool:
        """Whether one replica of this engine can do every one of ``tasks`` (known tasks)."""
        wanted = frozenset(tasks)
        return len(wanted) <= 1 or any(wanted <= together for together in self.task_sets)

    def max_concurrency_for(self, params: Mapping[str, object], args: Sequence[str]) -> int:
        """The default ``max_concurrency`` of a profile with these ``params`` and ``args``:
        the engine's own limit when the profile sets it (a whole number >= 1), else
        ``default_max_concurrency``. A value the engine would refuse is left to the launch
        to refuse; here it gives the default."""
        given: object = None
        if self.slots_param is not None:
            given = params.get(self.slots_param)
        for index, arg in enumerate(args):
            flag, equals, value = arg.partition("=")
            if flag in self.slots_flags:
                if equals:
                    given = value
                elif index + 1 < len(args):
                    given = args[index + 1]
        slots = _whole_number(given)
        return slots if slots is not None and slots >= 1 else self.default_max_concurrency

    def module(self) -> EngineModule:
        """The module that builds this engine's command."""
        return cast(EngineModule, importlib.import_module(self.builder))


ENGINES: Mapping[str, Engine] = MappingProxyType(
    {
        engine.name: engine
        for engine in (
            Engine(
                "sim",
                "llmgw.engines.sim",
                multi_node=True,
                builtin=True,
                endpoints=MappingProxyType(_SIM_ENDPOINTS),
                default_tasks=TASKS,
                task_sets=(frozenset(TASKS),),
                default_max_concurrency=64,
                kv_events=True,
                tokenizer_needed=False,
                # vLLM's protocol, both levels, with configurable costs (llmgw.sim.sleep).
                sleep_api=SleepApi.VLLM,
                sleep_levels=(1, 2),
                # Its TCP pull answers vLLM's kv_transfer_params (llmgw.sim).
                disagg_handover=Handover.VLLM,
            ),
            Engine(
                "vllm",
                "llmgw.engines.vllm",
                multi_node=True,
                installable=True,
                program_setting="bin",
                on_path=True,
                archive_program=("vllm",),
                archive_holds="a file named 'vllm'",
                endpoints=MappingProxyType(_VLLM_ENDPOINTS),
                # One pooling runner embeds and scores (an embedding model's score is the
                # similarity of embeddings); generation is another runner, another process.
                task_sets=(frozenset({"embed", "rerank"}),),
                # vLLM's own default --max-num-seqs (256 on most GPUs).
                default_max_concurrency=256,
                slots_param="max_num_seqs",
                slots_flags=("--max-num-seqs",),
                kv_events=True,
                sleep_api=SleepApi.VLLM,
                sleep_levels=(1, 2),
                # NixlConnector: kv_transfer_params from the prefill to the decode.
                disagg_handover=Handover.VLLM,
            ),
            Engine(
                "sglang",
                "llmgw.engines.sglang",
                multi_node=True,
                installable=True,
                program_setting="python",
                # Importing sglang is the check: the Python may run without having it.
                probes=(("-c", "import sglang, sys; print(sglang.__version__)"),),
                archive_program=("bin", "python"),
                archive_holds="a Python environment's bin/python (with sglang installed in it)",
                # A cross-encoder reranks and cannot embed, an embedding model embeds: one task
                # per replica.
                endpoints=MappingProxyType(_SGLANG_ENDPOINTS),
                default_max_concurrency=256,
                slots_param="max_running_requests",
                slots_flags=("--max-running-requests",),
                kv_events=True,
                # Its memory saver with the weights backed up in host memory: vLLM's level 1.
                # Without the backup a resume needs the weights reloaded by another route.
                sleep_api=SleepApi.SGLANG,
                sleep_levels=(1,),
                # The prefill's bootstrap server: host, port and room to both replicas.
                disagg_handover=Handover.SGLANG,
            ),
            Engine(
                "llamacpp",
                "llmgw.engines.llamacpp",
                multi_node=True,
                dials_workers=True,
                installable=True,
                program_setting="bin",
                on_path=True,
                archive_program=("llama-server",),
                archive_holds="a file named 'llama-server'",
                # --embedding restricts the server to embeddings and --reranking pools for
                # ranking: one task per llama-server.
                endpoints=MappingProxyType(_LLAMACPP_ENDPOINTS),
                # Its slots (-np, --parallel): the builder passes params.parallel as
                # --parallel. Without one, llama-server's default -1 ("auto") gives 4 slots
                # sharing a unified KV cache (ggml-org/llama.cpp#16736, #17997; before
                # late 2025 the default was 1 slot).
                default_max_concurrency=4,
                slots_param="parallel",
                slots_flags=("--parallel", "-np"),
            ),
        )
    }
)
"""Every engine llmgw can run, ``sim`` (built in) first. The others must be on the node,
which discovery checks."""


AVAILABLE_ENGINES: tuple[str, ...] = tuple(ENGINES)
"""The names of :data:`ENGINES`, ``sim`` first: the choices the CLI offers."""


def _whole_number(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def engine_names() -> tuple[str, ...]:
    """The known engine names, ``sim`` (built in) first."""
    return AVAILABLE_ENGINES


def installable_engines() -> tuple[str, ...]:
    """The engines an install order may name, sorted."""
    return tuple(sorted(name for name, engine in ENGINES.items() if engine.installable))


def multi_node_engines() -> tuple[str, ...]:
    """The engines with a multi-node form, sorted."""
    return tuple(sorted(name for name, engine in ENGINES.items() if engine.multi_node))


def sleeping_engines() -> tuple[str, ...]:
    """The engines that can sleep, sorted."""
    return tuple(sorted(name for name, engine in ENGINES.items() if engine.sleep_levels))


def disaggregating_engines() -> tuple[str, ...]:
    """The engines that can run in prefill and decode pools, sorted."""
    return tuple(sorted(n for n, engine in ENGINES.items() if engine.disagg_handover))


def get_engine(name: str) -> Engine:
    """The engine called ``name``; EngineError names the known ones."""
    engine = ENGINES.get(name)
    if engine is None:
        raise EngineError(
            f"engine {name!r} is not one llmgw can run (it knows "
            f"{', '.join(ENGINES)}); deploy the model with one of those engines"
        )
    return engine
