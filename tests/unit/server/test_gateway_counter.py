"""The gateway's SSE token counter, fed real ``sim`` streams split at arbitrary points."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.http.errors import UpstreamProtocolError
from llmgw.server.gateway.refusals import openai_error
from llmgw.server.gateway.usage import MAX_SSE_EVENT, StreamTokenCounter
from llmgw.sim.config import SimConfig
from llmgw.sim.server import serve

MODEL = "sim-counter"


async def _fetch_streams() -> dict[str, tuple[bytes, Any]]:
    """Raw SSE bodies from a real sim engine, each with what it should count."""
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    server = asyncio.create_task(
        serve(SimConfig(host="127.0.0.1", port=0, model=MODEL, seed=11), on_bound=bound.set_result)
    )
    try:
        port = await asyncio.wait_for(bound, 10)
        base = f"http://127.0.0.1:{port}/v1"
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
        completion = {"model": MODEL, "prompt": "count me too", "max_tokens": 40}
        out: dict[str, tuple[bytes, Any]] = {}
        async with aiohttp.ClientSession() as session:

            async def get(path: str, body: dict[str, Any]) -> bytes:
                async with session.post(base + path, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.read()

            async def tokens(path: str, body: dict[str, Any]) -> int:
                whole = json.loads(await get(path, body))
                return int(whole["usage"]["completion_tokens"])

            out["chat"] = (
                await get("/chat/completions", {**chat, "stream": True}),
                await tokens("/chat/completions", chat),
            )
            out["chat_n3"] = (
                await get("/chat/completions", {**chat, "n": 3, "stream": True}),
                await tokens("/chat/completions", {**chat, "n": 3}),
            )
            out["completion"] = (
                await get("/completions", {**completion, "stream": True}),
                await tokens("/completions", completion),
            )
            usage_body = {**chat, "stream": True, "stream_options": {"include_usage": True}}
            out["chat_usage"] = (
                await get("/chat/completions", usage_body),
                json.loads(await get("/chat/completions", chat))["usage"],
            )
        return out
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


@pytest.fixture(scope="module")
def streams() -> dict[str, tuple[bytes, Any]]:
    return asyncio.run(_fetch_streams())


def count(pieces: list[bytes]) -> StreamTokenCounter:
    counter = StreamTokenCounter()
    for piece in pieces:
        counter.feed(piece)
    return counter


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@pytest.mark.parametrize("name", ["chat", "chat_n3", "completion"])
def test_whole_stream_counts_content_events(
    streams: dict[str, tuple[bytes, Any]], name: str
) -> None:
    data, expected = streams[name]
    assert data.endswith(b"data: [DONE]\n\n")
    counter = count([data])
    assert counter.events == expected
    assert counter.usage is None
    assert counter.buf == b""
    assert counter.first_at is not None


def test_byte_by_byte(streams: dict[str, tuple[bytes, Any]]) -> None:
    data, expected = streams["chat"]
    counter = count([data[i : i + 1] for i in range(len(data))])
    assert counter.events == expected


def test_usage_chunk_is_preferred(streams: dict[str, tuple[bytes, Any]]) -> None:
    data, usage = streams["chat_usage"]
    counter = count([data])
    assert counter.usage == usage
    assert counter.usage["completion_tokens"] == counter.events


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(["chat", "chat_n3", "completion", "chat_usage"]),
    cuts=st.lists(st.integers(min_value=0), max_size=40),
)
def test_any_chunking_counts_the_same(
    streams: dict[str, tuple[bytes, Any]], name: str, cuts: list[int]
) -> None:
    data, _ = streams[name]
    pieces = split_at(data, cuts)
    assert b"".join(pieces) == data
    whole = count([data])
    split = count(pieces)
    assert split.events == whole.events
    assert split.usage == whole.usage
    assert split.buf == b""


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(["chat", "chat_n3", "completion", "chat_usage"]),
    ending=st.sampled_from([b"\r\n", b"\r"]),
    cuts=st.lists(st.integers(min_value=0), max_size=40),
)
def test_any_chunking_of_cr_line_ends_counts_the_same(
    streams: dict[str, tuple[bytes, Any]], name: str, ending: bytes, cuts: list[int]
) -> None:
    """CRLF and CR line ends split anywhere, a CRLF's two halves in two chunks included."""
    data, _ = streams[name]
    whole = count([data])
    other = data.replace(b"\n", ending)
    split = count(split_at(other, cuts))
    assert (split.events, split.usage, split.buf) == (whole.events, whole.usage, b"")


