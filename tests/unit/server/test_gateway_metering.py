"""What a request is charged, through the gateway in-process in front of a real ``sim`` engine
and driven by the official OpenAI client: a stream reports its usage whether or not the
client asked (and a client that did not ask never sees it), a stream cut short is charged its
prompt's estimate, the estimates of requests in flight count against a key's TPM and budget,
a non-boolean ``stream`` and too many messages are refused before any engine sees them, and
a long prompt is tokenized without holding the event loop.

The sim app stands in for the agent's data plane (mounted at ``/s/<shard>/``), behind a
middleware that counts what reaches it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.keypolicy import Budget, KeyPolicy
from llmgw.server.common.config import DEFAULT_MAX_MESSAGES, load_server_config
from llmgw.server.gateway.gateway import Gateway
from llmgw.server.gateway.limits import KeyLimits
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.tokenizing import SimTokenizer, Tokenizers
from llmgw.server.gateway.usage import UsageBook
from llmgw.sim.config import SimConfig
from llmgw.sim.server import build_app
from tests.unit.gateway_rig import gateway_of, serving_of
from tests.unit.server.fakes import FakeStore, api_key
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(60)

CHAT = "/v1/chat/completions"
# 4,300 prompt tokens for the sim's tokenizer.
LONG = " ".join(["the river runs to the sea"] * 430)


@dataclasses.dataclass
class Rig:
    url: str
    client: openai.AsyncOpenAI
    http: aiohttp.ClientSession
    gateway: Gateway
    usage: UsageBook
    reached: list[str]  # the paths the data plane was asked for

    async def post(self, body: dict[str, Any], path: str = CHAT) -> tuple[int, Any]:
        headers = {"Authorization": "Bearer sk-alice"}
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            if resp.content_type == "text/event-stream":
                return resp.status, await resp.text()
            return resp.status, await resp.json(content_type=None)

    def booked(self) -> tuple[int, int, int]:
        """(requests, prompt, completion) tokens the usage book holds for alice."""
        rows = [r for r in self.usage.pending() if r.key_id == "alice"]
        return (
            sum(r.requests for r in rows),
            sum(r.prompt_tokens for r in rows),
            sum(r.completion_tokens for r in rows),
        )


def run(
    body: Callable[[Rig], Awaitable[None]],
    policy: KeyPolicy,
    *,
    engine: str = "sim",
    routing: str = "least-outstanding",
    sim: SimConfig | None = None,
    data_plane: web.Application | None = None,
    **cfg_changes: Any,
) -> None:
    """The gateway serving model ``m`` (``engine``, ``routing``) on one replica: a sim engine
    (``sim``), or ``data_plane`` itself; key ``alice`` has ``policy``."""

    async def main() -> None:
        reached: list[str] = []

        @web.middleware
        async def count(request: web.Request, handler: Any) -> web.StreamResponse:
            reached.append(request.path)
            return await handler(request)

        plane = data_plane
        if plane is None:
            plane = web.Application(middlewares=[count])
            plane.add_subapp("/s/s0/", build_app(sim or SimConfig(model="m", seed=5)))
        else:
            plane.middlewares.append(count)
        async with serving(plane) as dp_port:
            cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0, **cfg_changes)
            router = Router()
            router.set_ready(Endpoint("m", "r0", "s0", "n1", f"127.0.0.1:{dp_port}"))
            tasks = ("generate",)
            served = ServedModel(
                "m", engine, tasks, served_paths(engine, tasks), 64, None, routing=routing,
                output_cap=SimConfig.max_tokens if engine == "sim" else None,
            )  # fmt: skip
            cache = serving_of(cfg, [api_key("alice", policy)[0]], [served])
            tokenizers = Tokenizers(None)
            tokenizers.set_models([served])
            store = FakeStore()
            limits = KeyLimits(budget_spent=lambda k, since: store.tokens_since(since).get(k, 0))
            usage = UsageBook(store, limits)
            gateway = gateway_of(
                cfg, router, cache, key_limits=limits, usage=usage, tokenizers=tokenizers
            )
            app = web.Application()
            gateway.add_routes(app)
            app.on_cleanup.append(lambda _app: gateway.close())
            async with serving(app) as port, aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{port}"
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-alice", max_retries=0)
                try:
                    await body(Rig(url, client, http, gateway, usage, reached))
                finally:
                    await client.close()

    asyncio.run(main())


def messages(text: str = LONG) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def settled(rig: Rig, requests: int) -> tuple[int, int, int]:
    """What is booked once ``requests`` have ended (a handler settles just after its last
    byte went)."""
    for _ in range(200):
        if rig.booked()[0] >= requests:
            break
        await asyncio.sleep(0.01)
    return rig.booked()


# --------------------------------------------------------------------------- streams' usage


@pytest.mark.parametrize("options", [None, {"include_usage": False}])
def test_a_stream_not_asking_for_usage_is_charged_its_prompt_and_shows_no_usage_chunk(
    options: dict[str, bool] | None,
) -> None:
    async def body(rig: Rig) -> None:
        whole = await rig.client.chat.completions.create(model="m", messages=messages())
        assert whole.usage is not None
        prompt = whole.usage.prompt_tokens
        assert prompt > 2000
        extra: dict[str, Any] = {} if options is None else {"stream_options": options}
        stream = await rig.client.chat.completions.create(
            model="m", messages=messages(), stream=True, **extra
        )
        chunks = [chunk async for chunk in stream]
        assert chunks and all(c.usage is None for c in chunks)
        assert all(len(c.choices) == 1 for c in chunks)  # chunk.choices[0] never fails
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == whole.choices[0].message.content
        # Charged what the engine counted, as the whole answer was.
        requests, booked_prompt, completion = await settled(rig, 2)
        assert (requests, booked_prompt) == (2, 2 * prompt)
        assert completion == 2 * whole.usage.completion_tokens
        # The budget (6,000/day) is spent: the next request is refused.
        with pytest.raises(openai.RateLimitError) as caught:
            await rig.client.chat.completions.create(model="m", messages=messages("hi"))
        assert caught.value.code == "insufficient_quota"

    run(body, KeyPolicy(budget=Budget(6000, "day")))


def test_a_client_asking_for_usage_gets_exactly_one_usage_chunk() -> None:
    async def body(rig: Rig) -> None:
        stream = await rig.client.chat.completions.create(
            model="m",
            messages=messages("hello there"),
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        with_usage = [c for c in chunks if c.usage is not None]
        assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
        assert chunks[-1].choices == []
        usage = with_usage[0].usage
        assert usage is not None
        _, prompt, completion = await settled(rig, 1)
        assert (prompt, completion) == (usage.prompt_tokens, usage.completion_tokens)
        # A completion's stream too.
        raw = await rig.post({"model": "m", "prompt": "hello", "stream": True}, "/v1/completions")
        assert raw[0] == 200 and '"usage"' not in raw[1] and raw[1].endswith("[DONE]\n\n")
        assert (await settled(rig, 2))[2] > completion

    run(body, KeyPolicy())


def test_a_stream_cut_short_is_charged_its_prompt_estimate_and_the_tokens_it_carried() -> None:
    async def body(rig: Rig) -> None:
        stream = await rig.client.chat.completions.create(
            model="m", messages=messages(), stream=True, max_tokens=30
        )
        carried = 0
        async for chunk in stream:
            carried += bool(chunk.choices and chunk.choices[0].delta.content)
            if carried == 3:
                break
        await stream.close()  # the client goes away mid-answer: no usage chunk came
        _, prompt, completion = await settled(rig, 1)
        # The sim's tokenizer is the engine's: the estimate is the prompt exactly.
        expected = SimTokenizer().token_ids(CHAT, {"messages": messages()})
        assert expected is not None and prompt == len(expected)
        assert 3 <= completion < 30

    # A key with a budget: its prompts are counted by the tokenizer (for one without any
    # limit the estimate decides nothing, and is the body's bytes / 4).
    run(
        body,
        KeyPolicy(budget=Budget(10**9, "day")),
        sim=SimConfig(model="m", seed=5, tps=40.0, max_tokens=64),
    )


def test_a_stream_that_is_not_a_boolean_is_400_before_any_engine() -> None:
    async def body(rig: Rig) -> None:
        for value in ("yes", "false", 1, 0, {"on": True}):
            status, answer = await rig.post(
                {"model": "m", "messages": messages("x"), "stream": value}
            )
            assert status == 400, value
            assert answer["error"]["code"] == "invalid_type"
            assert answer["error"]["param"] == "stream"
            assert answer["error"]["message"].startswith(
                f"'stream' must be true or false, got {json.dumps(value)}"
            )
        assert rig.reached == []
        status, _ = await rig.post({"model": "m", "messages": messages("x"), "stream": None})
        assert status == 200  # null: not streamed, as OpenAI reads it

    run(body, KeyPolicy())


# --------------------------------------------------------------------------- reservations


def test_a_second_request_in_flight_is_refused_against_a_small_tpm() -> None:
    """Neither asks for a maximum: each is charged its prompt plus 1,024 output tokens up
    front, so the second finds the key's 1,000 TPM held by the first."""

    async def body(rig: Rig) -> None:
        first = asyncio.create_task(rig.post({"model": "m", "messages": messages("hi")}))
        for _ in range(500):
            if rig.reached:
                break
            await asyncio.sleep(0.01)
        status, answer = await rig.post({"model": "m", "messages": messages("hi")})
        assert status == 429
        assert answer["error"]["code"] == "rate_limit_exceeded"
        assert answer["error"]["type"] == "tokens"
        assert (await first)[0] == 200

    run(
        body,
        KeyPolicy(tpm=1000),
        engine="vllm",  # no tokenizer, no cap: bytes / 4 and the default reserve
        sim=SimConfig(model="m", seed=5, ttft_ms=800),
    )


