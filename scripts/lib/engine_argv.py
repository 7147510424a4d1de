"""Every command llmgw builds for vLLM or SGLang, as JSON on stdout, for engine_parse.py.

Run with the llmgw environment's Python (scripts/capture-engine-help.sh does):
``python scripts/lib/engine_argv.py vllm > forms.json``. Each form is built by llmgw's own
``build_command``: a single node plain and with every profile parameter, each task's flags,
KV events to the agent's ``ipc://`` endpoint, weights given as a repo id or as the
``model_path`` parameter, each pool of a disaggregated model (a transfer address on IPv6,
no fabric adapters), and engine-check's widest forms (rank 0 and a worker of a two-node
replica with every parameter and KV events, rank 0 with each task's flags, a single-node
shard of each pool with the fabric's adapters).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from llmgw.agent.kvevents import engine_config
from llmgw.agent.kvsockets import kv_endpoint
from llmgw.engines.check import widest_specs
from llmgw.engines.disagg import ROLES
from llmgw.engines.launch import build_command, engine_module, task_args
from llmgw.engines.spec import EngineSpec

STATE_DIR = Path("/var/lib/llmgw-agent")  # the packaged agent's state directory


def forms(engine: str) -> Iterator[tuple[str, EngineSpec]]:
    module = engine_module(engine)
    every = {key: param.sample for key, param in module.PARAMS.items() if param.flag}
    events = engine_config("llama-8b-r0-s0", kv_endpoint(STATE_DIR, "llama-8b-r0-s0"))
    one = EngineSpec(
        engine=engine, model="llama-8b", port=41000, source="/models/llama-8b", gpus=("GPU-0",)
    )
    yield "single node", one
    yield "single node, no GPU", replace(one, gpus=())
    yield "single node, weights as a repo id", replace(one, model="Qwen/Qwen3-0.6B", source="")
    yield (
        "single node, weights as model_path",
        replace(one, source="", params={"model_path": "/models/llama-8b"}),
    )
    yield "single node, every parameter", replace(one, params=every)
    for key, value in every.items():
        yield f"single node, {key}", replace(one, params={key: value})
    yield "single node, KV events", replace(one, kv_events_config=events)
    for task in module.TASK_FLAGS:
        yield f"single node, task {task}", replace(one, extra_args=tuple(task_args(engine, [task])))
    four = replace(one, gpus=("GPU-0", "GPU-1"), nodes=4, dist_init_addr="[fd00::1]:29500")
    yield "four nodes, rank 0, IPv6 rendezvous", four
    yield "four nodes, rank 3", replace(four, rank=3, port=41001)
    for role in ROLES:
        pool = replace(one, disagg_role=role, transfer_addr="[fd00::1]:29600")
        yield f"single node, {role}, IPv6 transfer address, no fabric adapters", pool
    yield from widest_specs(engine)


def main(engine: str) -> None:
    prefix = engine_module(engine).prefix("")
    out = []
    for form, spec in forms(engine):
        command = build_command(spec)
        assert command.argv[: len(prefix)] == prefix, (form, command.argv)
        out.append({"form": form, "argv": command.argv, "args": command.argv[len(prefix) :]})
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("vllm", "sglang"):
        sys.exit("usage: engine_argv.py vllm|sglang")
    main(sys.argv[1])
