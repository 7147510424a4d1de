"""What a request costs its key: the estimate charged when it is admitted, the tokens its
answer reports (or its stream's chunks count), and what is settled when it ends.

A request is charged an :class:`Estimate` up front
(:meth:`llmgw.server.gateway.limits.KeyLimits.admit` debits it from the key's token bucket and holds it against the key's budget while the
request is in flight): its prompt's tokens, counted by the model's tokenizer where the
gateway has one (:mod:`llmgw.server.gateway.tokenizing`; for a key whose limits read the estimate,
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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_OUTPUT_RESERVE",
    "Estimate",
    "Outcome",
    "asks_usage",
    "estimate",
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
