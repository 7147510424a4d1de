"""The pieces of a stream's resumption: which requests may be resumed (plan), the request
the next replica gets (resumed_body), and the splice of the parts into one stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.contracts.resuming import parse_resume, profile_max_resumes, resume_value
from llmgw.server.gateway.resume import (
    ResumePlan,
    StreamBroken,
    StreamSplice,
    completion_body,
    plan,
    resumed_body,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**more: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MESSAGES, "stream": True, **more}


# ------------------------------------------------------------------ plan


def test_plan_streams_of_chat_and_completions_only() -> None:
    assert plan(CHAT, {**chat(), "stream": False}, "vllm", None) is None
    assert plan("/v1/responses", chat(), "vllm", None) is None
    got = plan(CHAT, chat(), "vllm", None)
    assert got == ResumePlan(chat=True, max_resumes=2, blocker=None)
    got = plan(COMPLETIONS, {"prompt": "p", "stream": True}, "llamacpp", 3)
    assert got == ResumePlan(chat=False, max_resumes=3, blocker=None)


@pytest.mark.parametrize(
    ("path", "payload", "engine", "most", "blocker"),
    [
        (CHAT, chat(), "vllm", 0, "off"),
        (CHAT, chat(n=2), "vllm", None, "n"),
        (COMPLETIONS, {"prompt": "p", "stream": True, "best_of": 3}, "vllm", None, "n"),
        (CHAT, chat(logprobs=True), "sglang", None, "logprobs"),
        (CHAT, chat(top_logprobs=2), "sglang", None, "logprobs"),
        (COMPLETIONS, {"prompt": "p", "stream": True, "logprobs": 1}, "vllm", None, "logprobs"),
        (CHAT, chat(), "llamacpp", None, "engine"),
        (CHAT, chat(continue_final_message=True), "vllm", None, "prompt"),
        (COMPLETIONS, {"prompt": ["a", "b"], "stream": True}, "vllm", None, "prompt"),
        (COMPLETIONS, {"prompt": [1, 2], "stream": True}, "vllm", None, "prompt"),
        (COMPLETIONS, {"prompt": "p", "stream": True, "echo": True}, "vllm", None, "prompt"),
    ],
)
def test_plan_blockers(
    path: str, payload: dict[str, Any], engine: str, most: int | None, blocker: str
) -> None:
    got = plan(path, payload, engine, most)
    assert got is not None and got.blocker == blocker


def test_plan_takes_n_1_and_logprobs_false() -> None:
    got = plan(CHAT, chat(n=1, logprobs=False), "sim", None)
    assert got is not None and got.blocker is None


# ------------------------------------------------------------------ the next request


def test_resumed_chat_body() -> None:
    body = json.dumps(
        chat(max_tokens=50, max_completion_tokens=40, min_tokens=10, seed=7, temperature=0.3)
    ).encode()
    got = json.loads(resumed_body(body, True, "The river", 2) or b"")
    assert got["messages"] == [*MESSAGES, {"role": "assistant", "content": "The river"}]
    assert got["continue_final_message"] is True and got["add_generation_prompt"] is False
    assert (got["max_tokens"], got["max_completion_tokens"], got["min_tokens"]) == (48, 38, 8)
    assert (got["seed"], got["temperature"], got["stream"]) == (7, 0.3, True)


def test_resumed_body_limits() -> None:
    body = json.dumps(chat(max_tokens=5, min_tokens=3)).encode()
    got = json.loads(resumed_body(body, True, "A b c d", 4) or b"")
    assert got["max_tokens"] == 1 and got["min_tokens"] == 0
    assert resumed_body(body, True, "A b c d e", 5) is None  # the whole limit was sent
    unlimited = json.loads(resumed_body(json.dumps(chat()).encode(), True, "A", 1) or b"")
    assert "max_tokens" not in unlimited and "max_completion_tokens" not in unlimited
    assert resumed_body(body, True, "", 0) == body  # nothing sent: the request again


def test_resumed_completions_body() -> None:
    body = json.dumps({"model": "m", "prompt": "Q: x\nA:", "max_tokens": 9, "stream": True})
    got = json.loads(resumed_body(body.encode(), False, "The river", 2) or b"")
    assert got["prompt"] == "Q: x\nA:The river" and got["max_tokens"] == 7
    assert "continue_final_message" not in got and "messages" not in got


# ------------------------------------------------------------------ the splice


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chunk(cid: str, content: str | None, *, role: bool = False, finish: str | None = None) -> bytes:
    delta: dict[str, Any] = {}
    if role:
        delta = {"role": "assistant", "content": ""}
    elif content is not None:
        delta = {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return event({"id": cid, "object": "chat.completion.chunk", "created": 5, "choices": [choice]})


def usage(cid: str, prompt: int, completion: int, cached: int = 0) -> bytes:
    return event(
        {
            "id": cid,
            "created": 5,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    )


def splice(chat: bool = True, most: int = 2) -> StreamSplice:
    return StreamSplice(ResumePlan(chat=chat, max_resumes=most))


def decoded(raw: bytes) -> list[Any]:
    return [
        e.removeprefix("data: ") if e.endswith("[DONE]") else json.loads(e.removeprefix("data: "))
        for e in raw.decode().split("\n\n")
        if e
    ]


def test_first_part_passes_as_it_came_and_is_followed() -> None:
    s = splice()
    raw = chunk("a", None, role=True) + chunk("a", "The") + chunk("a", " river")
    assert s.feed(raw) == raw
    assert (s.text, s.sent, s.id, s.created, s.finished) == ("The river", 2, "a", 5, False)
    assert s.why_not() is None


def test_a_half_event_is_held_until_it_ends() -> None:
    s = splice()
    raw = chunk("a", "The")
    assert s.feed(raw[:10]) == b""
    assert s.feed(raw[10:]) == raw
    assert s.sent == 1
    s.feed(chunk("a", " cut")[:15])  # the stream breaks here: that token was never sent
    assert s.text == "The" and s.sent == 1


def test_a_later_part_is_rewritten_into_the_first() -> None:
    s = splice()
    s.feed(chunk("a", None, role=True) + chunk("a", "The") + chunk("a", " river"))
    s.next_part()
    assert s.before == 2
    out = s.feed(
        chunk("b", None, role=True)
        + chunk("b", " runs")
        + chunk("b", None, finish="stop")
        + usage("b", 12, 2, cached=11)
        + b"data: [DONE]\n\n"
    )
    events = decoded(out)
    assert [e["id"] for e in events[:-1]] == ["a", "a", "a"]  # the role chunk dropped
    assert all(e["created"] == 5 for e in events[:-1])
    assert events[0]["choices"][0]["delta"] == {"content": " runs"}
    assert events[1]["choices"][0]["finish_reason"] == "stop"
    # 12 prompt tokens were the original 10 and the 2 sent; they are the client's completion.
    assert events[2]["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 10},
    }
    assert events[3] == "[DONE]"
    assert s.text == "The river runs" and s.done and s.finished
    s.end()  # whole: nothing raised


def test_the_replicas_error_event_and_an_end_without_done_break_it() -> None:
    s = splice()
    # The events before the error event are sent; nothing after it is.
    raw = chunk("a", "The") + b'\n\ndata: {"error": {"message": "engine gone"}}\n\n'
    assert s.feed(raw + chunk("a", " more")) == chunk("a", "The")
    assert s.feed(chunk("a", " more")) == b""
    with pytest.raises(StreamBroken) as broken:
        s.end()
    assert broken.value.cause == "error" and "engine gone" in str(broken.value)
    assert s.text == "The"
    s2 = splice()
    s2.feed(chunk("a", "The"))
    with pytest.raises(StreamBroken) as eof:
        s2.end()
    assert eof.value.cause == "eof"


def test_what_cannot_be_resumed() -> None:
    s = splice()
    tool = {"index": 0, "delta": {"tool_calls": [{"index": 0}]}, "finish_reason": None}
    s.feed(event({"id": "a", "created": 1, "choices": [tool]}))
    assert s.why_not() == "tool_calls"
    s = splice()
    s.feed(chunk("a", "The") + chunk("a", None, finish="stop"))
    assert s.why_not() == "finished"
    s = splice(most=1)
    s.feed(chunk("a", "The"))
    assert s.why_not() is None
    s.next_part()
    assert s.why_not() == "max_resumes"
    assert StreamSplice(ResumePlan(True, 2, "n")).why_not() == "n"


def test_completions_text_is_followed() -> None:
    s = splice(chat=False)
    choice = {"index": 0, "text": "The", "logprobs": None, "finish_reason": None}
    s.feed(event({"id": "c", "created": 1, "object": "text_completion", "choices": [choice]}))
    assert s.text == "The" and s.sent == 1


# ------------------------------------------------------------------ the profile's resume


def test_profile_resume() -> None:
    assert parse_resume(False) == 0 and parse_resume(True) == 2
    assert parse_resume({"max_resumes": 5}) == 5 and parse_resume({}) == 2
    for bad in ("no", {"max_resumes": -1}, {"max_resumes": 99}, {"other": 1}, 3):
        with pytest.raises(ValueError):
            parse_resume(bad)
    assert resume_value(0) is False and resume_value(3) == {"max_resumes": 3}
    assert profile_max_resumes({"resume": False}) == 0
    assert profile_max_resumes({"resume": {"max_resumes": 1}}) == 1
    assert profile_max_resumes({}) is None and profile_max_resumes(None) is None


# ------------------------------------------------------ a chat continued as a completion


def rendered(payload: Any) -> str | None:
    """A stand-in chat template: the messages' contents; None for a part other than text."""
    parts = [m["content"] for m in payload["messages"]]
    if not all(isinstance(p, str) for p in parts):
        return None
    return "".join(f"<{p}>" for p in parts) + "<assistant>"


