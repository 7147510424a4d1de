"""How each engine that can sleep is put to sleep, woken and asked whether it sleeps.

Sleeping keeps an engine's process (and its port, its compiled graphs, its tokenizer) but
gives back its GPU memory; waking takes the memory again, which costs far less than a start.
What the engines offer, read from their sources:

- vLLM (``--enable-sleep-mode``; the routes exist only with ``VLLM_SERVER_DEV_MODE=1`` in the
  server's environment: vllm/entrypoints/serve/dev/api_router.py attaches them only then):
  ``POST /sleep?level=1|2`` (default 1; recent releases also take ``mode=abort|wait|keep``,
  vllm/v1/engine PauseMode, default abort: requests in flight are aborted; llmgw asks
  ``wait``), ``POST /wake_up`` (optional repeated ``tags=weights`` /
  ``tags=kv_cache`` to wake one part; none wakes all), ``GET /is_sleeping`` answering
  ``{"is_sleeping": bool}``. Level 1 offloads the weights to host memory and discards the
  KV cache (waking copies the weights back); level 2 discards both (buffers such as rope
  tables stay in host memory; docs/features/sleep_mode.md), so after ``/wake_up`` the
  weights are reloaded from disk (``POST /collective_rpc {"method": "reload_weights"}``,
  also a dev route) and the prefix cache, which indexes blocks whose content is gone, is
  reset (``POST /reset_prefix_cache``): a level-2 wake costs about a weights load.
- SGLang (``--enable-memory-saver``; weights are kept in host memory only with
  ``--enable-weights-cpu-backup``): ``POST /release_memory_occupation`` and
  ``POST /resume_memory_occupation``, each a JSON body ``{"tags": [...]}`` (``weights``,
  ``kv_cache``; absent or null: all). Without the CPU backup the weights' memory is
  released with its content, to be refilled by ``/update_weights_from_disk``; llmgw runs
  SGLang at its level 1 only (backup on).
- llama.cpp has no sleep: it scales by starting and stopping.

While asleep, vLLM's generation routes must not be called: engines before the fix of
vllm-project/vllm#15483 crash on them (CUDA illegal memory access), so the gateway never
routes to a sleeping replica; the sim answers them 503 the way vLLM's sleep-mode page says
protected endpoints do.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["LEVELS", "SleepApi", "SleepCall", "is_sleeping_call", "sleep_call", "wake_calls"]

LEVELS: tuple[int, ...] = (1, 2)
"""The sleep levels llmgw knows: 1 keeps the weights in host memory, 2 drops them."""

_EMPTY: Mapping[str, str] = MappingProxyType({})


class SleepApi(enum.StrEnum):
    """Which protocol an engine's sleep speaks."""

    VLLM = "vllm"
    SGLANG = "sglang"


@dataclass(frozen=True)
class SleepCall:
    """One HTTP call to an engine: ``method`` ``path`` with ``query`` and a JSON body
    (``body`` None: none)."""

    method: str
    path: str
    query: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    body: Mapping[str, object] | None = None


def sleep_call(api: SleepApi, level: int) -> SleepCall:
    """The call that puts an engine speaking ``api`` to sleep at ``level``."""
    if api is SleepApi.SGLANG:
        return SleepCall("POST", "/release_memory_occupation", body={"tags": None})
    # mode=wait: the requests in flight (the gateway routes no new ones) finish first, rather
    # than vLLM's default abort; a vLLM before the parameter ignores it.
    return SleepCall(
        "POST", "/sleep", query=MappingProxyType({"level": str(level), "mode": "wait"})
    )


def wake_calls(api: SleepApi, level: int) -> tuple[SleepCall, ...]:
    """The calls, in order, that wake it from ``level`` (every part: weights and KV cache)."""
    if api is SleepApi.SGLANG:
        return (SleepCall("POST", "/resume_memory_occupation", body={"tags": None}),)
    wake = SleepCall("POST", "/wake_up")
    if level < 2:
        return (wake,)
    return (
        wake,
        SleepCall("POST", "/collective_rpc", body={"method": "reload_weights"}),
        SleepCall("POST", "/reset_prefix_cache"),
    )


def is_sleeping_call(api: SleepApi) -> SleepCall | None:
    """The call that asks whether it sleeps (``{"is_sleeping": bool}``); None where the
    engine has none (SGLang's HTTP server has no such route)."""
    if api is SleepApi.SGLANG:
        return None
    return SleepCall("GET", "/is_sleeping")
