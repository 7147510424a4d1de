"""The built-in ``sim`` engine, over real sockets, driven by the official OpenAI client."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from llmgw.errors import EngineError
from llmgw.sim.config import SimConfig
from llmgw.sim.generate import generate, tokenize
from llmgw.sim.rendezvous import RendezvousError
from llmgw.sim.server import serve
from tests.unit.sim.running import running

REPO = Path(__file__).resolve().parents[3]
MODEL = "llmgw-sim"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running(SimConfig(port=0, seed=7)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)


def post(url: str, body: Any, *, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


USER: Any = [{"role": "user", "content": "Tell me a short story about a river"}]


# ------------------------------------------------------------------ multi-node


def test_serve_multi_node_in_process() -> None:
    """Rank 0 opens its HTTP port only once the worker joined; the worker binds nothing;
    cancelling rank 0 says BYE and the worker returns cleanly."""

    async def go() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dist = f"127.0.0.1:{s.getsockname()[1]}"
        timing: dict[str, Any] = {"heartbeat_s": 0.1, "peer_timeout_s": 1.0}
        ready0, ready1 = asyncio.Event(), asyncio.Event()
        ports: list[int] = []
        rank0 = asyncio.create_task(
            serve(SimConfig(port=0, nodes=2, dist_init_addr=dist, **timing), ready0, ports.append)
        )
        await asyncio.sleep(0.3)
        assert not ready0.is_set() and ports == []
        worker = asyncio.create_task(
            serve(SimConfig(nodes=2, rank=1, dist_init_addr=dist, **timing), ready1, ports.append)
        )
        await asyncio.wait_for(ready1.wait(), 10)
        await asyncio.wait_for(ready0.wait(), 10)
        assert len(ports) == 1  # only rank 0 bound an HTTP port
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{ports[0]}/health") as resp,
        ):
            assert resp.status == 200
        rank0.cancel()
        with pytest.raises(asyncio.CancelledError):
            await rank0
        await asyncio.wait_for(worker, 10)  # returns: rank 0 ended the replica on purpose

    asyncio.run(go())


def test_serve_multi_node_worker_gone_raises() -> None:
    async def go() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dist = f"127.0.0.1:{s.getsockname()[1]}"
        timing: dict[str, Any] = {"heartbeat_s": 0.1, "peer_timeout_s": 1.0}
        ready0 = asyncio.Event()
        rank0 = asyncio.create_task(
            serve(SimConfig(port=0, nodes=2, dist_init_addr=dist, **timing), ready0)
        )
        worker = asyncio.create_task(
            serve(SimConfig(nodes=2, rank=1, dist_init_addr=dist, **timing))
        )
        await asyncio.wait_for(ready0.wait(), 10)
        worker.cancel()  # the worker leaves (BYE): the replica is broken all the same
        with pytest.raises(asyncio.CancelledError):
            await worker
        with pytest.raises(RendezvousError, match=r"worker rank 1 .* is gone: it left \(BYE\)"):
            await asyncio.wait_for(rank0, 10)

    asyncio.run(go())


# ------------------------------------------------------------------ simple endpoints


def test_health(base_url: str) -> None:
    assert get(f"{base_url}/health") == (200, {"status": "ok"})


def test_list_models(client: openai.OpenAI) -> None:
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "llmgw"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


# ------------------------------------------------------------------ chat


def test_chat_non_stream(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=USER, seed=11)
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.model == MODEL
    assert isinstance(resp.created, int)
    (choice,) = resp.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    tokens, finish = generate(
        SimConfig(), "Tell me a short story about a river", max_tokens=32, seed=11
    )
    assert choice.message.content == "".join(tokens)
    assert choice.finish_reason == finish
    assert resp.usage is not None
    # The sim's tokenizer: one token per known word, one per byte of the others (" a").
    assert resp.usage.prompt_tokens == 15 == len(tokenize(USER[0]["content"]))
    assert resp.usage.completion_tokens == len(tokens)
    assert resp.usage.total_tokens == 15 + len(tokens)


def test_chat_uses_engine_seed_by_default(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=USER)
    tokens, _ = generate(SimConfig(seed=7), USER[0]["content"], max_tokens=1000, seed=None)
    assert resp.choices[0].message.content == "".join(tokens)


def test_chat_stream_reassembles_to_non_stream(client: openai.OpenAI) -> None:
    messages: Any = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour"}]},
    ]
    full = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        seed=42,
        max_tokens=1000,
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        seed=42,
        max_tokens=1000,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == full.choices[0].message.content
    assert full.usage is not None
    assert len(content_chunks) == full.usage.completion_tokens  # one event per token
    last = chunks[-1]
    assert last.choices[0].finish_reason == "stop" == full.choices[0].finish_reason
    assert last.choices[0].delta.content is None
    assert full.usage.prompt_tokens == 25  # "You are terse.\nName a colour", tokenized


def test_chat_different_seeds_differ(client: openai.OpenAI) -> None:
    texts = {
        client.chat.completions.create(model=MODEL, messages=USER, seed=s)
        .choices[0]
        .message.content
        for s in (1, 2, 3)
    }
    assert len(texts) == 3


def test_chat_max_tokens_gives_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5
    content = resp.choices[0].message.content
    assert content is not None and len(content.split()) == 5

    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=3,
        stream=True,
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(deltas) == 3
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_include_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=USER,
            seed=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    n_tokens = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert usage_chunk.usage.prompt_tokens == 15
    assert usage_chunk.usage.completion_tokens == n_tokens
    assert usage_chunk.usage.total_tokens == 15 + n_tokens
    assert all(c.usage is None for c in chunks[:-1])
    plain = list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))
    assert all(c.choices for c in plain)


def test_chat_n_choices(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=USER, seed=1, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    single = client.chat.completions.create(model=MODEL, messages=USER, seed=1)
    assert resp.choices[0].message.content == single.choices[0].message.content
    assert len({c.message.content for c in resp.choices}) == 3
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=USER, seed=1, n=3, stream=True)
    )
    texts = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == [c.message.content for c in resp.choices]


def test_chat_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=USER)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert body["type"] == "invalid_request_error"
    assert "gpt-4" in body["message"]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (["hello"], "messages[0]"),
    ],
)
def test_chat_bad_messages(client: openai.OpenAI, messages: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == param
    assert param in body["message"]
    assert body["type"] == "invalid_request_error"


# ------------------------------------------------------------------ completions


def test_completions_non_stream_and_stream(client: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    full = client.completions.create(model=MODEL, prompt=prompt, seed=9, max_tokens=100)
    assert full.object == "text_completion"
    assert full.id.startswith("cmpl-")
    (choice,) = full.choices
    tokens, finish = generate(SimConfig(), prompt, max_tokens=100, seed=9)
    assert choice.text == "".join(tokens)
    assert choice.finish_reason == finish == "stop"
    assert choice.logprobs is None
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (9, len(tokens))
    assert full.usage.total_tokens == 9 + len(tokens)

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            seed=9,
            max_tokens=100,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    assert len(text_chunks) == len(tokens)
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_completions_prompt_list_and_length(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=["a b", "c d e"], seed=2, max_tokens=4)
    assert [c.index for c in resp.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.choices[1].text == "".join(generate(SimConfig(), "c d e", max_tokens=4, seed=2)[0])
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (3 + 5, 8)


def test_completions_bad_prompt(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[1, 2, 3])
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "prompt"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")


# ------------------------------------------------------------------ raw error cases


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", [1, 2], 400, None),
        ("/v1/chat/completions", {"messages": USER}, 400, "model"),
        ("/v1/chat/completions", {"model": 3, "messages": USER}, 400, "model"),
        ("/v1/chat/completions", {"model": "zz", "messages": USER}, 404, "model"),
        ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "max_tokens": 0},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "max_tokens": True},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "max_completion_tokens": -2},
            400,
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "seed": "1"}, 400, "seed"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "stream": "yes"},
            400,
            "stream",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": USER, "n": 1000}, 400, "n"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": USER, "stream_options": []},
            400,
            "stream_options",
        ),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ],
)
def test_raw_errors(base_url: str, path: str, body: Any, status: int, param: str | None) -> None:
    got_status, got = post(base_url + path, body)
    assert got_status == status
    assert set(got) == {"error"}
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["param"] == param
    assert got["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert param in got["error"]["message"]
    if status == 404:
        assert got["error"]["code"] == "model_not_found"


def test_raw_invalid_json(base_url: str) -> None:
    status, body = post(f"{base_url}/v1/completions", None, raw=b"{not json")
    assert status == 400
    assert "JSON" in body["error"]["message"]


def test_raw_stream_wire_format(base_url: str) -> None:
    body = {"model": MODEL, "prompt": "wire", "stream": True, "max_tokens": 2}
    req = urllib.request.Request(
        f"{base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Accept-Encoding": "gzip, deflate"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        assert resp.headers["Cache-Control"] == "no-cache"
        assert resp.headers.get("Content-Encoding") is None
        raw = resp.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert [p["choices"][0]["finish_reason"] for p in payloads] == [None, None, "length"]
    assert ", " not in events[0] and '": ' not in events[0]  # compact JSON


# ------------------------------------------------------------------ timing and lifecycle


def test_ttft_and_tps_delay() -> None:
    cfg = SimConfig(port=0, ttft_ms=150, tps=50)
    with running(cfg) as url:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)
        start = time.monotonic()
        stream = c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, stream=True)
        first = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
        end = time.monotonic()
        assert first is not None
        assert first - start >= 0.150
        assert end - start >= 0.150 + 4 / 50

        start = time.monotonic()
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
        assert time.monotonic() - start >= 0.150 + 4 / 50


def test_client_disconnect_mid_stream(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def go(url: str) -> None:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "messages": USER, "stream": True, "max_tokens": 64}
            resp = await session.post(f"{url}/v1/chat/completions", json=body)
            first = await resp.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            resp.close()  # drop the connection mid-stream
            await asyncio.sleep(0.3)
            async with session.get(f"{url}/health") as health:
                assert health.status == 200

    with running(SimConfig(port=0, tps=20)) as url:
        asyncio.run(go(url))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info]


def test_serve_ready_and_cancel() -> None:
    async def go() -> None:
        ready = asyncio.Event()
        ports: list[int] = []
        task = asyncio.create_task(serve(SimConfig(port=0), ready, ports.append))
        await asyncio.wait_for(ready.wait(), 10)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{ports[0]}/v1/models") as resp:
                assert (await resp.json())["data"][0]["id"] == MODEL
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_serve_port_in_use() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]

        async def go() -> None:
            await serve(SimConfig(port=port))

        with pytest.raises(EngineError, match=str(port)):
            asyncio.run(go())


def test_run_logs_and_exits_cleanly_on_sigterm() -> None:
    code = (
        "from llmgw.sim.config import SimConfig\nfrom llmgw.sim.server import run\n"
        "run(SimConfig(port=0, model='m1'))\n"
        "print('returned', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        first, line = proc.stderr.readline(), proc.stderr.readline()
        assert re.search(r"llmgw\.loop event loop: (uvloop|asyncio)$", first.rstrip()), first
        match = re.search(r"sim engine listening on 127\.0\.0\.1:(\d+) model=m1", line)
        assert match, first + line
        status, _ = get(f"http://127.0.0.1:{match.group(1)}/health")
        assert status == 200
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.strip() == "returned"
    assert "Traceback" not in err
