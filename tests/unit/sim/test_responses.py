"""The sim engine's Responses API, driven by the official OpenAI client: the whole response,
its stream of typed events in order, the chat endpoint's text for the same conversation, and
refusals (previous_response_id among them)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from llmgw.sim.config import SimConfig
from llmgw.sim.generate import generate
from tests.unit.sim.running import running

MODEL = "llmgw-sim"
SEED = 7
OPENING = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running(SimConfig(port=0, seed=SEED, max_tokens=64)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def expected(prompt: str, max_tokens: int = 64) -> tuple[str, str]:
    tokens, finish = generate(SimConfig(), prompt, max_tokens=max_tokens, seed=SEED)
    return "".join(tokens), finish


def test_a_whole_response(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Tell me about the river")
    text, finish = expected("Tell me about the river")
    assert finish == "stop"
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.status, response.model) == ("completed", MODEL)
    assert response.output_text == text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert [c.type for c in message.content] == ["output_text"]
    assert isinstance(response.created_at, int | float) and response.completed_at is not None
    assert (response.error, response.incomplete_details) == (None, None)
    assert (response.tools, response.tool_choice, response.parallel_tool_calls) == (
        [],
        "auto",
        True,
    )
    usage = response.usage
    assert usage is not None
    # By the sim's tokenizer: every word of the prompt is one of its words.
    assert (usage.input_tokens, usage.output_tokens) == (5, len(text.split()))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_the_same_conversation_gets_the_chat_endpoints_text(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "the river"},
        ],
        seed=SEED,
    )
    response = client.responses.create(
        model=MODEL,
        instructions="be brief",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "the river"}]}],
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.instructions == "be brief"


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="the river", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == expected("the river", 3)[0]
    assert response.output[0].status == "incomplete"
    assert response.max_output_tokens == 3
    assert response.usage is not None and response.usage.output_tokens == 3


def test_a_stream_of_typed_events_in_order(client: openai.OpenAI) -> None:
    text, finish = expected("Tell me about the river")
    assert finish == "stop"
    events = list(
        client.responses.create(model=MODEL, input="Tell me about the river", stream=True)
    )
    kinds = [e.type for e in events]
    words = len(text.split())
    assert kinds == [
        *OPENING,
        *["response.output_text.delta"] * words,
        *CLOSING,
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == text
    message_id = events[2].item.id  # type: ignore[union-attr]
    assert {(d.item_id, d.output_index, d.content_index) for d in deltas} == {(message_id, 0, 0)}
    created, in_progress = events[0].response, events[1].response  # type: ignore[union-attr]
    assert created.status == in_progress.status == "in_progress"
    assert created.output == [] and created.usage is None
    done = events[-1].response  # type: ignore[union-attr]
    assert done.id == created.id and done.status == "completed"
    assert done.output_text == text
    assert done.usage is not None and done.usage.output_tokens == words
    assert events[-4].text == text  # type: ignore[union-attr]
    assert events[-2].item.content[0].text == text  # type: ignore[union-attr]


def test_a_stream_cut_short_ends_incomplete(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL, input="the river", max_output_tokens=2, stream=True)
    )
    assert [e.type for e in events][-4:] == [*CLOSING, "response.incomplete"]
    final = events[-1].response  # type: ignore[union-attr]
    assert final.status == "incomplete" and final.usage.output_tokens == 2


def test_streaming_is_paced_like_chat() -> None:
    with running(SimConfig(port=0, seed=SEED, ttft_ms=200, tps=20, max_tokens=5)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        start = time.monotonic()
        stamps: list[tuple[str, float]] = []
        for event in client.responses.create(model=MODEL, input="the river", stream=True):
            stamps.append((event.type, time.monotonic() - start))
        first = next(t for kind, t in stamps if kind == "response.output_text.delta")
        assert stamps[0][1] < 0.15  # response.created comes at once
        assert 0.18 <= first < 0.5  # the first token after ttft
        assert stamps[-1][1] >= 0.2 + 4 * 0.05 - 0.02  # four more tokens at 20 per second
        start = time.monotonic()
        client.responses.create(model=MODEL, input="the river")
        assert time.monotonic() - start >= 0.38  # whole: the same time as the stream


def _post(base_url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(
        base_url + "/v1/responses",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_previous_response_id_is_refused_saying_what_to_send(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="more", previous_response_id="resp_1")
    assert info.value.body == {
        "message": "the sim engine keeps no responses, so it cannot continue one; send the "
        "earlier turns in 'input' instead of 'previous_response_id'",
        "type": "invalid_request_error",
        "param": "previous_response_id",
        "code": "unsupported_parameter",
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input[0].content[0].text",
        ),
        ({"input": [{"role": "user", "content": [{"type": "video"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
        ({"input": "hi", "instructions": 3}, "instructions"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "stream": "yes"}, "stream"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": "hi", "tools": {}}, "tools"),
        ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ],
)
def test_bad_requests_are_refused_openai_style(
    base_url: str, body: dict[str, Any], param: str
) -> None:
    status, answer = _post(base_url, {"model": MODEL, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == "invalid_request_error"


def test_items_the_sim_has_no_text_for_are_taken(base_url: str) -> None:
    status, answer = _post(
        base_url,
        {
            "model": MODEL,
            "input": [
                {"type": "message", "role": "user", "content": "the river"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "42"},
                {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {}}],
            "metadata": {"k": "v"},
        },
    )
    assert status == 200
    assert answer["output"][0]["content"][0]["text"] == expected("the river\n42")[0]
    assert answer["tools"] == [{"type": "function", "name": "f", "parameters": {}}]
    assert answer["metadata"] == {"k": "v"}
