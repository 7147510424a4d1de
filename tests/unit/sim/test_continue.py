"""The ``sim`` engine resumes exactly: an answer's first tokens given back (chat's
``continue_final_message``, a completions prompt ending in them) continue as the uninterrupted
answer for the seed; vLLM's refusals of the bad combinations."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from llmgw.sim.config import SimConfig
from llmgw.sim.generate import draw, own_tokens, resume, split_own
from tests.unit.sim.running import running

MODEL = "llmgw-sim"
USER: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a tale"}]


def post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running(SimConfig(port=0, seed=3)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)


def _stream(client: openai.OpenAI, **kw: Any) -> tuple[list[str], str | None, Any]:
    pieces: list[str] = []
    finish = usage = None
    for chunk in client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kw
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    return pieces, finish, usage


# ------------------------------------------------------------------ the generator


def test_resume_continues_the_draw_for_every_split() -> None:
    tokens, finish = draw("a prompt", 40, seed=9, ignore_eos=True)
    assert finish == "length" and len(tokens) == 40
    for k in (1, 2, 17, 39):
        rest = resume("a prompt", tokens[:k], 40 - k, 9, ignore_eos=True)
        assert rest == (tokens[k:], "length")


def test_resume_keeps_min_tokens_and_the_natural_end() -> None:
    tokens, finish = draw("p", 64, seed=1)
    assert finish == "stop"
    k = len(tokens) // 2
    assert resume("p", tokens[:k], 64 - k, 1) == (tokens[k:], "stop")
    longer, _ = draw("p", 64, seed=1, min_tokens=60)
    rest = resume("p", longer[:10], 54, 1, min_tokens=50)
    assert rest is not None and longer[:10] + rest[0] == longer


def test_resume_refuses_what_is_not_its_own_beginning() -> None:
    tokens, _ = draw("p", 64, seed=1)
    assert resume("p", ["Sure", " the"], 10, 1) is None or tokens[:2] == ["Sure", " the"]
    assert resume("p", tokens, 10, 1) is None  # the whole answer: nothing to continue
    assert resume("p", [], 10, 1) is None
    assert resume("other prompt", tokens[:5], 10, 1) is None
    assert own_tokens("Sure, here") is None and own_tokens("") is None
    assert own_tokens("The river") == ["The", " river"]


def test_split_own_finds_the_answer_at_the_prompts_end() -> None:
    head = "Q: name things\nA:"
    tokens, _ = draw(head, 64, seed=5)
    for k in (1, 4):
        assert split_own(head + "".join(tokens[:k]), 5) == (head, tokens[:k])
    assert split_own(head + "".join(tokens[:4]), 6) is None  # another seed's answer differs
    assert split_own(head, 5) is None
    assert split_own("", 5) is None
    assert split_own("just words the river", 5) is None  # no capitalised start


# ------------------------------------------------------------------ over HTTP


@pytest.mark.parametrize("k", [1, 5, 20])
def test_chat_continue_final_message_is_exact(client: openai.OpenAI, k: int) -> None:
    full, finish, usage = _stream(
        client, messages=USER, seed=11, max_tokens=30, extra_body={"min_tokens": 25}
    )
    assert len(full) >= 25
    partial = "".join(full[:k])
    rest, rest_finish, rest_usage = _stream(
        client,
        messages=[*USER, {"role": "assistant", "content": partial}],
        seed=11,
        max_tokens=30 - k,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "min_tokens": max(0, 25 - k),
        },
    )
    assert partial + "".join(rest) == "".join(full)
    assert rest_finish == finish
    # The resumed prompt is the original one and the k tokens given back.
    assert rest_usage.prompt_tokens == usage.prompt_tokens + k
    assert rest_usage.completion_tokens == usage.completion_tokens - k


def test_chat_continue_without_max_tokens_and_not_streamed(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=USER, seed=2)
    text = full.choices[0].message.content
    assert text is not None
    words = own_tokens(text)
    assert words is not None and len(words) > 3
    rest = client.chat.completions.create(
        model=MODEL,
        messages=[*USER, {"role": "assistant", "content": "".join(words[:3])}],
        seed=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert "".join(words[:3]) + (rest.choices[0].message.content or "") == text
    assert rest.choices[0].finish_reason == full.choices[0].finish_reason


def test_chat_continue_of_another_text_is_still_an_answer(client: openai.OpenAI) -> None:
    body = {
        "model": MODEL,
        "messages": [*USER, {"role": "assistant", "content": "Sure, here it is:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 4,
    }
    status, got = post(f"{client.base_url}chat/completions", body)
    assert status == 200
    assert got["choices"][0]["finish_reason"] == "length"
    assert len(got["choices"][0]["message"]["content"].split()) == 4


def test_completions_prompt_with_the_text_so_far_continues(client: openai.OpenAI) -> None:
    prompt = "Once upon a time:"
    full = client.completions.create(model=MODEL, prompt=prompt, seed=4, max_tokens=50)
    text = full.choices[0].text
    words = own_tokens(text)
    assert words is not None and len(words) > 6
    so_far = "".join(words[:6])
    rest = client.completions.create(model=MODEL, prompt=prompt + so_far, seed=4, max_tokens=50 - 6)
    assert so_far + rest.choices[0].text == text
    assert rest.choices[0].finish_reason == full.choices[0].finish_reason
    assert full.usage is not None and rest.usage is not None
    assert rest.usage.prompt_tokens == full.usage.prompt_tokens + 6
    assert rest.usage.completion_tokens == full.usage.completion_tokens - 6


VLLM_BOTH = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."


@pytest.mark.parametrize(
    ("extra", "messages", "message"),
    [
        (
            {"continue_final_message": True, "add_generation_prompt": True},
            [*USER, {"role": "assistant", "content": "The"}],
            VLLM_BOTH,
        ),
        ({"continue_final_message": True}, USER, "must be the assistant's; it is 'user'"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            USER,
            "must be the assistant's",
        ),
    ],
)
def test_chat_continue_refusals_are_vllms(
    base_url: str, extra: dict[str, Any], messages: Any, message: str
) -> None:
    status, got = post(
        f"{base_url}/v1/chat/completions", {"model": MODEL, "messages": messages, **extra}
    )
    assert status == 400
    assert got["error"]["type"] == "BadRequestError" and got["error"]["code"] == 400
    assert message in got["error"]["message"]


@pytest.mark.parametrize("name", ["continue_final_message", "add_generation_prompt"])
def test_chat_continue_flags_must_be_booleans(base_url: str, name: str) -> None:
    status, got = post(
        f"{base_url}/v1/chat/completions", {"model": MODEL, "messages": USER, name: "yes"}
    )
    assert status == 400 and got["error"]["param"] == name


def test_chat_continue_alone_and_generation_prompt_alone_are_taken(base_url: str) -> None:
    # add_generation_prompt left out is not "both" (vLLM reads the body as sent).
    for extra in ({"continue_final_message": True}, {"add_generation_prompt": True}):
        messages = [*USER, {"role": "assistant", "content": "The"}]
        status, _ = post(
            f"{base_url}/v1/chat/completions",
            {"model": MODEL, "messages": messages, "max_tokens": 2, **extra},
        )
        assert status == 200
