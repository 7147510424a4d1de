"""vLLM: ``vllm serve WEIGHTS`` with its OpenAI-compatible server on 127.0.0.1.

Flags as the vLLM documentation gives them:

- ``vllm serve`` and its options: https://docs.vllm.ai/en/latest/cli/serve.html
  (the same list as https://docs.vllm.ai/en/latest/configuration/serve_args.html).
- Multi-node without Ray ("Running vLLM with MultiProcessing"):
  https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html - the head runs
  ``--nnodes N --node-rank 0 --master-addr HEAD``, every other node the same command with
  its ``--node-rank`` and ``--headless``; tensor parallel across each node's GPUs,
  pipeline parallel across the nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from llmgw.engines.disagg import vllm_flags
from llmgw.engines.spec import (
    LOOPBACK,
    EngineCommand,
    EngineSpec,
    Param,
    gpu_env,
    kv_events_flags,
    param_flags,
    rendezvous_addr,
    weights,
)

NAME = "vllm"
PROGRAM = "vllm"
# `vllm serve --help` lists only the option groups; `--help=all` prints every flag
# (vllm/entrypoints/cli/serve.py: "Use `--help=all` to show all available flags at once").
HELP_ARGS = ("serve", "--help=all")
VERSION_ARGS = ("--version",)
# vLLM picks its platform before it parses a flag: where it finds no GPU (a build machine,
# a node whose driver is down) `vllm --version` and `vllm serve --help=all` both stop with
# "Failed to infer device type" (vllm/config/device.py, 0.33 and 0.34). Its CPU platform
# prints the same flags (the one difference: --mm-processor-device lists no "cuda").
CHECK_ENV: Mapping[str, str] = MappingProxyType({"VLLM_TARGET_DEVICE": "cpu"})

# llmgw parameter -> `vllm serve` flag (serve_args.html, groups ModelConfig, CacheConfig,
# SchedulerConfig).
PARAMS: Mapping[str, Param] = MappingProxyType(
    {
        "model_path": Param("", str, sample="/models/engine-check"),
        "max_model_len": Param("--max-model-len", int, minimum=1, sample="4096"),
        "gpu_memory_utilization": Param(
            "--gpu-memory-utilization", float, minimum=0.01, maximum=1, sample="0.9"
        ),
        "max_num_seqs": Param("--max-num-seqs", int, minimum=1, sample="64"),
        "dtype": Param("--dtype", str, sample="bfloat16"),
        "quantization": Param("--quantization", str, sample="fp8"),
    }
)


# The pooling runner (models/pooling_models: "Run a model in pooling mode via the option
# --runner pooling", vLLM 0.10.1 and later; it replaced --task embed/score). Which pooling
# tasks it serves follows from the model's architecture (an embedding model embeds, and
# scores by similarity; a *ForSequenceClassification model scores); give --convert embed
# or --convert classify in the profile's args to adapt a model of another architecture.
TASK_FLAGS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"embed": ("--runner", "pooling"), "rerank": ("--runner", "pooling")}
)


# Sleep mode (vllm/config/model.py enable_sleep_mode: "only cuda and hip platforms"); its
# HTTP routes are dev routes, served only with VLLM_SERVER_DEV_MODE=1, which build() sets
# when the flag is given. Both levels need only the flag: the level is the /sleep call's.
SLEEP_FLAG = "--enable-sleep-mode"
SLEEP_FLAGS: Mapping[int, tuple[str, ...]] = MappingProxyType({1: (SLEEP_FLAG,), 2: (SLEEP_FLAG,)})
DEV_MODE_ENV: Mapping[str, str] = MappingProxyType({"VLLM_SERVER_DEV_MODE": "1"})


def prefix(binary: str) -> list[str]:
    return [binary or PROGRAM, "serve"]


def build(spec: EngineSpec) -> EngineCommand:
    # The positional model_tag: a local directory or a Hugging Face repo id. Without one,
    # the llmgw model name is taken as the repo id (vLLM would otherwise serve its default
    # model, whatever the name says).
    argv = [*prefix(spec.binary), weights(spec) or spec.model]
    if not spec.worker:
        # --served-model-name: the name the OpenAI API answers to (default: the model tag).
        argv += ["--served-model-name", spec.model, "--host", LOOPBACK, "--port", str(spec.port)]
    # --tensor-parallel-size: GPUs per node; --pipeline-parallel-size: nodes (the split the
    # parallelism page recommends for multi-node).
    argv += ["--tensor-parallel-size", str(max(1, len(spec.gpus)))]
    if spec.multi_node:
        host, port = rendezvous_addr(spec.dist_init_addr, "dist_init_addr")
        argv += ["--pipeline-parallel-size", str(spec.nodes)]
        argv += ["--nnodes", str(spec.nodes), "--node-rank", str(spec.rank)]
        argv += ["--master-addr", host, "--master-port", str(port)]
        if spec.worker:
            # --headless: run the engine without the API server (workers serve nothing).
            argv.append("--headless")
    argv += param_flags(spec, PARAMS)
    # --kv-events-config (VllmConfig.kv_events_config, vllm/config/kv_events.py): publish the
    # prefix cache's BlockStored/BlockRemoved events over ZeroMQ; V1 caches prefixes by
    # default, so nothing else is needed.
    argv += kv_events_flags(spec)
    # A disaggregated shard: NixlConnector and its side channel (llmgw.engines.disagg), before
    # the profile's args so that a profile may still add its own --kv-transfer-config keys.
    role_argv, role_env = vllm_flags(spec)
    argv += role_argv
    argv += spec.extra_args
    env = {**gpu_env(spec), **role_env}
    if SLEEP_FLAG in spec.extra_args and not spec.worker:
        # /sleep, /wake_up and /is_sleeping exist only in dev mode. It also opens
        # /collective_rpc and the like: the engine listens on 127.0.0.1 only, and the
        # agent's data plane forwards the OpenAI paths alone.
        env = {**env, **DEV_MODE_ENV}
    if spec.worker:
        return EngineCommand(argv=argv, env=env, serves=False, health_path="")
    return EngineCommand(argv=argv, env=env, serves=True)
