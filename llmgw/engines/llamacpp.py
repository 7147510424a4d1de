"""llama.cpp: ``llama-server`` with its OpenAI-compatible server on 127.0.0.1.

Flags as the llama.cpp documentation gives them:

- ``llama-server``: https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md
  (``-m, --model FNAME``, ``-a, --alias``, ``--host``, ``--port``,
  ``-ngl, --gpu-layers, --n-gpu-layers N``, ``-c, --ctx-size``, ``-np, --parallel``,
  ``-t, --threads``, ``--rpc SERVERS``; health at ``GET /health``).
- Multi-node: https://github.com/ggml-org/llama.cpp/blob/master/tools/rpc/README.md - each
  other host runs ``rpc-server -H HOST -p PORT`` exposing its GPUs, and the main host's
  ``llama-server --rpc HOST:PORT,...`` offloads layers to them. Rank 0 dials the workers
  here, so rank 0 gets the workers' addresses in ``EngineSpec.peers`` (the control plane's
  ``StartShard.worker_addrs``) and a worker binds its own ``EngineSpec.listen_addr``
  (``StartShard.listen_addr``) on its node's fabric or management address, at a port the
  control plane picks inside the ``multinode_ports`` of the replica's nodes (not
  ``rpc-server``'s default 50052).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType

from llmgw.engines.spec import (
    LOOPBACK,
    EngineCommand,
    EngineSpec,
    Param,
    gpu_env,
    param_flags,
    rendezvous_addr,
    weights,
)
from llmgw.errors import EngineError

NAME = "llamacpp"
PROGRAM = "llama-server"
WORKER_PROGRAM = "rpc-server"
HELP_ARGS = ("--help",)
VERSION_ARGS = ("--version",)
CHECK_ENV: Mapping[str, str] = MappingProxyType({})

ALL_LAYERS = "999"
"""``--n-gpu-layers`` for "every layer": a count above any model's, which every llama.cpp
release accepts (newer ones also take ``all``)."""

# llmgw parameter -> llama-server flag. n_gpu_layers is always emitted (see build), so it
# has no flag of its own here.
PARAMS: Mapping[str, Param] = MappingProxyType(
    {
        "model_path": Param("", str, sample="/models/engine-check.gguf"),
        "n_gpu_layers": Param("", int, minimum=0, sample="99"),
        "ctx_size": Param("--ctx-size", int, minimum=0, sample="4096"),
        "parallel": Param("--parallel", int, minimum=1, sample="4"),
        "threads": Param("--threads", int, minimum=1, sample="8"),
    }
)


# llama-server --help: "--embedding, --embeddings  restrict to only support embedding use
# case"; "--rerank, --reranking  enable reranking endpoint on server".
TASK_FLAGS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"embed": ("--embedding",), "rerank": ("--reranking",)}
)


# llama-server has no sleep: it scales by start and stop only.
SLEEP_FLAGS: Mapping[int, tuple[str, ...]] = MappingProxyType({})


def prefix(binary: str) -> list[str]:
    return [binary or PROGRAM]


def worker_program(binary: str) -> str:
    """``rpc-server`` beside the configured ``llama-server``, else on PATH."""
    if binary and os.sep in binary:
        return os.path.join(os.path.dirname(binary), WORKER_PROGRAM)
    return WORKER_PROGRAM


def build(spec: EngineSpec) -> EngineCommand:
    if spec.worker:
        return _worker(spec)
    if spec.multi_node:
        if len(spec.peers) != spec.nodes - 1:
            raise EngineError(
                f"rank 0 of a {spec.nodes}-node llama.cpp replica needs the "
                f"{spec.nodes - 1} workers' rpc-server addresses (host:port, the control "
                f"plane's worker_addrs), got {len(spec.peers)}"
            )
        for peer in spec.peers:
            rendezvous_addr(peer, "llama.cpp rpc-server address")
    model = weights(spec)
    if not model:
        raise EngineError(
            f"llama.cpp needs a GGUF file to serve {spec.model!r}; set the model's source "
            "(or params.model_path) to its path on the node"
        )
    argv = [*prefix(spec.binary), "--model", model]
    # --alias: the model name the API reports and answers to.
    argv += ["--alias", spec.model, "--host", LOOPBACK, "--port", str(spec.port)]
    # Every layer on the GPUs (local or, multi-node, on the rpc-servers' devices); none
    # when the shard has no GPU, rather than the default "auto" probing for one.
    layers = spec.params.get("n_gpu_layers")
    if layers is None:
        layers = ALL_LAYERS if spec.gpus or spec.multi_node else "0"
    argv += ["--n-gpu-layers", str(layers)]
    if spec.multi_node:
        argv += ["--rpc", ",".join(spec.peers)]
    argv += param_flags(spec, PARAMS)
    argv += spec.extra_args
    return EngineCommand(argv=argv, env=gpu_env(spec), serves=True)


def _worker(spec: EngineSpec) -> EngineCommand:
    # rpc-server exposes the GPUs in CUDA_VISIBLE_DEVICES on the address rank 0 dials. It
    # takes none of llama-server's parameters: the model lives on rank 0.
    addr = spec.listen_addr
    if not addr and len(spec.peers) == spec.nodes - 1:
        addr = spec.peers[spec.rank - 1]
    if not addr:
        raise EngineError(
            f"worker rank {spec.rank} of a {spec.nodes}-node llama.cpp replica needs the "
            "host:port its rpc-server binds (the control plane's listen_addr)"
        )
    host, port = rendezvous_addr(addr, "llama.cpp rpc-server address")
    argv = [worker_program(spec.binary), "--host", host, "--port", str(port)]
    return EngineCommand(argv=argv, env=gpu_env(spec), serves=False, health_path="")