def test_a_second_request_in_flight_is_refused_against_a_budget_the_first_may_spend() -> None:
    async def body(rig: Rig) -> None:
        first = asyncio.create_task(rig.post({"model": "m", "messages": messages()}))
        for _ in range(500):
            if rig.reached:
                break
            await asyncio.sleep(0.01)
        status, answer = await rig.post({"model": "m", "messages": messages()})
        assert status == 429
        assert answer["error"]["code"] == "insufficient_quota"
        assert "1 requests in flight" in answer["error"]["message"]
        assert (await first)[0] == 200
        # Settled on what it cost: over the budget now, refused for what was spent.
        status, answer = await rig.post({"model": "m", "messages": messages("hi")})
        assert status == 429 and "has spent its budget" in answer["error"]["message"]

    run(
        body,
        KeyPolicy(budget=Budget(3000, "day")),
        sim=SimConfig(model="m", seed=5, ttft_ms=800),
    )


# --------------------------------------------------------------------------- the loop


def test_too_many_messages_are_400_naming_the_setting() -> None:
    async def body(rig: Rig) -> None:
        many = [{"role": "user", "content": "x"}] * (DEFAULT_MAX_MESSAGES + 1)
        status, answer = await rig.post({"model": "m", "messages": many})
        assert status == 400
        assert answer["error"]["code"] == "too_many_messages"
        assert answer["error"]["message"] == (
            f"The request has {DEFAULT_MAX_MESSAGES + 1} messages; this gateway takes at most "
            f"{DEFAULT_MAX_MESSAGES} in one request (max_messages in server.yaml)."
        )
        status, answer = await rig.post({"model": "m", "input": many}, "/v1/responses")
        assert status == 400 and answer["error"]["param"] == "input"
        assert rig.reached == []
        status, _ = await rig.post({"model": "m", "messages": many[:DEFAULT_MAX_MESSAGES]})
        assert status == 200

    run(body, KeyPolicy(), routing="kv-events")


