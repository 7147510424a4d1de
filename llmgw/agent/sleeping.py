"""Sleep and wake a shard's engine: the SleepShard and WakeShard orders on this node.

A ready shard whose engine can sleep (the registry's ``sleep_api``, the profile's ``sleep``
flags in its command) is put to sleep by its engine's own call (:mod:`llmgw.engines.sleep`):
``falling_asleep`` while the call runs, ``asleep`` once it answered, with the level, the
host memory the engine says it holds and how long it took. A wake reports ``waking``, then
``ready`` with the time the engine took. A sleeping shard's port is not ready
(:meth:`~llmgw.agent.shards.ShardManager.ready_port`): the data plane forwards nothing to it.
The state is in ``shards.json``, so the next agent adopts a sleeping engine as asleep
(:func:`adopted_state`, which asks the engine where it can).

An order that cannot be carried out raises :class:`ShardError`, whose message the control
plane records: an engine that cannot sleep, a level it does not sleep at, a worker (only
rank 0 serves the routes), a shard not ready (or not asleep, for a wake). A call the engine
fails leaves the shard as it was before the order, with the engine's answer in the error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import aiohttp

from llmgw.agent.shardstate import ShardState
from llmgw.engines.registry import get_engine
from llmgw.engines.sleep import SleepApi, SleepCall, is_sleeping_call, sleep_call, wake_calls
from llmgw.errors import EngineError, ShardError
from llmgw.log import kv

__all__ = ["adopted_state", "put_to_sleep", "wake"]

log = logging.getLogger("llmgw.agent.sleeping")

SLEEP_TIMEOUT = 120.0  # seconds: a level-1 sleep copies the weights to host memory


class _Spec(Protocol):
    @property
    def shard_id(self) -> str: ...
    @property
    def engine(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def worker(self) -> bool: ...


class Shard(Protocol):
    """What this reads and sets of a shard (:class:`llmgw.agent.shards.Shard`)."""

    state: ShardState
    reason: str
    sleep_level: int
    host_memory_mib: int
    transition_ms: int

    @property
    def spec(self) -> _Spec: ...
    @property
    def shard_id(self) -> str: ...
    @property
    def port(self) -> int: ...


def _api(shard: Shard, level: int | None) -> SleepApi:
    """The sleep protocol of the shard's engine; ShardError when it cannot sleep (there)."""
    spec = shard.spec
    try:
        engine = get_engine(spec.engine)
    except EngineError as exc:
        raise ShardError(exc.message) from None
    if engine.sleep_api is None:
        raise ShardError(
            f"shard {spec.shard_id}: engine {spec.engine} cannot sleep (it scales by start and "
            "stop only); stop the replica instead"
        )
    if level is not None and level not in engine.sleep_levels:
        levels = " or ".join(str(n) for n in engine.sleep_levels)
        raise ShardError(
            f"shard {spec.shard_id}: engine {spec.engine} sleeps at level {levels}, not {level}"
        )
    if spec.worker:
        raise ShardError(
            f"shard {spec.shard_id} is worker rank {spec.rank}: only rank 0's engine sleeps"
        )
    return engine.sleep_api


