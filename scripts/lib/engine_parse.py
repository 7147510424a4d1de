"""Feed the commands llmgw builds (engine_argv.py's JSON) to the engine's own argument parser
and configuration checks, in the engine's environment, without starting an engine; print one
line a form and exit 1 when the engine refuses any.

Run with the Python that has the engine installed (scripts/capture-engine-help.sh does):
``python engine_parse.py vllm FORMS.json``. Each form goes through two steps, each the
engine's own code, and a refusal is printed with the step's name:

1. ``parse``: what the engine's command does before it loads anything.
   vLLM: ``vllm.entrypoints.cli.main.main`` on ``vllm serve ARGS`` (argparse, then
   ``ServeSubcommand.validate``), with the serve command replaced by what
   ``ServeSubcommand.cmd`` does before it starts anything: the positional model tag, the
   headless default, ``AsyncEngineArgs.from_cli_args`` (the ``--kv-events-config`` JSON into
   ``KVEventsConfig`` among the rest).
   SGLang: ``sglang.srt.server_args.prepare_server_args`` (argparse, then ``ServerArgs``), what
   ``python -m sglang.launch_server`` calls first; then its ``KVEventsConfig.from_cli`` of
   ``--kv-events-config`` and ``NetworkAddress.parse`` of ``--dist-init-addr``, as its
   scheduler and rendezvous read them.
2. ``config``: the whole configuration as the engine resolves it at start-up, on a stand-in
   model (a config.json of a tiny Llama, so that nothing is downloaded; the weights llmgw
   names are not here). vLLM: ``create_engine_config`` (parallel layout, nnodes and
   node rank, KV events, the pooling runner). SGLang: ``ServerArgs.resolve_once``.
   What stands in for a GPU node, and only that: vLLM's CPU platform
   (``VLLM_TARGET_DEVICE=cpu``) told that Triton is there (a GPU node has it; 0.34's CPU
   platform refuses x86 without triton-cpu); SGLang's ``--device cpu``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

# A Llama small enough to need nothing but this file (no tokenizer: the engines skip it).
TINY_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


class Refused(Exception):
    """The engine refused a form at ``step``."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")


def _step(step: str, call: Callable[[], Any]) -> Any:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return call()
    except SystemExit as exc:  # argparse's error: usage and message on stderr
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise Refused(step, f"exit {exc.code}: {lines[-1] if lines else ''}") from None
    except Exception as exc:
        raise Refused(step, f"{type(exc).__name__}: {exc}") from None


def vllm_form(args: list[str], model_dir: str) -> str:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    import vllm.triton_utils
    from vllm.entrypoints.cli import main as cli
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.usage.usage_lib import UsageContext

    vllm.triton_utils.HAS_TRITON = True  # read by CpuPlatform.check_and_update_config
    seen: dict[str, Any] = {}

    def serve(parsed: Any) -> None:  # ServeSubcommand.cmd up to its first launch
        if getattr(parsed, "model_tag", None) is not None:
            parsed.model = parsed.model_tag
        if parsed.headless:
            if parsed.api_server_count is not None and parsed.api_server_count > 0:
                raise ValueError("--api-server-count cannot be used with --headless")
            parsed.api_server_count = 0
        seen["headless"] = parsed.headless
        seen["engine_args"] = vllm.AsyncEngineArgs.from_cli_args(parsed)

    ServeSubcommand.cmd = staticmethod(serve)  # type: ignore[method-assign]
    sys.argv = ["vllm", "serve", *args]
    _step("parse", cli.main)
    engine_args = seen["engine_args"]
    engine_args.model = model_dir
    engine_args.skip_tokenizer_init = True
    config = _step(
        "config",
        lambda: engine_args.create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER, headless=seen["headless"]
        ),
    )
    parallel, events = config.parallel_config, config.kv_events_config
    transfer = config.kv_transfer_config  # a disaggregated pool's connector
    return (
        f"tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size} "
        f"nnodes={parallel.nnodes} node_rank={parallel.node_rank} "
        f"master={parallel.master_addr}:{parallel.master_port} headless={seen['headless']} "
        f"runner={config.model_config.runner_type} "
        f"kv_events={events.endpoint if events and events.enable_kv_cache_events else None} "
        f"kv_transfer={f'{transfer.kv_connector}/{transfer.kv_role}' if transfer else None}"
    )


def sglang_form(args: list[str], model_dir: str) -> str:
    # Nothing fetched (vLLM is not told: offline, it resolves the model tag to a local
    # snapshot in EngineArgs, refusing the absent /models/... before the stand-in is put in).
    os.environ["HF_HUB_OFFLINE"] = "1"
    from sglang.srt.disaggregation.kv_events import KVEventsConfig
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils.network import NetworkAddress

    server_args = _step("parse", lambda: prepare_server_args(args))
    events = None
    if server_args.kv_events_config:
        events = _step("parse", lambda: KVEventsConfig.from_cli(server_args.kv_events_config))
    if server_args.dist_init_addr:
        _step("parse", lambda: NetworkAddress.parse(server_args.dist_init_addr))
    at = args.index("--model-path")
    stand_in = [*args[:at], "--model-path", model_dir, *args[at + 2 :], "--device", "cpu"]
    resolved = _step("parse", lambda: prepare_server_args(stand_in))
    _step("config", resolved.resolve_once)
    return (
        f"tp={server_args.tp_size} nnodes={server_args.nnodes} "
        f"node_rank={server_args.node_rank} dist_init_addr={server_args.dist_init_addr} "
        f"is_embedding={server_args.is_embedding} "
        f"kv_events={events.endpoint if events else None} "
        f"disaggregation={server_args.disaggregation_mode}/"
        f"{server_args.disaggregation_transfer_backend}"
    )


FORMS: dict[str, Callable[[list[str], str], str]] = {"vllm": vllm_form, "sglang": sglang_form}


def main(engine: str, path: str) -> int:
    with open(path) as f:
        forms = json.load(f)
    refused = 0
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(TINY_MODEL, f)
        for form in forms:
            try:
                got = FORMS[engine](form["args"], model_dir)
            except Refused as exc:
                refused += 1
                print(f"REFUSED {form['form']}: {exc}")
                continue
            print(f"ok      {form['form']}: {got}")
    print(f"{len(forms) - refused} of {len(forms)} forms accepted by {engine}'s own parser")
    return 1 if refused else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in FORMS:
        sys.exit("usage: engine_parse.py vllm|sglang FORMS.json")
    sys.exit(main(sys.argv[1], sys.argv[2]))
