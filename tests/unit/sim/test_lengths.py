"""How long the sim's answers are, as a default engine gives them: an answer ends by itself
(``stop``, ``completed``) unless the request's limit cuts it; vLLM's ``min_tokens`` and
``ignore_eos`` make long answers; the model's context (``--max-length``) bounds a prompt and
its answer, refused in vLLM's words."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from llmgw.sim.config import SimConfig
from llmgw.sim.generate import draw, tokenize
from tests.unit.sim.running import running

MODEL = "llmgw-sim"
CONTEXT = 600


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running(SimConfig(port=0, seed=3, max_length=CONTEXT)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)


def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_responses_api_completes_by_default(client: openai.OpenAI) -> None:
    for text in ("Hi", "Tell me about the river", "x " * 50, "What is a valley?"):
        with client.responses.stream(model=MODEL, input=text) as stream:
            final = stream.get_final_response()
        assert final.status == "completed", (text, final.incomplete_details)
        assert final.incomplete_details is None


def test_no_limit_asked_no_answer_is_cut(client: openai.OpenAI) -> None:
    for i in range(20):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}"}]
        )
        assert reply.choices[0].finish_reason == "stop"
        assert reply.usage is not None and 8 <= reply.usage.completion_tokens <= 64


def test_ignore_eos_streams_a_512_token_answer(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "a long one"}],
            max_tokens=512,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) == 512
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 512


def test_min_tokens_holds_the_end_back_and_a_longer_answer_starts_with_the_shorter(
    client: openai.OpenAI,
) -> None:
    messages: Any = [{"role": "user", "content": "same prompt"}]
    short = client.chat.completions.create(model=MODEL, messages=messages)
    long = client.chat.completions.create(
        model=MODEL, messages=messages, extra_body={"min_tokens": 200}
    )
    assert long.choices[0].finish_reason == "stop"
    assert long.usage is not None and long.usage.completion_tokens == 200
    assert (long.choices[0].message.content or "").startswith(
        short.choices[0].message.content or ""
    )
    # The words do not depend on the limits: the same generator, drawn in the same order.
    natural, finish = draw("p", 100, 1)
    assert finish == "stop"
    assert draw("p", 100, 1, ignore_eos=True)[0][: len(natural)] == natural


def test_without_a_limit_an_answer_may_fill_the_context(client: openai.OpenAI) -> None:
    prompt = "fill the context"
    reply = client.completions.create(model=MODEL, prompt=prompt, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == CONTEXT - len(tokenize(prompt))


def test_what_does_not_fit_the_context_is_refused_in_vllms_words(base_url: str) -> None:
    url = f"{base_url}/v1/chat/completions"
    status, body = post(
        url, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 700}
    )
    assert status == 400
    message = body["error"]["message"]
    assert message.startswith(f"This model's maximum context length is {CONTEXT} tokens. However")
    assert "in the completion" in message and body["error"]["param"] == "max_tokens"
    status, body = post(
        url, {"model": MODEL, "messages": [{"role": "user", "content": "x " * 700}]}
    )
    assert status == 400 and "Please reduce the length of the messages" in body["error"]["message"]
    status, body = post(
        f"{base_url}/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 900}
    )
    assert status == 400 and body["error"]["param"] == "max_output_tokens"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": "5"}, "min_tokens"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_bad_length_settings_are_400(base_url: str, extra: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    status, answer = post(f"{base_url}/v1/chat/completions", body)
    assert status == 400 and answer["error"]["param"] == param, answer