def test_max_messages_is_the_settings() -> None:
    async def body(rig: Rig) -> None:
        status, answer = await rig.post({"model": "m", "messages": messages("x") * 4})
        assert status == 400 and "at most 3 in one request" in answer["error"]["message"]
        assert (await rig.post({"model": "m", "messages": messages("x") * 3}))[0] == 200

    run(body, KeyPolicy(), max_messages=3)


def _quiet_engine() -> web.Application:
    """A data plane that answers at once without reading the prompt (the sim would tokenize
    it on this same loop)."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response({"id": "x", "object": "chat.completion", "usage": usage})

    app = web.Application(client_max_size=8 << 20)
    app.router.add_post("/s/{shard}/{tail:.*}", answer)
    return app


def test_a_long_prompt_is_tokenized_off_the_event_loop() -> None:
    """1 MiB of prompt to a kv-events sim model: tokenizing it holds the interpreter a good
    part of a second. The loop's longest stall while the gateway handles it stays a small
    part of that (it was all of it)."""
    text = "a " * (1 << 19)
    payload = {"model": "m", "messages": messages(text)}
    began = time.perf_counter()
    assert SimTokenizer().token_ids(CHAT, payload)
    on_loop = time.perf_counter() - began

    async def body(rig: Rig) -> None:
        stalls: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.002)
                now = time.perf_counter()
                stalls.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.05)
        status, _ = await rig.post(payload)
        done.set()
        await ticker
        assert status == 200
        assert max(stalls) < on_loop / 3, (max(stalls), on_loop)

    run(body, KeyPolicy(), routing="kv-events", data_plane=_quiet_engine())
