"""The settings of one ``sim`` engine (:class:`SimConfig`), checked when it is made, and the
``--kv-events-config`` JSON it takes as vLLM does (:class:`KvEventsSettings`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from llmgw.engines.sim import MAX_BLOCK_SIZE, MAX_EMBEDDING_DIM
from llmgw.errors import ConfigError, EngineError
from llmgw.netaddr import parse_hostport

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_MAX_LENGTH",
    "KvEventsSettings",
    "SimConfig",
    "is_int",
    "kv_events_settings",
]

DEFAULT_MAX_LENGTH = 8192
"""The sim model's context in tokens, prompt and answer (vLLM's --max-model-len)."""
DEFAULT_HWM = 100_000
"""The publisher's high-water mark when the config gives none (vLLM's ``hwm`` default)."""

_EVENT_SCHEMES = ("tcp://", "ipc://", "inproc://")
# The keys of vLLM's KVEventsConfig (vllm/config/kv_events.py) the sim reads or may be given.
_EVENT_KEYS = frozenset(
    {
        "enable_kv_cache_events",
        "publisher",
        "endpoint",
        "topic",
        "hwm",
        "replay_endpoint",
        "buffer_steps",
        "max_queue_size",
    }
)


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    """Where a sim engine publishes its KV cache events: a ZeroMQ ``endpoint``, the
    ``topic`` of every message and the PUB socket's high-water mark ``hwm``."""

    endpoint: str
    topic: str = ""
    hwm: int = DEFAULT_HWM


