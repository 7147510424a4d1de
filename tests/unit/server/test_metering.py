"""What a request is charged (llmgw.server.gateway.metering): the estimate at admission, the body
that asks a stream for its usage, and what an outcome without usage settles on."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.server.gateway.metering import (
    DEFAULT_OUTPUT_RESERVE,
    Estimate,
    Outcome,
    estimate,
    with_usage,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _asked(path: str, payload: dict[str, Any], text: str | None = None) -> Any:
    body = (text if text is not None else json.dumps(payload)).encode()
    out = with_usage(path, body, payload)
    return None if out is None else json.loads(out)


def test_a_stream_asks_for_usage_keeping_the_clients_own_options() -> None:
    plain = {"model": "m", "messages": [], "stream": True}
    assert _asked(CHAT, plain) == {**plain, "stream_options": {"include_usage": True}}
    # The JSON as sent, white space after it and all: appended, not re-serialised.
    body = b'{"model" : "m",\n "stream": true}\n\t '
    out = with_usage(COMPLETIONS, body, {"model": "m", "stream": True})
    assert out == b'{"model" : "m",\n "stream": true,"stream_options":{"include_usage":true}}'
    own = {**plain, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    assert _asked(CHAT, own)["stream_options"] == {
        "include_usage": True,
        "continuous_usage_stats": True,
    }
    null = {**plain, "stream_options": None}
    out = with_usage(CHAT, json.dumps(null).encode(), null)
    assert out is not None and out.count(b'"stream_options"') == 1
    assert json.loads(out)["stream_options"] == {"include_usage": True}
    # Asked already, not a path whose streams need asking, options the engine will refuse.
    assert _asked(CHAT, {**plain, "stream_options": {"include_usage": True}}) is None
    assert _asked("/v1/responses", {"model": "m", "input": "x", "stream": True}) is None
    assert _asked(CHAT, {**plain, "stream_options": "yes"}) is None


@pytest.mark.parametrize(
    ("path", "payload", "tokens", "cap", "expected"),
    [
        (CHAT, {"max_tokens": 50}, 10, None, Estimate(10, 50)),
        (CHAT, {"max_completion_tokens": 60, "max_tokens": 50}, 10, None, Estimate(10, 60)),
        (CHAT, {"max_tokens": 50, "n": 3}, 10, None, Estimate(10, 150)),
        (CHAT, {}, 10, None, Estimate(10, DEFAULT_OUTPUT_RESERVE)),
        (CHAT, {}, 10, 32, Estimate(10, 32)),  # the model's cap, when lower
        (CHAT, {"max_tokens": True}, None, None, Estimate(25, DEFAULT_OUTPUT_RESERVE)),
        ("/v1/responses", {"max_output_tokens": 7}, 10, None, Estimate(10, 7)),
        ("/v1/embeddings", {"max_tokens": 50}, None, None, Estimate(25, 0)),
        # A batch of prompts: the tokenizer counted the first only.
        (COMPLETIONS, {"prompt": ["a", "b"], "max_tokens": 5}, 1, None, Estimate(25, 5)),
        (COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 5}, 3, None, Estimate(3, 5)),
    ],
)
def test_the_estimate(
    path: str, payload: dict[str, Any], tokens: int | None, cap: int | None, expected: Estimate
) -> None:
    assert estimate(path, payload, 100, tokens, cap) == expected


def _outcome(**fields: Any) -> Outcome:
    outcome = Outcome()
    for name, value in fields.items():
        setattr(outcome, name, value)
    return outcome


def test_what_an_outcome_is_charged() -> None:
    cost = Estimate(100, 50)
    reported = _outcome(reported=True, handed=True, engine_status=200, prompt=90, completion=7)
    assert reported.charge(cost) == 97
    never = _outcome()  # refused, or no replica took it
    assert never.charge(cost) == 0
    refused = _outcome(handed=True, engine_status=400)
    assert refused.charge(cost) == 0
    cut = _outcome(handed=True, engine_status=200, streamed=True, completion=4)
    assert cut.charge(cost) == 104 and (cut.prompt, cut.completion) == (100, 4)
    gone = _outcome(handed=True)  # the client left before the answer's head
    assert gone.charge(cost) == 100
    silent = _outcome(handed=True, engine_status=200)  # a whole answer without usage
    assert silent.charge(cost) == 150 and (silent.prompt, silent.completion) == (100, 50)
