"""A model's chat template is third-party code: the gateway renders it (to route kv-events
by the prompt's blocks) in Jinja's ImmutableSandboxedEnvironment, as transformers does. A
template that reaches for ``__class__`` or changes a list is stopped by the sandbox and the
request refused with a 400 that says so, before anything reaches the engine; the key's
slot is given back. The gateway runs in-process on a real socket, the engine is a stand-in
that counts what reaches it."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.errors import ChatTemplateRefused
from llmgw.server.common.config import load_server_config
from llmgw.server.gateway.limits import KeyLimits
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.tokenizing import HfTokenizer, Tokenizers
from llmgw.server.store.rows import ApiKey
from tests.unit.gateway_rig import gateway_of, serving_of
from tests.unit.server.tokenizer_rig import CHATML, word_level_tokenizer
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
ESCAPES = {
    "dunder": "{{ ''.__class__.__mro__ }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "mutation": "{% for m in messages %}{{ messages.append(m) }}{{ m.content }}{% endfor %}",
    "format": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    # CVE-2025-27516 (Jinja2 before 3.1.6, hence the floor in pyproject.toml): |attr('format')
    # handed a template str.format unsandboxed.
    "attr-format": "{{ ('{0.__class__.__mro__}'|attr('format'))(messages) }}",
}


def _hf(template: str) -> HfTokenizer:
    return HfTokenizer.from_files(word_level_tokenizer().to_str().encode(), template.encode())


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_the_sandbox_stops_the_template_and_says_so(name: str) -> None:
    hf = _hf(ESCAPES[name])
    body = {"messages": [{"role": "user", "content": "hello world"}]}
    with pytest.raises(ChatTemplateRefused) as info:
        hf.token_ids(CHAT, body)
    assert str(info.value).startswith("the model's chat template tried what its sandbox forbids (")
    assert body == {"messages": [{"role": "user", "content": "hello world"}]}  # unchanged


def _gateway_answers(template: str, requests: int) -> tuple[list[tuple[int, Any]], int]:
    """``requests`` chats through the gateway to a kv-events model whose chat template is
    ``template`` (one request at a time is all its key may have in flight); the answers and
    how many reached the engine."""
    reached = 0

    async def engine(request: web.Request) -> web.Response:
        nonlocal reached
        reached += 1
        return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

    async def main() -> list[tuple[int, Any]]:
        app = web.Application()
        app.router.add_post("/s/{shard}/{tail:.*}", engine)
        async with serving(app) as engine_port:
            cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0)
            router = Router()
            router.set_ready(Endpoint("m", "r1", "s1", "n1", f"127.0.0.1:{engine_port}"))
            tasks = ("generate",)
            model = ServedModel(
                "m", "vllm", tasks, served_paths("vllm", tasks), 64, None, routing="kv-events"
            )
            secret = "sk-alice"
            key = ApiKey(
                "alice",
                "alice",
                secret,
                hashlib.sha256(secret.encode()).hexdigest(),
                0.0,
                None,
                policy=KeyPolicy(max_concurrent=1),
            )
            hf = _hf(template)
            tokenizers = cast(
                Tokenizers,
                SimpleNamespace(for_model=lambda name: hf, chat_prompt=lambda name: None),
            )
            gateway = gateway_of(
                cfg,
                router,
                serving_of(cfg, [key], [model]),
                key_limits=KeyLimits(),
                tokenizers=tokenizers,
            )
            gw = web.Application()
            gateway.add_routes(gw)
            gw.on_cleanup.append(lambda _app: gateway.close())
            answers = []
            async with serving(gw) as port, aiohttp.ClientSession() as client:
                for _ in range(requests):
                    async with client.post(
                        f"http://127.0.0.1:{port}{CHAT}",
                        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                        headers={"Authorization": f"Bearer {secret}"},
                    ) as resp:
                        answers.append((resp.status, await resp.json(content_type=None)))
            return answers

    answers = asyncio.run(main())
    return answers, reached


def test_a_template_the_sandbox_stops_is_a_400_and_reaches_no_engine() -> None:
    answers, reached = _gateway_answers(ESCAPES["dunder"], 2)
    for status, body in answers:  # the second: the first gave its key's one slot back
        assert status == 400, body
        error = body["error"]
        assert error["code"] == "chat_template_refused"
        assert error["message"].startswith(
            "the model's chat template tried what its sandbox forbids (access to attribute "
            "'__class__' of 'str' object is unsafe.); it was not run. The operator should "
            "replace the profile's chat_template with the model's own."
        )
    assert reached == 0


def test_a_sound_template_routes_as_before() -> None:
    answers, reached = _gateway_answers(CHATML, 2)
    assert [status for status, _ in answers] == [200, 200]
    assert reached == 2