@dataclass(frozen=True)
class SimConfig:
    """Settings of one ``sim`` engine; invalid values raise :class:`EngineError`.

    ``nodes`` > 1 makes it one shard of a multi-node replica: ``rank`` 0 binds
    ``dist_init_addr`` (``HOST:PORT``) and workers (``rank`` > 0) dial it, for up to
    ``join_timeout_s``; heartbeats go both ways every ``heartbeat_s`` and a peer silent for
    ``peer_timeout_s`` is gone. ``dist_init_addr`` is ignored when ``nodes`` is 1.
    ``embedding_dim``: the length of the vectors ``/v1/embeddings`` answers (a request's
    ``dimensions`` may ask for fewer). ``max_length``: the model's context in tokens (vLLM's
    ``--max-model-len``): a prompt and its answer together fit in it, and a request that
    sets no limit may be answered up to it; ``max_tokens``: the limit of a request that sets
    none (None: the context's rest), as a model's generation config sets one.

    The prefix cache (:mod:`llmgw.sim.kvcache`): ``kv_blocks`` blocks of ``block_size``
    tokens; each uncached prompt token costs ``prefill_us_per_token`` microseconds of the
    engine's one prefill lane. ``kv_events_config``: vLLM's ``--kv-events-config`` JSON
    (:func:`kv_events_settings`), "" for no KV cache events. ``probe_paths``: paths it
    tries to open at start and logs what it could (:mod:`llmgw.sim.probe`); with
    ``probe_required`` one it cannot open ends it.

    Sleep mode (:mod:`llmgw.sim.sleep`, vLLM's ``--enable-sleep-mode``): ``sleep_mode``
    serves vLLM's sleep routes (and SGLang's names); falling asleep takes ``sleep_s``, a wake
    from level 1 ``wake_s``, the weights' reload after a level-2 wake ``wake_level2_s`` (a
    weights load); asleep at level 1 it holds ``sleep_host_mib`` of host memory (the
    weights), at level 2 none.

    Disaggregated prefill/decode (:mod:`llmgw.sim.handover`, :mod:`llmgw.sim.transfer`):
    ``kv_transfer_addr`` (``HOST:PORT``, port 0 a free one; "" for none) is where it serves
    the blocks it keeps for a remote decode, ``kv_bytes_per_token`` the bytes a token's KV
    cache takes on the wire, ``kv_transfer_timeout_s`` how long kept blocks wait for their
    pull and how long a pull may take. ``step_model`` runs the engine as one loop of steps
    (:mod:`llmgw.sim.steps`; it needs ``tps`` > 0), ``prefill_chunk`` the most prefill tokens
    a step takes (0: whole prompts).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "llmgw-sim"
    seed: int = 0
    ttft_ms: float = 0.0
    tps: float = 0.0
    max_tokens: int | None = None
    max_length: int = DEFAULT_MAX_LENGTH
    embedding_dim: int = 384
    nodes: int = 1
    rank: int = 0
    dist_init_addr: str = ""
    join_timeout_s: float = 300.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 5.0
    block_size: int = 16
    kv_blocks: int = 8192
    prefill_us_per_token: float = 0.0
    # Seconds before it listens, as an engine loading its weights (the demand benchmark's
    # cold starts); 0: at once.
    load_s: float = 0.0
    kv_events_config: str = ""
    probe_paths: tuple[str, ...] = ()
    probe_required: bool = False
    sleep_mode: bool = False
    sleep_s: float = 0.0
    wake_s: float = 0.0
    wake_level2_s: float = 0.0
    sleep_host_mib: int = 0
    kv_transfer_addr: str = ""
    kv_bytes_per_token: int = 1024
    kv_transfer_timeout_s: float = 30.0
    step_model: bool = False
    prefill_chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise EngineError(f"sim: host must be a non-empty string, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise EngineError(
                f"sim: port must be an integer in 0..65535, got {self.port!r}; 0 picks a free port"
            )
        if not isinstance(self.model, str) or not self.model:
            raise EngineError(f"sim: model must be a non-empty string, got {self.model!r}")
        if not is_int(self.seed):
            raise EngineError(f"sim: seed must be an integer, got {self.seed!r}")
        self._check_delays()
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise EngineError(
                f"sim: max_tokens must be a positive integer, got {self.max_tokens!r}; leave it "
                "out for answers up to the model's length"
            )
        if not is_int(self.max_length) or self.max_length < 2:
            raise EngineError(
                f"sim: max_length must be an integer of at least 2 (the model's context in "
                f"tokens, prompt and answer), got {self.max_length!r}"
            )
        if not is_int(self.embedding_dim) or not 1 <= self.embedding_dim <= MAX_EMBEDDING_DIM:
            raise EngineError(
                f"sim: embedding_dim must be an integer in 1..{MAX_EMBEDDING_DIM}, got "
                f"{self.embedding_dim!r}"
            )
        if not is_int(self.nodes) or self.nodes < 1:
            raise EngineError(f"sim: nodes must be a positive integer, got {self.nodes!r}")
        if not is_int(self.rank) or not 0 <= self.rank < self.nodes:
            raise EngineError(
                f"sim: rank must be an integer in 0..{self.nodes - 1} for {self.nodes} node(s), "
                f"got {self.rank!r}"
            )
        self._check_rendezvous_times()
        if not is_int(self.block_size) or not 1 <= self.block_size <= MAX_BLOCK_SIZE:
            raise EngineError(
                f"sim: block_size must be an integer in 1..{MAX_BLOCK_SIZE}, got "
                f"{self.block_size!r}; vLLM's default is 16"
            )
        if not is_int(self.sleep_host_mib) or self.sleep_host_mib < 0:
            raise EngineError(
                f"sim: sleep_host_mib must be an integer >= 0 (MiB of host memory held asleep "
                f"at level 1), got {self.sleep_host_mib!r}"
            )
        if not is_int(self.kv_blocks) or self.kv_blocks < 1:
            raise EngineError(
                f"sim: kv_blocks must be a positive integer (the prefix cache's size in "
                f"blocks), got {self.kv_blocks!r}"
            )
        kv_events_settings(self.kv_events_config)
        self._check_disaggregation()
        if self.nodes > 1:
            try:
                parse_hostport(self.dist_init_addr)
            except ConfigError as exc:
                raise EngineError(
                    f"sim: a replica of {self.nodes} nodes needs dist_init_addr HOST:PORT "
                    f"(rank 0 binds it, workers dial it): {exc}"
                ) from None

    def _check_delays(self) -> None:
        """The costs it models (its answers' pace, its prefill, its load, its sleep): each a
        finite number of 0 or more."""
        for name in (
            "ttft_ms",
            "tps",
            "prefill_us_per_token",
            "load_s",
            "sleep_s",
            "wake_s",
            "wake_level2_s",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise EngineError(
                    f"sim: {name} must be a finite number >= 0, got {value!r}; 0 means no delay"
                )

    def _check_disaggregation(self) -> None:
        """The KV transfer's and the step model's settings."""
        self.kv_transfer_hostport  # noqa: B018 - raises EngineError for a bad address
        if not is_int(self.kv_bytes_per_token) or self.kv_bytes_per_token < 0:
            raise EngineError(
                f"sim: kv_bytes_per_token must be an integer >= 0 (the KV cache of one token "
                f"on the wire; 0: transfers move no bytes), got {self.kv_bytes_per_token!r}"
            )
        timeout = self.kv_transfer_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise EngineError(
                f"sim: kv_transfer_timeout must be a finite number of seconds > 0, got "
                f"{timeout!r}; vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT is the like of it"
            )
        if not isinstance(self.step_model, bool):
            raise EngineError(f"sim: step_model must be true or false, got {self.step_model!r}")
        if not is_int(self.prefill_chunk) or self.prefill_chunk < 0:
            raise EngineError(
                f"sim: prefill_chunk must be an integer >= 0 (the most prefill tokens a step "
                f"takes; 0: whole prompts), got {self.prefill_chunk!r}"
            )
        if self.step_model and not self.tps:
            raise EngineError(
                "sim: step_model needs tps > 0 (a step lasts 1/tps plus its prefill); set tps, "
                "or leave step_model off"
            )

    @property
    def kv_transfer_hostport(self) -> tuple[str, int] | None:
        """Where it serves kept KV blocks: (host, port), None without kv_transfer_addr."""
        if not isinstance(self.kv_transfer_addr, str):
            raise EngineError(
                f"sim: kv_transfer_addr must be a string HOST:PORT, got {self.kv_transfer_addr!r}"
            )
        if not self.kv_transfer_addr:
            return None
        try:
            return parse_hostport(self.kv_transfer_addr, allow_zero=True)
        except ConfigError as exc:
            raise EngineError(
                f"sim: kv_transfer_addr must be HOST:PORT (port 0: a free one), e.g. "
                f"127.0.0.1:5600: {exc.message}"
            ) from None

    def _check_rendezvous_times(self) -> None:
        """A multi-node replica's times: each above 0, a peer judged silent only after more
        than a heartbeat."""
        for name in ("join_timeout_s", "heartbeat_s", "peer_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise EngineError(f"sim: {name} must be a finite number > 0, got {value!r}")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise EngineError(
                f"sim: peer_timeout_s ({self.peer_timeout_s:g}) must exceed heartbeat_s "
                f"({self.heartbeat_s:g}), or every peer would look silent"
            )

    @property
    def kv_events(self) -> KvEventsSettings | None:
        """Where this engine publishes its KV cache events; None when it publishes none."""
        return kv_events_settings(self.kv_events_config)

    @property
    def worker(self) -> bool:
        """Whether this is a worker of a multi-node replica (it serves nothing)."""
        return self.nodes > 1 and self.rank > 0


def kv_events_settings(config: str) -> KvEventsSettings | None:
    """What ``--kv-events-config`` (vLLM's JSON: ``{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "ipc:///...", "topic": "..."}``) asks for; None when it
    is empty or disables the events. EngineError says what is wrong with it. The endpoint is
    bound or dialled as vLLM does (the agent hands its engines an ``ipc://`` one, which they
    bind)."""
    if not isinstance(config, str):
        raise EngineError(f"sim: kv_events_config must be a JSON string, got {config!r}")
    if not config.strip():
        return None
    fix = (
        'give e.g. {"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "ipc:///run/kv/kv.sock", "topic": "kv"}, or nothing for no events'
    )
    try:
        data: Any = json.loads(config)
    except (ValueError, RecursionError) as exc:
        raise EngineError(f"sim: --kv-events-config is not valid JSON ({exc}); {fix}") from None
    if not isinstance(data, dict):
        raise EngineError(f"sim: --kv-events-config must be a JSON object; {fix}")
    unknown = sorted(set(data) - _EVENT_KEYS)
    if unknown:
        raise EngineError(
            f"sim: --kv-events-config has unknown key(s) {', '.join(unknown)}; it takes "
            f"{', '.join(sorted(_EVENT_KEYS))}"
        )
    enabled = data.get("enable_kv_cache_events", False)
    if not isinstance(enabled, bool):
        raise EngineError(
            f"sim: --kv-events-config's enable_kv_cache_events must be true or false, got "
            f"{enabled!r}"
        )
    publisher = data.get("publisher", "zmq" if enabled else "null")
    if not enabled and publisher in ("null", None):
        return None
    if publisher != "zmq":
        raise EngineError(
            f'sim: --kv-events-config\'s publisher must be "zmq" (the only one the sim '
            f"engine has), got {publisher!r}"
        )
    endpoint = data.get("endpoint")
    if endpoint is None:
        raise EngineError(
            "sim: --kv-events-config has no endpoint; name where to publish, e.g. "
            '"endpoint": "ipc:///run/kv/kv.sock" or "tcp://*:5557" (binds), '
            '"tcp://127.0.0.1:5557" (connects)'
        )
    if not isinstance(endpoint, str) or not endpoint.startswith(_EVENT_SCHEMES):
        raise EngineError(
            f"sim: --kv-events-config's endpoint must be a tcp://, ipc:// or inproc:// "
            f"ZeroMQ address, got {endpoint!r}"
        )
    if len(endpoint) == len(next(s for s in _EVENT_SCHEMES if endpoint.startswith(s))):
        raise EngineError(
            f"sim: --kv-events-config's endpoint {endpoint!r} has no address after its scheme"
        )
    topic = data.get("topic", "")
    if not isinstance(topic, str):
        raise EngineError(f"sim: --kv-events-config's topic must be a string, got {topic!r}")
    hwm = data.get("hwm", DEFAULT_HWM)
    if not is_int(hwm) or hwm < 0:
        raise EngineError(
            f"sim: --kv-events-config's hwm must be an integer >= 0 (0: no limit), got {hwm!r}"
        )
    if not enabled:
        return None
    return KvEventsSettings(endpoint, topic, hwm)


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON and YAML give both)."""
    return isinstance(value, int) and not isinstance(value, bool)