def test_plan_of_a_chat_on_an_engine_without_continue_final_message() -> None:
    got = plan(CHAT, chat(), "llamacpp", None, rendered)
    assert got == ResumePlan(chat=True, max_resumes=2, blocker=None, render=rendered)
    # Tools: the template is not given them (the prompt would not be the engine's).
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert plan(CHAT, chat(tools=tools), "llamacpp", None, rendered).blocker == "engine"
    assert plan(CHAT, chat(n=2), "llamacpp", None, rendered).blocker == "n"
    # An engine that continues a message does so whatever the gateway holds.
    assert plan(CHAT, chat(), "vllm", None, rendered) == ResumePlan(True, 2, None)
    assert plan(COMPLETIONS, {"prompt": "p", "stream": True}, "llamacpp", None, rendered) == (
        ResumePlan(False, 2, None)
    )


def test_completion_body_continues_the_rendered_chat() -> None:
    body = json.dumps(
        chat(
            max_completion_tokens=20,
            min_tokens=5,
            seed=7,
            temperature=0.5,
            top_p=0.9,
            stop=["\n\n"],
            stream_options={"include_usage": True},
            add_generation_prompt=True,
        )
    ).encode()
    got = json.loads(completion_body(body, "The river", 2, rendered))
    assert got == {
        "model": "m",
        "prompt": "<hi><assistant>The river",
        "stream": True,
        "max_tokens": 18,
        "min_tokens": 3,
        "seed": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "stream_options": {"include_usage": True},
    }
    assert json.loads(completion_body(json.dumps(chat()).encode(), "x", 1, rendered)) == {
        "model": "m",
        "prompt": "<hi><assistant>x",
        "stream": True,
    }