def _feed_all(counter: StreamTokenCounter, data: bytes, step: int = 16 * 1024) -> float:
    started = time.perf_counter()
    for at in range(0, len(data), step):
        counter.feed(data[at : at + step])
    return time.perf_counter() - started


def test_16_mib_of_lines_without_a_blank_line_is_linear_and_bounded() -> None:
    """A hostile engine's CR-ended lines that never end an event: once cost the event loop
    seconds (the buffer was copied for every chunk); now linear, and refused past the bound."""
    data = b"data: x\r" * (2 * 1024 * 1024)  # 16 MiB
    counter = StreamTokenCounter(max_event=64 * 1024 * 1024)
    # Linear: well under a second here; the old code took over 20 s. The bound is generous.
    assert _feed_all(counter, data) < 5.0
    assert counter.events == 0
    assert len(counter.buf) == len(data)  # all of it one incomplete event, LF-ended lines
    assert counter.buf.count(b"\n") == 2 * 1024 * 1024

    bounded = StreamTokenCounter()
    with pytest.raises(UpstreamProtocolError, match=f"more than {MAX_SSE_EVENT} bytes"):
        _feed_all(bounded, data)
    assert len(bounded.buf) <= MAX_SSE_EVENT


def test_16_mib_without_any_line_break_is_refused_past_the_bound() -> None:
    counter = StreamTokenCounter(max_event=4096)
    counter.feed(b"x" * 4000)
    with pytest.raises(UpstreamProtocolError, match="without ending an event"):
        counter.feed(b"x" * 200)
    # One chunk larger than the bound after a complete event is refused too.
    counter = StreamTokenCounter(max_event=4096)
    with pytest.raises(UpstreamProtocolError):
        counter.feed(_chunk({"content": "a"}) + b"y" * 5000)


def test_16_mib_of_cr_only_data_is_fast() -> None:
    counter = StreamTokenCounter()
    assert _feed_all(counter, b"\r" * (16 * 1024 * 1024)) < 5.0
    assert counter.events == 0
    assert counter.buf == b""


def test_an_event_just_under_the_bound_is_counted() -> None:
    event = _chunk({"content": "z" * 1000})
    counter = StreamTokenCounter(max_event=len(event))
    for at in range(0, len(event), 7):
        counter.feed(event[at : at + 7])
    assert counter.events == 1


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return _event(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
    )


def test_role_finish_and_done_are_not_counted() -> None:
    counter = count(
        [
            _chunk({"role": "assistant"}),
            _chunk({"role": "assistant", "content": ""}),
            _chunk({"content": "Hello"}),
            _chunk({"content": " world"}),
            _chunk({}, finish="stop"),
            _event(
                {"object": "text_completion", "choices": [{"text": "", "finish_reason": "stop"}]}
            ),
            b": keep-alive comment\n\n",
            b"event: ping\n\n",
            b"data: [DONE]\n\n",
        ]
    )
    assert counter.events == 2
    assert counter.usage is None


def test_content_with_escapes_counts_once() -> None:
    counter = count([_chunk({"content": 'a "quoted" \\ "content":"" thing\n'})])
    assert counter.events == 1


def test_null_usage_is_ignored_and_usage_chunk_kept() -> None:
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    counter = count(
        [
            _chunk({"content": "a"}, usage=None),
            _chunk({"content": "b"}, usage=None),
            _event({"id": "c", "choices": [], "usage": usage}),
            b"data: [DONE]\n\n",
        ]
    )
    assert counter.usage == usage
    assert counter.events == 2


def test_incomplete_trailing_event_is_not_counted_yet() -> None:
    counter = StreamTokenCounter()
    event = _chunk({"content": "x"})
    counter.feed(event[:-1])
    assert counter.events == 0
    counter.feed(event[-1:])
    assert counter.events == 1


def test_crlf_and_no_space_events_are_counted() -> None:
    crlf = _chunk({"content": "a"}).replace(b"\n", b"\r\n")
    nospace = _chunk({"content": "b"}).replace(b"data: ", b"data:", 1)
    assert count([crlf, nospace, b"data: [DONE]\r\n\r\n"]).events == 2


def test_openai_error_shape() -> None:
    resp = openai_error(404, "no such model", code="model_not_found", param="model")
    assert resp.status == 404
    assert resp.content_type == "application/json"
    assert resp.text is not None
    assert json.loads(resp.text) == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_openai_error_defaults_and_headers() -> None:
    resp = openai_error(503, "not ready", type_="server_error", headers={"Retry-After": "5"})
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "5"
    assert resp.text is not None
    body = json.loads(resp.text)
    assert body == {
        "error": {"message": "not ready", "type": "server_error", "param": None, "code": None}
    }
