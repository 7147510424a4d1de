"""Usage accounting: what an answer reports of its tokens (:func:`usage_numbers`, counted in
a stream by :class:`StreamTokenCounter`), and each key's requests, tokens and errors per model
and UTC day, added up in memory on the request path and flushed to the store once a second.

Never a database write per request: :meth:`UsageBook.record` adds to a dict, and
:meth:`UsageBook.flush` (every ``FLUSH_EVERY`` seconds, and once more at shutdown) writes
what piled up in one transaction, as additions to the store's rows, so that every gateway
instance adds its own counts to the same rows. A process killed without its shutdown (a
SIGKILL, a power cut) loses at most the last interval's counts. A flush the store refuses
(the database is away) keeps the counts for the next.

Each flush also reads back, for the keys with a budget, what they spent in their period
across all instances (:meth:`llmgw.server.gateway.limits.KeyLimits.confirm`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

from llmgw.contracts.keypolicy import UsageRow, usage_day
from llmgw.errors import LlmgwError
from llmgw.http.errors import UpstreamProtocolError
from llmgw.http.relay import LineEnds
from llmgw.log import kv
from llmgw.server.gateway.limits import KeyLimits

__all__ = [
    "FLUSH_EVERY",
    "MAX_SSE_EVENT",
    "StreamTokenCounter",
    "UsageBook",
    "UsageStore",
    "body_usage",
    "event_usage",
    "usage_numbers",
    "with_cached",
]

log = logging.getLogger("llmgw.server.usage")

FLUSH_EVERY = 1.0
"""Seconds between flushes: what a crash may lose."""

MAX_SSE_EVENT = 1024 * 1024
"""The most bytes of an event stream the gateway holds without the blank line that ends an
event; OpenAI-style events are a few KiB. A stream past it is ended with an error event."""


_DECODER = json.JSONDecoder()

_REQUESTS, _PROMPT, _COMPLETION, _CACHED, _ERRORS = range(5)


# --- what an answer reports --------------------------------------------------------------------


class StreamTokenCounter:
    """Counts completion tokens in an SSE stream without parsing every event.

    A chunk carrying ``usage`` (``stream_options.include_usage``) is authoritative; otherwise
    each event with non-empty content or text counts as one token.

    Linear in the stream: each chunk's line ends are normalised once, only the chunk is
    searched for the end of an event, and an incomplete event is held as a list of pieces
    (joined once, when it ends). An event longer than ``max_event`` bytes raises
    :class:`~llmgw.http.errors.UpstreamProtocolError`, which ends the stream.
    """

    def __init__(self, max_event: int = MAX_SSE_EVENT) -> None:
        self.max_event = max_event
        self._pending: list[bytes] = []  # the incomplete event, line ends already LF
        self._pending_len = 0
        self._ends = LineEnds()
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.first_at: float | None = None

    @property
    def buf(self) -> bytes:
        """The incomplete event held (line ends as LF)."""
        return b"".join(self._pending)

    def feed(self, chunk: bytes) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        chunk = self._ends.lf(chunk)
        if not chunk:
            return
        pending = self._pending
        cut = chunk.rfind(b"\n\n")
        if cut >= 0:
            done = b"".join((*pending, chunk[: cut + 2])) if pending else chunk[: cut + 2]
            rest = chunk[cut + 2 :]
        elif pending and chunk[:1] == b"\n" and pending[-1][-1:] == b"\n":
            done, rest = b"".join((*pending, b"\n")), chunk[1:]  # the blank line spans two
        else:
            self._hold(chunk)
            return
        pending.clear()
        self._pending_len = 0
        # Count in C over the whole run of complete events instead of event by event.
        self.events += (
            done.count(b'"content":"')
            - done.count(b'"content":""')
            + done.count(b'"text":"')
            - done.count(b'"text":""')
        )
        if b'"usage"' in done:
            for event in done.split(b"\n\n"):
                if b'"usage"' in event:
                    usage = event_usage(event)
                    if usage is not None:
                        self.usage = usage
        if rest:
            self._hold(rest)  # after counting what came complete

    def _hold(self, piece: bytes) -> None:
        self._pending_len += len(piece)
        if self._pending_len > self.max_event:
            raise UpstreamProtocolError(
                f"the engine's event stream sent more than {self.max_event} bytes without "
                "ending an event (a blank line); the gateway ended the stream"
            )
        self._pending.append(piece)


def event_usage(event: bytes) -> dict[str, Any] | None:
    """The ``usage`` an SSE event's data carries: at its top (chat and completion chunks) or
    in its ``response`` (the Responses API's ``response.completed``)."""
    at = event.find(b"data:")
    if at < 0 or (at > 0 and event[at - 1 : at] != b"\n"):
        return None
    line = event[at + 5 :].split(b"\n", 1)[0]
    try:
        data = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    if usage is None and isinstance(data.get("response"), dict):
        usage = data["response"].get("usage")
    return usage if isinstance(usage, dict) else None


def usage_numbers(usage: Mapping[str, Any]) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens from an engine's ``usage``, whatever the endpoint:
    chat and completions (``prompt_tokens``, ``completion_tokens``,
    ``prompt_tokens_details.cached_tokens``), the Responses API (``input_tokens``,
    ``output_tokens``, ``input_tokens_details``), embeddings, rerank and score (their
    ``prompt_tokens`` or ``total_tokens``: all input)."""
    prompt = usage.get("prompt_tokens")
    if not isinstance(prompt, int):
        prompt = usage.get("input_tokens")
    completion = usage.get("completion_tokens")
    if not isinstance(completion, int):
        completion = usage.get("output_tokens")
    if not isinstance(completion, int):
        completion = 0
    if not isinstance(prompt, int):
        total = usage.get("total_tokens")
        prompt = total - completion if isinstance(total, int) else 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return max(prompt, 0), max(completion, 0), cached if isinstance(cached, int) else 0


def with_cached(cached: int, usage: dict[str, Any]) -> None:
    """``usage`` says ``cached`` of its prompt tokens were cached (at most its prompt): a
    disaggregated model's answer, whose prompt its prefill replica computed."""
    prompt, _completion, _cached = usage_numbers(usage)
    details = usage.get("prompt_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    details["cached_tokens"] = min(cached, prompt) if prompt else cached
    usage["prompt_tokens_details"] = details


def body_usage(body: bytes) -> dict[str, Any] | None:
    """The ``usage`` object of a whole (not streamed) answer, decoded alone, not the whole
    answer; None when it has none."""
    at = body.rfind(b'"usage":')
    if at < 0:
        return None
    try:
        usage, _ = _DECODER.raw_decode(body[at + 8 :].decode().lstrip())
    except (ValueError, UnicodeDecodeError):
        return None
    return usage if isinstance(usage, dict) else None


# --- what each key used ----------------------------------------------------------------------


class UsageStore(Protocol):
    def add_usage(self, rows: Iterable[UsageRow]) -> None: ...

    def tokens_since(
        self, since_day: str, key_ids: Collection[str] | None = None
    ) -> dict[str, int]: ...


class UsageBook:
    """What this instance served and has not stored yet."""

    def __init__(
        self,
        store: UsageStore,
        key_limits: KeyLimits | None = None,
        *,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.key_limits = key_limits
        self.wall = wall
        self._pending: dict[tuple[str, str, str], list[int]] = {}
        self._names: dict[str, str] = {}
        self._day = ""
        self._day_ends = 0.0
        self.flushes = 0
        self.failed_flushes = 0

    def _today(self) -> str:
        wall = self.wall()
        if wall >= self._day_ends:
            self._day = usage_day(wall)
            self._day_ends = (wall // 86400 + 1) * 86400
        return self._day

    def record(
        self,
        key_id: str,
        key_name: str,
        model: str,
        *,
        prompt: int = 0,
        completion: int = 0,
        cached: int = 0,
        error: bool = False,
    ) -> None:
        """One request of ``key_id`` to ``model`` ended (``error``: it failed, by the
        gateway's refusal, the engine's error status or a broken stream)."""
        entry = self._pending.get((day := self._today(), key_id, model))
        if entry is None:
            entry = self._pending[(day, key_id, model)] = [0, 0, 0, 0, 0]
            self._names[key_id] = key_name
        entry[_REQUESTS] += 1
        entry[_PROMPT] += prompt
        entry[_COMPLETION] += completion
        entry[_CACHED] += cached
        if error:
            entry[_ERRORS] += 1

    def pending(self) -> list[UsageRow]:
        """What is held and not stored yet (the admin API adds it to the store's rows)."""
        return [self._row(k, v) for k, v in self._pending.items()]

    def _row(self, key: tuple[str, str, str], v: list[int]) -> UsageRow:
        day, key_id, model = key
        return UsageRow(
            day,
            key_id,
            model,
            requests=v[_REQUESTS],
            prompt_tokens=v[_PROMPT],
            completion_tokens=v[_COMPLETION],
            cached_tokens=v[_CACHED],
            errors=v[_ERRORS],
            key_name=self._names.get(key_id, ""),
        )

    def flush(self) -> int:
        """Store what is held (one transaction) and refresh the budgets' totals; how many
        rows were stored. Raises the store's error, the counts kept for the next flush."""
        taken, self._pending = self._pending, {}
        rows = [self._row(k, v) for k, v in taken.items()]
        if rows:
            try:
                self.store.add_usage(rows)
            except BaseException:
                self._put_back(taken)
                raise
        self.flushes += 1
        if self.key_limits is not None:
            flushed: dict[str, int] = {}
            for (_day, key_id, _model), v in taken.items():
                flushed[key_id] = flushed.get(key_id, 0) + v[_PROMPT] + v[_COMPLETION]
            budgeted = self.key_limits.budgeted()
            totals = {
                since: self.store.tokens_since(since, [s.id for s in states])
                for since, states in budgeted.items()
            }
            self.key_limits.confirm(flushed, totals)
        return len(rows)

    def _put_back(self, taken: dict[tuple[str, str, str], list[int]]) -> None:
        for key, v in taken.items():
            entry = self._pending.get(key)
            if entry is None:
                self._pending[key] = v
            else:
                for i, n in enumerate(v):
                    entry[i] += n

    async def run(self, every: float = FLUSH_EVERY) -> None:
        """Flush every ``every`` seconds until cancelled; the caller flushes once more at
        shutdown."""
        while True:
            await asyncio.sleep(every)
            if not self._pending and (self.key_limits is None or not self.key_limits.budgeted()):
                continue
            try:
                self.flush()
            except LlmgwError as exc:
                self.failed_flushes += 1
                if self.failed_flushes == 1 or self.failed_flushes % 60 == 0:
                    log.warning(
                        "cannot store usage; kept in memory for the next flush",
                        extra=kv(error=str(exc), failed=self.failed_flushes),
                    )
            else:
                if self.failed_flushes:
                    log.info("usage stored again", extra=kv(after=self.failed_flushes))
                self.failed_flushes = 0