def test_completion_body_refusals() -> None:
    assert completion_body(json.dumps(chat(max_tokens=3)).encode(), "abc", 3, rendered) == "limit"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    assert completion_body(json.dumps(chat(messages=image)).encode(), "a", 1, rendered) == "engine"


def completion_chunk(cid: str, text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    obj = {
        "id": cid,
        "object": "text_completion",
        "created": 9,
        "model": "gguf",
        "choices": [choice],
    }
    return event(obj)


def test_a_completion_part_reaches_the_client_as_chat_chunks() -> None:
    s = StreamSplice(ResumePlan(chat=True, max_resumes=2, render=rendered))
    first = {
        "id": "a",
        "object": "chat.completion.chunk",
        "created": 5,
        "model": "m",
        "choices": [],
    }
    s.feed(event(first) + chunk("a", "The") + chunk("a", " river"))
    body = json.dumps(chat(max_tokens=10)).encode()
    path, again = s.next_body(body)  # type: ignore[misc]
    assert path == COMPLETIONS and json.loads(again)["prompt"] == "<hi><assistant>The river"
    assert json.loads(again)["max_tokens"] == 8
    s.next_part(path)
    out = s.feed(
        completion_chunk("cmpl-b", " runs")
        + completion_chunk("cmpl-b", "", finish="length")
        + usage("cmpl-b", 12, 2)
        + b"data: [DONE]\n\n"
    )
    events = decoded(out)
    assert [(e["id"], e["created"], e["model"], e["object"]) for e in events[:2]] == [
        ("a", 5, "m", "chat.completion.chunk")
    ] * 2
    assert events[0]["choices"] == [
        {"index": 0, "delta": {"content": " runs"}, "logprobs": None, "finish_reason": None}
    ]
    assert events[1]["choices"][0]["finish_reason"] == "length"
    assert events[2]["usage"]["prompt_tokens"] == 10
    assert events[2]["usage"]["completion_tokens"] == 4
    assert s.text == "The river runs" and s.sent == 3 and s.done and s.finished


def test_next_body_before_any_token_asks_the_chat_again() -> None:
    s = StreamSplice(ResumePlan(chat=True, max_resumes=2, render=rendered))
    body = json.dumps(chat()).encode()
    assert s.next_body(body) == (CHAT, body)
    s.next_part(CHAT)
    assert not s.completions
