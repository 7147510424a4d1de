"""SGLang: ``python -m sglang.launch_server`` with its OpenAI-compatible server on 127.0.0.1.

The program is the Python that has SGLang installed (``engines.sglang.python``). Flags as
the SGLang documentation gives them:

- Server arguments: https://docs.sglang.ai/advanced_features/server_arguments.html
  (``--model-path``, ``--served-model-name``, ``--host``, ``--port``, ``--tp-size``).
- Multi-node: https://docs.sglang.ai/references/multi_node.html - every node runs the same
  command with ``--dist-init-addr HEAD:PORT --nnodes N --node-rank R`` and ``--tp`` the
  GPUs of all nodes together.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from llmgw.engines.disagg import sglang_flags
from llmgw.engines.spec import (
    LOOPBACK,
    EngineCommand,
    EngineSpec,
    Param,
    gpu_env,
    kv_events_flags,
    param_flags,
    weights,
)

NAME = "sglang"
PROGRAM = "python3"
HELP_ARGS = ("-m", "sglang.launch_server", "--help")
VERSION_ARGS = ("-c", "import sglang; print(sglang.__version__)")
CHECK_ENV: Mapping[str, str] = MappingProxyType({})

# llmgw parameter -> launch_server flag (server_arguments.html, "Model and tokenizer",
# "Memory and scheduling", "Quantization and data type").
PARAMS: Mapping[str, Param] = MappingProxyType(
    {
        "model_path": Param("", str, sample="/models/engine-check"),
        "context_length": Param("--context-length", int, minimum=1, sample="4096"),
        "mem_fraction_static": Param(
            "--mem-fraction-static", float, minimum=0.01, maximum=1, sample="0.85"
        ),
        "max_running_requests": Param("--max-running-requests", int, minimum=1, sample="64"),
        "dtype": Param("--dtype", str, sample="bfloat16"),
        "quantization": Param("--quantization", str, sample="fp8"),
    }
)


# Embedding models and cross-encoder rerankers both run "with --is-embedding"
# (supported_models/embedding_models, rerank_models); llmgw's rerank task is that kind. A
# decoder-only reranker (Qwen3-Reranker) runs without the flag, which this table cannot say.
TASK_FLAGS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"embed": ("--is-embedding",), "rerank": ("--is-embedding",)}
)


# --enable-memory-saver: "Allow saving memory using release_memory_occupation and
# resume_memory_occupation"; --enable-weights-cpu-backup: "Save model weights ... to CPU
# memory during release ... and resume" (server_args.py), which makes a resume a copy back
# rather than a reload: vLLM's level 1, the one llmgw runs SGLang at.
SLEEP_FLAGS: Mapping[int, tuple[str, ...]] = MappingProxyType(
    {1: ("--enable-memory-saver", "--enable-weights-cpu-backup")}
)


def prefix(binary: str) -> list[str]:
    return [binary or PROGRAM, "-m", "sglang.launch_server"]


def build(spec: EngineSpec) -> EngineCommand:
    # --model-path: a local folder or a Hugging Face repo id; without weights the llmgw
    # model name is taken as the repo id.
    argv = [*prefix(spec.binary), "--model-path", weights(spec) or spec.model]
    # --served-model-name: the name the OpenAI API answers to. Workers get --host/--port too:
    # SGLang's non-zero ranks start a health-check server on them, which must not collide
    # with the default port 30000 of another shard on the node. A prefill's bootstrap server
    # binds the same --host, loopback too, at its own port the agent relays to
    # (llmgw.engines.disagg).
    argv += ["--served-model-name", spec.model, "--host", LOOPBACK, "--port", str(spec.port)]
    # --tp-size (documented alias --tensor-parallel-size; "--tp" in the examples is an
    # argparse abbreviation, absent from --help): every GPU of the replica.
    argv += ["--tp-size", str(max(1, len(spec.gpus)) * spec.nodes)]
    if spec.multi_node:
        # --dist-init-addr: rank 0 binds it, the other ranks dial it.
        argv += ["--nnodes", str(spec.nodes), "--node-rank", str(spec.rank)]
        argv += ["--dist-init-addr", spec.dist_init_addr]
    argv += param_flags(spec, PARAMS)
    if spec.kv_events_config and not spec.worker:
        # --kv-events-config: "Config in json format for NVIDIA dynamo KV event publishing.
        # Publishing will be enabled if this flag is used." (sgl-project/sglang,
        # python/sglang/srt/server_args.py); the same KVEventsConfig JSON and ZeroMQ
        # publisher as vLLM's. --enable-cache-report: "Return number of cached tokens in
        # usage.prompt_tokens_details for each openai request." (same file), so that the
        # gateway sees what the cache-aware routing saved.
        argv += [*kv_events_flags(spec), "--enable-cache-report"]
    # A disaggregated shard's mode, transfer backend, bootstrap port and adapters, before the
    # profile's args (which may name another --disaggregation-transfer-backend: the last wins).
    role_argv, role_env = sglang_flags(spec)
    argv += role_argv
    argv += spec.extra_args
    env = {**gpu_env(spec), **role_env}
    if spec.worker:
        return EngineCommand(argv=argv, env=env, serves=False, health_path="")
    return EngineCommand(argv=argv, env=env, serves=True)
