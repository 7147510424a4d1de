"""The gateway's key policy, endpoints, queues and usage, on real sockets.

The gateway runs in-process with its real limits, admission and usage book (on a stand-in
store that adds rows up as the real one does); a stand-in data plane answers every endpoint
after a delay the test sets, with the usage an engine reports, and records how many requests
it holds at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.keypolicy import Budget, KeyPolicy
from llmgw.server.common.config import load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.gateway import Gateway
from llmgw.server.gateway.limits import KeyLimits
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.usage import UsageBook
from llmgw.server.store.rows import ApiKey
from tests.unit.gateway_rig import gateway_of, serving_of
from tests.unit.server.fakes import FakeStore, api_key
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(60)

STEP_S = 10.0  # the longest any one step may wait; only reached when something is broken


@dataclass
class Engine:
    delay: float = 0.0
    holding: int = 0
    most: int = 0
    served: list[str] = field(default_factory=list)  # the key names, in the order served
    gone: int = 0


def engine_app(engine: Engine) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = json.loads(await request.read())
        engine.holding += 1
        engine.most = max(engine.most, engine.holding)
        try:
            await asyncio.sleep(engine.delay)
            engine.served.append(str(body.get("user", "")))
            usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for word in ("a", "b", "c"):
                    chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    await asyncio.sleep(engine.delay)
                await resp.write(
                    b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
                )
                await resp.write(b"data: [DONE]\n\n")
                return resp
            tail = request.match_info["tail"]
            if tail == "v1/responses":
                usage = {
                    "input_tokens": 5,
                    "output_tokens": 2,
                    "total_tokens": 7,
                    "input_tokens_details": {"cached_tokens": 4},
                }
            return web.json_response({"id": "x", "object": tail, "usage": usage})
        except asyncio.CancelledError:
            engine.gone += 1
            raise
        finally:
            engine.holding -= 1

    app = web.Application()
    app.router.add_post("/s/{shard}/{tail:.*}", handle)
    return app


@dataclass
class Rig:
    gateway: Gateway
    engine: Engine
    store: FakeStore
    usage: UsageBook
    keys: dict[str, ApiKey]
    url: str
    client: aiohttp.ClientSession
    metrics: Metrics

    async def post(
        self, key: str, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> tuple[int, dict[str, Any], dict[str, str]]:
        headers = {"Authorization": f"Bearer sk-{key}"}
        async with self.client.post(self.url + path, json=body, headers=headers) as resp:
            if resp.content_type == "text/event-stream":
                return resp.status, {"stream": await resp.text()}, dict(resp.headers)
            return resp.status, await resp.json(content_type=None), dict(resp.headers)


def chat(model: str = "m", user: str = "", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "user": user, **extra}


def run(
    body: Callable[[Rig], Awaitable[None]],
    policies: dict[str, KeyPolicy],
    *,
    max_concurrency: int = 64,
    tasks: tuple[str, ...] = ("generate", "embed", "rerank"),
    engine_name: str = "sim",
    delay: float = 0.0,
    clock: Callable[[], float] = time.time,
    **cfg_changes: Any,
) -> None:
    async def main() -> None:
        engine = Engine(delay=delay)
        async with serving(engine_app(engine)) as engine_port:
            cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0, **cfg_changes)
            router = Router()
            router.set_ready(Endpoint("m", "r1", "s1", "n1", f"127.0.0.1:{engine_port}"))
            router.set_ready(Endpoint("other", "r2", "s2", "n1", f"127.0.0.1:{engine_port}"))
            keys = {name: api_key(name, p)[0] for name, p in policies.items()}
            models = [
                ServedModel(
                    name,
                    engine_name,
                    tasks,
                    served_paths(engine_name, tasks),
                    max_concurrency,
                    None,
                )
                for name in ("m", "other")
            ]
            cache = serving_of(cfg, list(keys.values()), models)
            store = FakeStore()
            limits = KeyLimits(budget_spent=lambda k, since: store.tokens_since(since).get(k, 0))
            usage = UsageBook(store, limits)
            metrics = Metrics()
            gateway = gateway_of(
                cfg, router, cache, metrics=metrics, key_limits=limits, usage=usage, clock=clock
            )
            app = web.Application()
            gateway.add_routes(app)
            app.on_cleanup.append(lambda _app: gateway.close())
            async with serving(app) as port, aiohttp.ClientSession() as client:
                await body(
                    Rig(
                        gateway,
                        engine,
                        store,
                        usage,
                        keys,
                        f"http://127.0.0.1:{port}",
                        client,
                        metrics,
                    )
                )

    asyncio.run(main())


# --------------------------------------------------------------------------- keys


def test_an_expired_key_gets_401_saying_so() -> None:
    now = [1000.0]

    async def body(rig: Rig) -> None:
        status, _, _ = await rig.post("alice", chat())
        assert status == 200
        now[0] = 2000.0
        status, answer, _ = await rig.post("alice", chat())
        assert status == 401
        assert answer["error"]["code"] == "expired_api_key"
        assert "'alice' expired on 1970-01-01 00:25 UTC" in answer["error"]["message"]
        assert "--expires" in answer["error"]["message"]
        async with rig.client.get(
            rig.url + "/v1/models", headers={"Authorization": "Bearer sk-alice"}
        ) as resp:
            assert resp.status == 401

    run(body, {"alice": KeyPolicy(expires_at=1500.0)}, clock=lambda: now[0])


def test_a_model_the_key_may_not_use_is_403_naming_those_it_may() -> None:
    async def body(rig: Rig) -> None:
        status, answer, _ = await rig.post("alice", chat("other"))
        assert status == 403
        assert answer["error"]["code"] == "model_not_allowed"
        assert answer["error"]["type"] == "permission_error"
        assert "it may use m." in answer["error"]["message"]
        status, _, _ = await rig.post("alice", chat("m"))
        assert status == 200
        headers = {"Authorization": "Bearer sk-alice"}
        async with rig.client.get(rig.url + "/v1/models", headers=headers) as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["m"]
        async with rig.client.get(rig.url + "/v1/models/other", headers=headers) as resp:
            assert resp.status == 404
        async with rig.client.get(rig.url + "/v1/models/m", headers=headers) as resp:
            model = await resp.json()
            assert model["id"] == "m" and "/v1/embeddings" in model["llmgw"]["endpoints"]
        row = rig.usage.pending()
        assert {(r.model, r.requests, r.errors) for r in row} == {("other", 1, 1), ("m", 1, 0)}

    run(body, {"alice": KeyPolicy(models=("m",))})


def test_an_endpoint_the_model_does_not_serve_is_400_naming_what_it_does() -> None:
    async def body(rig: Rig) -> None:
        status, answer, _ = await rig.post("alice", {"model": "m", "input": "x"}, "/v1/embeddings")
        assert status == 400
        assert answer["error"]["code"] == "unsupported_endpoint"
        message = answer["error"]["message"]
        assert "does not serve /v1/embeddings" in message and "/v1/chat/completions" in message
        status, _, _ = await rig.post("alice", {"model": "m", "input": "x"}, "/v1/responses")
        assert status == 200
        assert rig.engine.served == [
            "",
        ]

    run(body, {"alice": KeyPolicy()}, tasks=("generate",), engine_name="vllm")


def test_every_endpoint_reaches_the_engine_with_its_path() -> None:
    async def body(rig: Rig) -> None:
        for path in (
            "/v1/embeddings",
            "/v1/responses",
            "/v1/rerank",
            "/v1/score",
            "/v1/completions",
            "/tokenize",
            "/detokenize",
        ):
            status, answer, _ = await rig.post("alice", {"model": "m", "input": "x"}, path)
            assert status == 200, (path, answer)
            assert answer["object"] == path.lstrip("/")
        rows = rig.usage.pending()
        assert rows[0].requests == 7
        # The Responses API's usage: input/output tokens and the cached ones.
        assert rows[0].cached_tokens == 4

    run(body, {"alice": KeyPolicy()})


# --------------------------------------------------------------------------- limits


def test_rpm_429_with_openai_headers_then_refills() -> None:
    async def body(rig: Rig) -> None:
        for _ in range(2):
            status, _, headers = await rig.post("alice", chat())
            assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        status, answer, headers = await rig.post("alice", chat())
        assert status == 429
        assert answer["error"]["code"] == "rate_limit_exceeded"
        assert answer["error"]["type"] == "requests"
        assert headers["Retry-After"] == "30"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("s")
        # The bucket refills: fast-forward it.
        state = rig.gateway.key_limits.states["alice"]
        assert state.requests is not None
        state.requests.at -= 30
        status, _, _ = await rig.post("alice", chat())
        assert status == 200

    run(body, {"alice": KeyPolicy(rpm=2)})


def test_tpm_settles_on_the_reported_usage() -> None:
    async def body(rig: Rig) -> None:
        status, _, headers = await rig.post("alice", chat(max_tokens=500))
        assert status == 200
        # Debited ~500+ up front, settled on the 10 reported: the next may ask 500 again.
        state = rig.gateway.key_limits.states["alice"]
        assert state.tokens is not None and state.tokens.level == pytest.approx(990, abs=1)
        status, _, headers = await rig.post("alice", chat(max_tokens=2000))
        assert status == 429
        assert headers["x-ratelimit-limit-tokens"] == "1000"

    run(body, {"alice": KeyPolicy(tpm=1000)})


def test_a_spent_budget_is_insufficient_quota() -> None:
    async def body(rig: Rig) -> None:
        for _ in range(3):  # 10 tokens each
            status, _, _ = await rig.post("alice", chat())
            assert status == 200
        status, answer, headers = await rig.post("alice", chat())
        assert status == 429
        assert answer["error"]["code"] == "insufficient_quota"
        assert int(headers["Retry-After"]) >= 1
        rig.usage.flush()
        status, _, _ = await rig.post("alice", chat())
        assert status == 429  # the store's total now holds them: still spent
        status, _, _ = await rig.post("bob", chat())
        assert status == 200  # another key is not affected

    run(body, {"alice": KeyPolicy(budget=Budget(30, "day")), "bob": KeyPolicy()})


def test_max_concurrent_counts_a_stream_until_its_last_chunk() -> None:
    async def body(rig: Rig) -> None:
        headers = {"Authorization": "Bearer sk-alice"}
        async with rig.client.post(
            rig.url + "/v1/chat/completions", json=chat(stream=True), headers=headers
        ) as resp:
            assert resp.status == 200
            await resp.content.readline()  # the first chunk is here; the stream goes on
            status, answer, _ = await rig.post("alice", chat())
            assert status == 429
            assert answer["error"]["code"] == "concurrency_limit_exceeded"
            await resp.read()
        status, _, _ = await rig.post("alice", chat())
        assert status == 200

    run(body, {"alice": KeyPolicy(max_concurrent=1)}, delay=0.2)


# --------------------------------------------------------------------------- queues


def test_a_full_replica_queues_and_never_holds_more_than_max_concurrency() -> None:
    async def body(rig: Rig) -> None:
        answers = await asyncio.gather(*(rig.post("alice", chat()) for _ in range(12)))
        assert [a[0] for a in answers] == [200] * 12
        assert rig.engine.most == 3
        assert sum(rig.metrics.queue_wait.counts[("m",)]) >= 9

    run(body, {"alice": KeyPolicy()}, max_concurrency=3, delay=0.05)


def test_a_lone_key_is_served_within_a_few_requests_of_another_keys_flood() -> None:
    async def body(rig: Rig) -> None:
        flood = [asyncio.create_task(rig.post("a", chat(user="a"))) for _ in range(40)]
        await asyncio.sleep(0.05)
        waits = []
        for _ in range(3):
            started = time.perf_counter()
            status, _, _ = await rig.post("b", chat(user="b"))
            assert status == 200
            waits.append(time.perf_counter() - started)
        position = [i for i, who in enumerate(rig.engine.served) if who == "b"]
        await asyncio.gather(*flood)
        # Each of b's requests went in within a few of a's, not behind a's queue of 40
        # (4 at a time, 0.05 s each: a's whole queue is 0.5 s).
        gaps = [b - a for a, b in zip([-1, *position], position, strict=False)]
        assert max(gaps) <= 4 + 2 * 4, (position, gaps)
        assert max(waits) < 0.45, waits

    run(body, {"a": KeyPolicy(), "b": KeyPolicy()}, max_concurrency=4, delay=0.05)


def test_fifo_puts_the_lone_key_behind_the_flood() -> None:
    async def body(rig: Rig) -> None:
        flood = [asyncio.create_task(rig.post("a", chat(user="a"))) for _ in range(40)]
        await asyncio.sleep(0.05)
        status, _, _ = await rig.post("b", chat(user="b"))
        assert status == 200
        assert rig.engine.served.index("b") >= 30
        await asyncio.gather(*flood)

    run(
        body,
        {"a": KeyPolicy(), "b": KeyPolicy()},
        max_concurrency=4,
        delay=0.05,
        fair_queueing=False,
    )


def test_a_queued_request_times_out_with_503_and_retry_after() -> None:
    async def body(rig: Rig) -> None:
        holding = asyncio.create_task(rig.post("alice", chat()))
        await asyncio.sleep(0.05)
        status, answer, headers = await rig.post("alice", chat())
        assert status == 503
        assert answer["error"]["code"] == "model_overloaded"
        assert "queue_timeout" in answer["error"]["message"]
        assert headers["Retry-After"] == "1"
        assert (await holding)[0] == 200
        assert rig.gateway.admission.depth("m") == 0

    run(body, {"alice": KeyPolicy()}, max_concurrency=1, delay=0.5, queue_timeout=0.1)


def test_a_client_that_goes_away_while_queued_leaves_the_queue_at_once() -> None:
    async def body(rig: Rig) -> None:
        holding = asyncio.create_task(rig.post("alice", chat()))
        await asyncio.sleep(0.05)
        gone = asyncio.create_task(rig.post("alice", chat()))
        for _ in range(100):
            if rig.gateway.admission.depth("m"):
                break
            await asyncio.sleep(0.01)
        assert rig.gateway.admission.depth("m") == 1
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        for _ in range(100):
            if not rig.gateway.admission.depth("m"):
                break
            await asyncio.sleep(0.01)
        assert rig.gateway.admission.depth("m") == 0
        assert (await holding)[0] == 200
        assert rig.engine.served == [""]  # the one that went away never reached the engine

    run(body, {"alice": KeyPolicy()}, max_concurrency=1, delay=0.3)


# --------------------------------------------------------------------------- usage


def test_usage_adds_up_per_key_and_model_and_reaches_the_store_in_one_write() -> None:
    async def body(rig: Rig) -> None:
        for _ in range(3):
            assert (await rig.post("alice", chat()))[0] == 200
        assert (await rig.post("alice", chat(stream=True)))[0] == 200
        assert (await rig.post("bob", chat("other")))[0] == 200
        assert (await rig.post("bob", {"model": "nope"}))[0] == 404  # no such model: not counted
        assert rig.store.writes == 0
        rig.usage.flush()
        assert rig.store.writes == 1
        rows = {(r.key_id, r.model): r for r in rig.store.rows.values()}
        alice = rows[("alice", "m")]
        assert (alice.requests, alice.prompt_tokens, alice.completion_tokens) == (4, 28, 12)
        assert rows[("bob", "other")].requests == 1
        assert len(rows) == 2
        text = rig.metrics.render()
        assert 'llmgw_key_requests_total{key="alice",model="m",code="200"} 4' in text
        assert 'llmgw_key_tokens_total{key="alice",model="m",kind="prompt"} 28' in text

    run(body, {"alice": KeyPolicy(), "bob": KeyPolicy()})
