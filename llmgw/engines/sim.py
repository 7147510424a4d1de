"""sim: the built-in engine is this llmgw, ``llmgw engine sim`` (the server itself is
:mod:`llmgw.sim.server`). Its multi-node form takes the same rendezvous as the real
engines (``--nodes --rank --dist-init-addr``, :mod:`llmgw.sim.rendezvous`)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from llmgw.engines.launch import self_argv
from llmgw.engines.spec import (
    LOOPBACK,
    EngineCommand,
    EngineSpec,
    Param,
    gpu_env,
    kv_events_flags,
)

NAME = "sim"
# The sim's limits live here, with its parameters, and llmgw.sim.config reads them: the sim
# is an engine, so llmgw.sim imports engines/ (and the KV events format), never the reverse.
MAX_EMBEDDING_DIM = 16384
"""The longest embedding a sim engine makes (the largest real models' are 4096-8192)."""
MAX_BLOCK_SIZE = 1024
"""The largest KV cache block a sim engine takes (llmgw keys blocks of up to as many)."""
PROGRAM = ""  # this llmgw (launch.self_argv)
HELP_ARGS = ("engine", "sim", "--help")
VERSION_ARGS = ("--version",)
CHECK_ENV: Mapping[str, str] = MappingProxyType({})

PARAMS: Mapping[str, Param] = MappingProxyType(
    {
        "seed": Param("--seed", int, minimum=-(2**63), sample="7"),
        "ttft_ms": Param("--ttft-ms", float, minimum=0, sample="10"),
        "tps": Param("--tps", float, minimum=0, sample="100"),
        "max_tokens": Param("--max-tokens", int, minimum=1, sample="16"),
        "max_length": Param("--max-length", int, minimum=2, sample="8192"),
        "embedding_dim": Param(
            "--embedding-dim", int, minimum=1, maximum=MAX_EMBEDDING_DIM, sample="384"
        ),
        # The prefix cache and the prefill cost (llmgw.sim.kvcache); --kv-events-config is
        # the agent's to add, as for vLLM, not a profile's.
        "block_size": Param("--block-size", int, minimum=1, maximum=MAX_BLOCK_SIZE, sample="16"),
        "kv_blocks": Param("--kv-blocks", int, minimum=1, sample="8192"),
        "prefill_us_per_token": Param("--prefill-us-per-token", float, minimum=0, sample="50"),
        # Its start-up as a weights load would take (llmgw.sim.config: load_s).
        "load_s": Param("--load-seconds", float, minimum=0, sample="2"),
        # Sleep mode's costs (llmgw.sim.sleep): falling asleep, waking from each level (level
        # 2's is a weights load), and the host memory the weights take while asleep at 1.
        "sleep_seconds": Param("--sleep-seconds", float, minimum=0, sample="0.1"),
        "wake_seconds": Param("--wake-seconds", float, minimum=0, sample="0.5"),
        "wake_seconds_level2": Param("--wake-seconds-level2", float, minimum=0, sample="2"),
        "sleep_host_mib": Param("--sleep-host-mib", int, minimum=0, sample="1024"),
        # Disaggregated prefill/decode (llmgw.sim.handover): the KV bytes a prompt token
        # moves and how long kept blocks wait for their pull; --kv-transfer-addr is the
        # agent's to add from the shard's order, not a profile's.
        "kv_bytes_per_token": Param("--kv-bytes-per-token", int, minimum=0, sample="1024"),
        "kv_transfer_timeout": Param("--kv-transfer-timeout", float, minimum=0.001, sample="30"),
        # The step model (llmgw.sim.steps): prefill and decoding in one loop of steps.
        "step_model": Param("--step-model", str, sample="true"),
        "prefill_chunk": Param("--prefill-chunk", int, minimum=0, sample="512"),
    }
)


# sim answers every endpoint whatever the profile's task; the gateway routes by the task.
TASK_FLAGS: Mapping[str, tuple[str, ...]] = MappingProxyType({})


# As vLLM's: one flag for both levels, the level is the /sleep call's.
SLEEP_FLAGS: Mapping[int, tuple[str, ...]] = MappingProxyType(
    {1: ("--enable-sleep-mode",), 2: ("--enable-sleep-mode",)}
)


def prefix(binary: str) -> list[str]:
    return [*([binary] if binary else self_argv()), "engine", "sim"]


def build(spec: EngineSpec) -> EngineCommand:
    argv = prefix(spec.binary)
    argv += ["--host", LOOPBACK, "--port", str(spec.port), "--model", spec.model]
    # Parameters in the order they were given, as before multi-node existed.
    for key, value in spec.params.items():
        argv += [PARAMS[key].flag, str(value)]
    if spec.multi_node:
        argv += ["--nodes", str(spec.nodes), "--rank", str(spec.rank)]
        argv += ["--dist-init-addr", spec.dist_init_addr]
    # --kv-events-config: vLLM's JSON, its events published as vLLM does (llmgw.sim).
    argv += kv_events_flags(spec)
    argv += spec.extra_args
    env = gpu_env(spec) if spec.gpus else {}
    if spec.worker:
        return EngineCommand(argv=argv, env=env, serves=False, health_path="")
    return EngineCommand(argv=argv, env=env, serves=True)
