"""What a request costs its key: the estimate charged when it is admitted, the tokens its
answer reports (or its stream's chunks count), and what is settled when it ends.

A request is charged an :class:`Estimate` up front (:meth:`llmgw.server.limits.Limits.admit`
debits it from the key's token bucket and holds it against the key's budget while the
request is in flight): its prompt's tokens, counted by the model's tokenizer where the
gateway has one (:mod:`llmgw.server.tokenizing`; for a key whose limits read the estimate,
or a model whose routing needs the tokens anyway) or the body's bytes / 4, plus what it may
generate (its ``max_tokens``, ``max_completion_tokens`` or ``max_output_tokens`` times ``n``,
else the model's cap or :data:`DEFAULT_OUTPUT_RESERVE`). It is settled on the usage the
engine reports: the gateway asks every stream for it (:func:`with_usage`), and the relay
drops that chunk again from the stream of a client that did not ask
(:func:`llmgw.http.relay.relay`). Where the engine reports nothing (a stream cut short, a
client gone mid-answer), the request is charged its prompt's estimate and the tokens counted
from its stream (:meth:`Outcome.charge`); one the engine refused (an error status) or never
received costs nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.http.errors import UpstreamProtocolError
from llmgw.http.relay import LineEnds

__all__ = [
    "DEFAULT_OUTPUT_RESERVE",
    "MAX_SSE_EVENT",
    "Estimate",
    "Outcome",
    "StreamTokenCounter",
    "asks_usage",
    "estimate",
    "usage_numbers",
    "with_usage",
]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
_GENERATING = frozenset({CHAT, COMPLETIONS, RESPONSES})
"""The paths whose answers are generated tokens (the others' cost is their input)."""
_STREAM_OPTIONS = frozenset({CHAT, COMPLETIONS})
"""The paths whose streams report usage only when ``stream_options.include_usage`` asks (a
response's stream always ends with it)."""

DEFAULT_OUTPUT_RESERVE = 1024
"""The output tokens a generating request that names no maximum is charged at admission,
unless its model's cap is lower: most answers are shorter (the reserve is given back when the
request settles), and a larger one would let a key with a small ``--tpm`` hold only one such
request at a time."""

MAX_SSE_EVENT = 1024 * 1024
"""The most bytes of an event stream the gateway holds without the blank line that ends an
event; OpenAI-style events are a few KiB. A stream past it is ended with an error event."""


@dataclass(frozen=True, slots=True)
class Estimate:
    """The tokens a request is charged at admission: its prompt's and what it may generate."""

    prompt: int
    output: int

    @property
    def total(self) -> int:
        return self.prompt + self.output


def estimate(
    path: str,
    payload: Mapping[str, Any],
    body_size: int,
    prompt_tokens: int | None,
    output_cap: int | None,
) -> Estimate:
    """What a request to ``path`` with ``payload`` (``body_size`` bytes) is charged up front.
    ``prompt_tokens``: its prompt counted by the model's tokenizer (None: none, or not a
    shape it counts); ``output_cap``: the most its model generates for one request (None:
    not known)."""
    if prompt_tokens is None or _several_prompts(path, payload):
        prompt_tokens = body_size // 4
    if path not in _GENERATING:
        return Estimate(prompt_tokens, 0)
    output = _max_output(payload)
    if output is None:
        output = DEFAULT_OUTPUT_RESERVE
        if output_cap is not None:
            output = min(output, output_cap)
    return Estimate(prompt_tokens, output * _choices(payload))


def _several_prompts(path: str, payload: Mapping[str, Any]) -> bool:
    """A completion of a batch of prompts: a tokenizer counts its first one only."""
    if path != COMPLETIONS:
        return False
    prompt = payload.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)


def _max_output(payload: Mapping[str, Any]) -> int | None:
    """The most tokens the request asks the engine to generate, when it says."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = payload.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _choices(payload: Mapping[str, Any]) -> int:
    """How many answers the request asks for (``n``; the engine bounds it)."""
    n = payload.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


# --- asking a stream for its usage -----------------------------------------------------------


def asks_usage(payload: Mapping[str, Any]) -> bool:
    """Whether the client asked for the usage chunk (``stream_options.include_usage``)."""
    options = payload.get("stream_options")
    return isinstance(options, Mapping) and options.get("include_usage") is True


def with_usage(path: str, body: bytes, payload: Mapping[str, Any]) -> bytes | None:
    """``body``, a stream request to ``path``, asking the engine for the usage chunk; None
    when it already does, or when ``path`` reports usage without being asked.

    Without ``stream_options`` (nearly every client) the member is appended to the JSON text
    as it is, never re-serialised; a client's own ``stream_options`` (or null) keep their
    other members. ``stream_options`` that are not an object are left for the engine to
    refuse."""
    if path not in _STREAM_OPTIONS or asks_usage(payload):
        return None
    if "stream_options" not in payload:
        end = len(body)
        while end and body[end - 1] in b" \t\r\n":
            end -= 1
        # A parsed JSON object with a model ends in '}' after at least one member.
        return body[: end - 1] + b',"stream_options":{"include_usage":true}}'
    options = payload["stream_options"]
    if options is None:
        options = {}  # null: as absent (re-serialised: the key is there once)
    if not isinstance(options, Mapping):
        return None
    return json.dumps(
        {**payload, "stream_options": {**options, "include_usage": True}},
        separators=(",", ":"),
    ).encode()


# --- what the answer says --------------------------------------------------------------------


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


class Outcome:
    """What one request came to: the status answered, whether an engine had it (``handed``:
    sent to a replica that did not say it left it untouched) and with which status it
    answered (``engine_status``; 0: none yet), whether its answer was a stream, and the
    tokens the engine reported (``reported``) or the stream's chunks counted."""

    __slots__ = (
        "cached",
        "completion",
        "engine_status",
        "handed",
        "prompt",
        "reported",
        "status",
        "streamed",
    )

    def __init__(self) -> None:
        self.status = 0
        self.prompt = 0
        self.completion = 0
        self.cached = 0
        self.reported = False
        self.handed = False
        self.engine_status = 0
        self.streamed = False

    def charge(self, estimate: Estimate) -> int:
        """The tokens the request is charged (prompt + completion), its prompt and completion
        filled in from ``estimate`` where the engine reported none: a request an engine had
        and did not refuse is charged its prompt's estimate and the tokens its stream
        carried (a whole answer without usage: the whole estimate); one no engine had, or
        whose engine answered with an error status, what it reported (nothing)."""
        if self.reported or not self.handed or self.engine_status >= 400:
            return self.prompt + self.completion
        self.prompt = estimate.prompt
        if self.engine_status and not self.streamed:
            self.completion = estimate.output
        return self.prompt + self.completion


NOTHING = Outcome()
"""The outcome of a request refused before it reached a replica: no tokens (never changed)."""
