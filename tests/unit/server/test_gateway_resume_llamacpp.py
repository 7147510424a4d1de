"""A chat stream on llama.cpp (no ``continue_final_message``) that breaks goes on as a
completion of its chat rendered with the model's template and the text so far, when the
gateway holds that template; the client's stream stays one chat stream.

The replicas are stand-ins that play llama-server's two endpoints over one fixed answer: a
chat streams it a word a chunk, and a completion whose prompt is the chat's rendered prompt
(the ChatML of tokenizer_rig, as llama.cpp would get it: without the BOS text) and a part of
the answer continues it from there, so the uninterrupted chat is the oracle. A prompt that is
not such a continuation is answered 400.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from llmgw.contracts.catalog import FileRef
from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.server.common.config import load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.tokenizing import Tokenizers
from tests.unit.gateway_rig import gateway_of, serving_of
from tests.unit.server.fakes import api_key
from tests.unit.server.resume_rig import (
    KEY,
    MESSAGES,
    Breaker,
    broken,
    chat_stream,
    proxy,
    resumes,
)
from tests.unit.server.tokenizer_rig import CHATML
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(60)

ANSWER = ["Rivers", " run", " to", " the", " sea", " and", " back", " as", " rain", "."]
PROMPT_TOKENS = 9  # what the stand-in counts for the chat's prompt
# MESSAGES rendered with CHATML (add_generation_prompt), its leading "<s>" left out.
RENDERED = "<|im_start|>user\nTell me about rivers<|im_end|>\n<|im_start|>assistant\n"


@dataclasses.dataclass
class Seen:
    bodies: list[tuple[str, dict[str, Any]]] = dataclasses.field(default_factory=list)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def llamacpp(seen: Seen) -> web.Application:
    """llama-server's chat and completions over ANSWER (its chunk shapes, a word a token)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        seen.bodies.append((request.path, body))
        start, prompt_tokens = 0, PROMPT_TOKENS
        if not chat:
            prompt = body["prompt"]
            so_far = prompt.removeprefix(RENDERED)
            words = [w for i in range(len(ANSWER) + 1) if "".join(w := ANSWER[:i]) == so_far]
            if not prompt.startswith(RENDERED) or not words:
                return web.json_response({"error": {"message": "not a continuation"}}, status=400)
            start = len(words[0])
            prompt_tokens += start
        limit = body.get("max_tokens") or len(ANSWER)
        out = ANSWER[start : start + limit]
        finish = "stop" if start + len(out) == len(ANSWER) else "length"
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        cid, created = f"x{len(seen.bodies)}", int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def choice(text: str, end: str | None) -> dict[str, Any]:
            if chat:
                delta = {"content": text} if text else {}
                return {"index": 0, "delta": delta, "finish_reason": end}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": end}

        base = {"id": cid, "object": kind, "created": created, "model": "gguf"}
        if chat:
            delta = {"role": "assistant", "content": None}
            await resp.write(_event({**base, "choices": [{"index": 0, "delta": delta}]}))
        for word in out:
            await resp.write(_event({**base, "choices": [choice(word, None)]}))
        await resp.write(_event({**base, "choices": [choice("", finish)]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(out),
                "total_tokens": prompt_tokens + len(out),
            }
            await resp.write(_event({**base, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/completions", answer)
    return app


@dataclasses.dataclass
class Rig:
    client: openai.AsyncOpenAI
    direct: openai.AsyncOpenAI  # a stand-in, straight: the uninterrupted answer
    metrics: Metrics
    breaker: Breaker
    seen: Seen


def run(
    body: Callable[[Rig], Awaitable[None]],
    tmp_path: Path,
    tokenizer_json: bytes,
    *,
    template: bool = True,
    breaker: Breaker | None = None,
) -> None:
    breaker = breaker or Breaker()
    seen = Seen()
    (tmp_path / "tokenizer.json").write_bytes(tokenizer_json)
    (tmp_path / "chat_template.jinja").write_text(CHATML)

    async def main() -> None:
        async with serving(llamacpp(seen)) as engine_port:
            url = f"http://127.0.0.1:{engine_port}"
            data_plane = web.Application()
            for i in range(2):
                data_plane.add_subapp(f"/s/s{i}/", proxy(url, breaker))
            async with serving(data_plane) as dp_port:
                cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0)
                router = Router()
                for i in range(2):
                    router.set_ready(
                        Endpoint("m", f"r{i}", f"s{i}", f"n{i}", f"127.0.0.1:{dp_port}")
                    )
                served = ServedModel(
                    "m",
                    "llamacpp",
                    ("generate",),
                    served_paths("llamacpp", ("generate",)),
                    8,
                    None,
                    tokenizer=FileRef(str(tmp_path / "tokenizer.json")),
                    chat_template=(
                        FileRef(str(tmp_path / "chat_template.jinja")) if template else None
                    ),
                )
                tokenizers = Tokenizers(None)
                tokenizers.set_models([served])
                await tokenizers.load_due()  # the routing is not by tokens: for resuming
                assert (tokenizers.chat_prompt("m") is not None) == template
                metrics = Metrics()
                gateway = gateway_of(
                    cfg,
                    router,
                    serving_of(cfg, [api_key("alice", KeyPolicy())[0]], [served]),
                    metrics=metrics,
                    tokenizers=tokenizers,
                )
                app = web.Application()
                gateway.add_routes(app)
                app.on_cleanup.append(lambda _app: gateway.close())
                async with serving(app) as port:
                    client = openai.AsyncOpenAI(
                        base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0
                    )
                    direct = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                    try:
                        await body(Rig(client, direct, metrics, breaker, seen))
                    finally:
                        await client.close()
                        await direct.close()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["error", "reset", "eof"])
def test_a_broken_llamacpp_chat_goes_on_as_a_completion(
    mode: str, tmp_path: Path, tokenizer_json: bytes
) -> None:
    async def body(rig: Rig) -> None:
        whole, _, whole_usage, whole_finish = await chat_stream(rig.direct, seed=9, max_tokens=8)
        del rig.seen.bodies[:]
        text, ids, usage, finish = await chat_stream(
            rig.client, seed=9, max_tokens=8, temperature=0.7
        )
        assert rig.breaker.left == 0  # it did break
        assert text == whole == "".join(ANSWER[:8]) and finish == whole_finish == "length"
        assert len(ids) == 1  # the first part's id throughout
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            whole_usage.prompt_tokens,
            whole_usage.completion_tokens,
            whole_usage.total_tokens,
        )
        (first_path, _), (path, again) = rig.seen.bodies
        assert first_path == "/v1/chat/completions" and path == "/v1/completions"
        assert again == {
            "model": "m",
            "prompt": RENDERED + "".join(ANSWER[:3]),
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 9,
            "max_tokens": 5,
            "temperature": 0.7,
        }
        assert resumes(rig.metrics) == {("m", mode, "completed"): 1}
        assert broken(rig.metrics) == {}

    run(body, tmp_path, tokenizer_json, breaker=Breaker(after=3, mode=mode))


def test_the_chunks_are_the_chats(tmp_path: Path, tokenizer_json: bytes) -> None:
    """The client that did not ask for usage gets none; every chunk is a chat chunk of the
    first part's id and model, with one role chunk."""

    async def body(rig: Rig) -> None:
        stream = await rig.client.chat.completions.create(
            model="m", messages=MESSAGES, seed=3, stream=True
        )
        chunks = [c async for c in stream]
        assert rig.breaker.left == 0
        assert all(c.choices for c in chunks)  # no usage chunk
        assert {(c.id, c.model, c.object) for c in chunks} == {
            (chunks[0].id, "gguf", "chat.completion.chunk")
        }
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "".join(ANSWER)
        assert sum(1 for c in chunks if c.choices[0].delta.role) == 1
        assert chunks[-1].choices[0].finish_reason == "stop"

    run(body, tmp_path, tokenizer_json, breaker=Breaker(after=1))


@pytest.mark.parametrize(
    ("template", "kw"),
    [
        (False, {}),  # the gateway does not hold the model's chat template
        (True, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
        # A part other than text: the template is not given it (found at the break).
        (
            True,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y"}}],
                    }
                ]
            },
        ),
    ],
)
def test_a_chat_it_cannot_render_ends_with_the_error_event(
    template: bool, kw: dict[str, Any], tmp_path: Path, tokenizer_json: bytes
) -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APIError, match="engine went away"):
            await chat_stream(rig.client, seed=9, max_tokens=8, **kw)
        assert rig.breaker.left == 0
        assert [p for p, _ in rig.seen.bodies] == ["/v1/chat/completions"]
        assert resumes(rig.metrics) == {}
        assert broken(rig.metrics) == {("m", "engine"): 1}

    run(body, tmp_path, tokenizer_json, template=template)
