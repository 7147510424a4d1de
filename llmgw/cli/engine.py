"""``llmgw engine``: engines built into llmgw, so a node needs nothing else to run them.

``llmgw engine sim``'s options default to :class:`llmgw.sim.config.SimConfig`'s own
defaults, so that the command and the engine made without it start the same."""

from __future__ import annotations

import click

from llmgw.cli.common import Duration, ReportingGroup
from llmgw.durations import format_duration
from llmgw.sim.config import SimConfig
from llmgw.sim.server import run

__all__ = ["engine"]


@click.group(cls=ReportingGroup)
def engine() -> None:
    """Built-in inference engines."""


@engine.command()
@click.option(
    "--host",
    default=SimConfig.host,
    show_default=True,
    help="Address to bind (engines stay on loopback).",
)
@click.option(
    "--port", default=SimConfig.port, show_default=True, type=int, help="Port to bind; 0 picks one."
)
@click.option("--model", default=SimConfig.model, show_default=True, help="The served model name.")
@click.option(
    "--seed",
    default=SimConfig.seed,
    show_default=True,
    type=int,
    help="Default seed; a request's 'seed' overrides it.",
)
@click.option(
    "--ttft-ms",
    default=SimConfig.ttft_ms,
    show_default=True,
    type=float,
    help="Time to first token, milliseconds.",
)
@click.option(
    "--tps",
    default=SimConfig.tps,
    show_default=True,
    type=float,
    help="Tokens per second after the first; 0 = no delay.",
)
@click.option(
    "--max-tokens",
    default=SimConfig.max_tokens,
    type=int,
    help="The limit of a request that sets none (max_tokens, max_completion_tokens, "
    "max_output_tokens). Default: none, the rest of --max-length.",
)
@click.option(
    "--max-length",
    default=SimConfig.max_length,
    show_default=True,
    type=int,
    help="The model's context in tokens, prompt and answer (vLLM's --max-model-len): a "
    "request that does not fit is refused, one that sets no limit may be answered up to it.",
)
@click.option(
    "--embedding-dim",
    default=SimConfig.embedding_dim,
    show_default=True,
    type=int,
    help="Length of the vectors /v1/embeddings answers; a request's 'dimensions' may ask "
    "for fewer.",
)
@click.option(
    "--nodes",
    default=SimConfig.nodes,
    show_default=True,
    type=int,
    help="Shards in the replica; more than 1 needs --dist-init-addr.",
)
@click.option(
    "--rank",
    default=SimConfig.rank,
    show_default=True,
    type=int,
    help="This shard's rank: 0 serves once every worker joined, workers serve nothing.",
)
@click.option(
    "--dist-init-addr",
    default=SimConfig.dist_init_addr,
    metavar="HOST:PORT",
    help="Rank 0's rendezvous address: rank 0 binds it, workers dial it.",
)
@click.option(
    "--join-timeout",
    default=format_duration(SimConfig.join_timeout_s),
    show_default=True,
    type=Duration(),
    help="How long the replica may take to assemble (workers keep dialling rank 0 until "
    "then); 90, 30s, 5m.",
)
@click.option(
    "--heartbeat-interval",
    default=format_duration(SimConfig.heartbeat_s),
    show_default=True,
    type=Duration(),
    help="The time between rendezvous heartbeats; 500ms, 1s.",
)
@click.option(
    "--heartbeat-timeout",
    default=format_duration(SimConfig.peer_timeout_s),
    show_default=True,
    type=Duration(),
    help="The silence after which a rank counts as dead; 5s, 1m.",
)
@click.option(
    "--block-size",
    default=SimConfig.block_size,
    show_default=True,
    type=int,
    help="Tokens per KV cache block of the prefix cache (1..1024).",
)
@click.option(
    "--kv-blocks",
    default=SimConfig.kv_blocks,
    show_default=True,
    type=int,
    help="Blocks the prefix cache holds; the least recently used go first.",
)
@click.option(
    "--prefill-us-per-token",
    default=SimConfig.prefill_us_per_token,
    show_default=True,
    type=float,
    help="Prefill cost of each uncached prompt token, microseconds, on one lane served in "
    "arrival order; 0 = free.",
)
@click.option(
    "--load-seconds",
    "load_s",
    default=SimConfig.load_s,
    show_default=True,
    type=float,
    help="Seconds it takes to start serving (its port opens after them), as a real engine "
    "loads its weights; 0 = at once.",
)
@click.option(
    "--kv-events-config",
    default=SimConfig.kv_events_config,
    metavar="JSON",
    help='Publish KV cache events as vLLM does: {"enable_kv_cache_events": true, '
    '"publisher": "zmq", "endpoint": "ipc:///PATH", "topic": "..."}; an ipc:// or '
    "wildcard tcp:// endpoint is bound, another dialled, as vLLM does.",
)
@click.option(
    "--probe-path",
    "probe_path",
    multiple=True,
    metavar="PATH",
    help="A path to try to open (read a file, list a folder) at start, logging whether it "
    "could: what an engine's sandbox shows. Repeatable.",
)
@click.option(
    "--probe-required",
    is_flag=True,
    help="Exit with the error when a --probe-path cannot be opened, as an engine that needs "
    "the file would.",
)
@click.option(
    "--enable-sleep-mode",
    "sleep_mode",
    is_flag=True,
    help="Serve vLLM's sleep routes (POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping, "
    "and SGLang's /release_memory_occupation, /resume_memory_occupation).",
)
@click.option(
    "--sleep-seconds",
    default=SimConfig.sleep_s,
    show_default=True,
    type=float,
    help="What falling asleep takes.",
)
@click.option(
    "--wake-seconds",
    default=SimConfig.wake_s,
    show_default=True,
    type=float,
    help="What a wake takes (level 1: the weights copied back from host memory).",
)
@click.option(
    "--wake-seconds-level2",
    default=SimConfig.wake_level2_s,
    show_default=True,
    type=float,
    help="What reloading the weights after a level-2 wake takes (a weights load).",
)
@click.option(
    "--sleep-host-mib",
    default=SimConfig.sleep_host_mib,
    show_default=True,
    type=int,
    help="Host memory held asleep at level 1 (the weights), MiB.",
)
@click.option(
    "--kv-transfer-addr",
    default=SimConfig.kv_transfer_addr,
    metavar="HOST:PORT",
    help="Serve the KV blocks of prompts prefilled for a remote decode on this TCP address "
    "(port 0: a free one), and pull remote blocks as a decode: disaggregated prefill/decode "
    "driven by kv_transfer_params, as vLLM's NixlConnector. Without it such requests are "
    "refused.",
)
@click.option(
    "--kv-bytes-per-token",
    default=SimConfig.kv_bytes_per_token,
    show_default=True,
    type=int,
    help="Bytes of KV cache per prompt token moved by a transfer (0: none).",
)
@click.option(
    "--kv-transfer-timeout",
    default=SimConfig.kv_transfer_timeout_s,
    show_default=True,
    type=float,
    help="Seconds kept blocks wait for their pull before they are freed, and the most a "
    "pull may take before the decode recomputes the prompt.",
)
@click.option(
    "--step-model",
    default=SimConfig.step_model,
    show_default=True,
    type=click.BOOL,
    metavar="true|false",
    help="Run as a batched engine: one loop of steps, each 1/tps plus the prefill done in "
    "it, every stream a token a step (prefill stalls decoding). Needs --tps > 0.",
)
@click.option(
    "--prefill-chunk",
    default=SimConfig.prefill_chunk,
    show_default=True,
    type=int,
    help="With --step-model, the most prefill tokens a step takes (chunked prefill); 0 = "
    "whole prompts.",
)
def sim(
    host: str,
    port: int,
    model: str,
    seed: int,
    ttft_ms: float,
    tps: float,
    max_tokens: int | None,
    max_length: int,
    embedding_dim: int,
    nodes: int,
    rank: int,
    dist_init_addr: str,
    join_timeout: float,
    heartbeat_interval: float,
    heartbeat_timeout: float,
    block_size: int,
    kv_blocks: int,
    prefill_us_per_token: float,
    load_s: float,
    kv_events_config: str,
    probe_path: tuple[str, ...],
    probe_required: bool,
    sleep_mode: bool,
    sleep_seconds: float,
    wake_seconds: float,
    wake_seconds_level2: float,
    sleep_host_mib: int,
    kv_transfer_addr: str,
    kv_bytes_per_token: int,
    kv_transfer_timeout: float,
    step_model: bool,
    prefill_chunk: int,
) -> None:
    """A simulated OpenAI-compatible engine with deterministic output: chat, completions
    and responses, embeddings, rerank and score, tokenize and detokenize.

    With --nodes N (N > 1) it is one shard of a multi-node replica: rank 0 binds
    --dist-init-addr and opens --port only once ranks 1..N-1 have joined; it exits with an
    error naming the rank when a worker goes away. Workers join and serve nothing.

    The prefix cache keeps --kv-blocks blocks of --block-size tokens; answers report its hits
    as usage.prompt_tokens_details.cached_tokens, and --kv-events-config publishes its
    changes to a ZeroMQ endpoint in vLLM's KV event format.

    With --kv-transfer-addr it takes part in disaggregated prefill/decode as vLLM's
    NixlConnector does: a prefill keeps a prompt's blocks for a decode, which pulls them over
    TCP; --step-model makes prefill and decoding share one loop of steps.
    """
    cfg = SimConfig(
        host=host,
        port=port,
        model=model,
        seed=seed,
        ttft_ms=ttft_ms,
        tps=tps,
        max_tokens=max_tokens,
        max_length=max_length,
        embedding_dim=embedding_dim,
        nodes=nodes,
        rank=rank,
        dist_init_addr=dist_init_addr,
        join_timeout_s=join_timeout,
        heartbeat_s=heartbeat_interval,
        peer_timeout_s=heartbeat_timeout,
        block_size=block_size,
        kv_blocks=kv_blocks,
        prefill_us_per_token=prefill_us_per_token,
        load_s=load_s,
        kv_events_config=kv_events_config,
        probe_paths=probe_path,
        probe_required=probe_required,
        sleep_mode=sleep_mode,
        sleep_s=sleep_seconds,
        wake_s=wake_seconds,
        wake_level2_s=wake_seconds_level2,
        sleep_host_mib=sleep_host_mib,
        kv_transfer_addr=kv_transfer_addr,
        kv_bytes_per_token=kv_bytes_per_token,
        kv_transfer_timeout_s=kv_transfer_timeout,
        step_model=step_model,
        prefill_chunk=prefill_chunk,
    )
    run(cfg)