async def _call(
    session: aiohttp.ClientSession, shard: Shard, call: SleepCall, timeout: float
) -> dict[str, object]:
    url = f"http://127.0.0.1:{shard.port}{call.path}"
    try:
        async with session.request(
            call.method,
            url,
            params=dict(call.query),
            json=call.body,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise ShardError(
                    f"shard {shard.shard_id}: {call.method} {call.path} answered "
                    f"{resp.status}: {text[:300]}"
                )
            try:
                body = await resp.json(content_type=None) if text else None
            except ValueError:
                body = None
            return body if isinstance(body, dict) else {}
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ShardError(
            f"shard {shard.shard_id}: {call.method} {call.path} failed: {exc or type(exc).__name__}"
        ) from exc


async def _host_memory(session: aiohttp.ClientSession, shard: Shard, api: SleepApi) -> int:
    """The host memory the sleeping engine says it holds (MiB); 0 when it does not say
    (vLLM answers only ``is_sleeping``; the sim adds ``host_memory_mib``)."""
    call = is_sleeping_call(api)
    if call is None:
        return 0
    try:
        body = await _call(session, shard, call, 5.0)
    except ShardError:
        return 0
    value = body.get("host_memory_mib")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


S = TypeVar("S", bound=Shard)


async def put_to_sleep(
    shard: S,
    level: int,
    session: aiohttp.ClientSession,
    emit: Callable[[S], None],
) -> None:
    """Put ``shard`` to sleep at ``level``; a shard asleep at that level already is left as
    it is. ShardError (the shard as it was) when it cannot."""
    api = _api(shard, level)
    if shard.state == ShardState.ASLEEP and shard.sleep_level == level:
        return
    if shard.state != ShardState.READY:
        raise ShardError(
            f"shard {shard.shard_id} is {shard.state}, not ready: only a ready shard can be put "
            "to sleep"
        )
    shard.state, shard.sleep_level, shard.reason = ShardState.FALLING_ASLEEP, level, ""
    emit(shard)
    began = time.monotonic()
    try:
        await _call(session, shard, sleep_call(api, level), SLEEP_TIMEOUT)
    except ShardError:
        shard.state, shard.sleep_level = ShardState.READY, 0
        emit(shard)
        raise
    shard.transition_ms = round((time.monotonic() - began) * 1000)
    shard.host_memory_mib = await _host_memory(session, shard, api)
    shard.state = ShardState.ASLEEP
    log.info(
        "shard asleep",
        extra=kv(shard=shard.shard_id, level=level, ms=shard.transition_ms),
    )
    emit(shard)


async def wake(
    shard: S,
    session: aiohttp.ClientSession,
    emit: Callable[[S], None],
    timeout: float,
) -> None:
    """Wake ``shard``; a ready shard is left as it is. ShardError when it cannot (a shard not
    asleep; an engine whose wake failed stays asleep, its answer in the error)."""
    api = _api(shard, None)
    if shard.state == ShardState.READY:
        return
    if shard.state != ShardState.ASLEEP:
        raise ShardError(
            f"shard {shard.shard_id} is {shard.state}, not asleep: only an asleep shard can be "
            "woken"
        )
    shard.state, shard.reason = ShardState.WAKING, ""
    emit(shard)
    began = time.monotonic()
    try:
        for call in wake_calls(api, shard.sleep_level):
            await _call(session, shard, call, timeout)
    except ShardError as exc:
        shard.state, shard.reason = ShardState.ASLEEP, str(exc)
        emit(shard)
        raise
    shard.transition_ms = round((time.monotonic() - began) * 1000)
    shard.state, shard.sleep_level, shard.host_memory_mib = ShardState.READY, 0, 0
    log.info("shard awake", extra=kv(shard=shard.shard_id, ms=shard.transition_ms))
    emit(shard)


async def adopted_state(shard: Shard, recorded: str, session: aiohttp.ClientSession) -> ShardState:
    """The state of a healthy engine adopted from a previous agent: asleep when the record
    says it sleeps (or was between sleeping and awake) and the engine, asked where it can
    say, agrees; else ready."""
    was_sleeping = recorded in (ShardState.ASLEEP, ShardState.WAKING, ShardState.FALLING_ASLEEP)
    if not was_sleeping:
        return ShardState.READY  # only an order makes it sleep, and none was carried out
    try:
        api = get_engine(shard.spec.engine).sleep_api
    except EngineError:
        api = None
    if api is None or shard.spec.worker:
        return ShardState.READY
    call = is_sleeping_call(api)
    if call is None:
        return ShardState.ASLEEP
    try:
        body = await _call(session, shard, call, 5.0)
    except ShardError:
        return ShardState.ASLEEP
    if body.get("is_sleeping") is True:
        level = body.get("level")
        if isinstance(level, int) and level in (1, 2):
            shard.sleep_level = level
        shard.host_memory_mib = await _host_memory(session, shard, api)
        return ShardState.ASLEEP
    return ShardState.READY
