"""The gateway's new endpoints in front of a real ``sim`` engine, driven by the official
OpenAI client: embeddings (base64, the client's default), the Responses API whole and
streamed, rerank, score and the tokenizer, relayed unchanged; and a model deployed for
another task refused with the path it lacks.

The sim app stands in for the agent's data plane: mounted at ``/s/<shard>/``, it answers the
paths the gateway relays, as the data plane hands them to the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from llmgw.contracts.catalog import profile_max_concurrency, profile_tasks
from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.server.common.config import load_server_config
from llmgw.server.gateway.history import RequestHistory
from llmgw.server.gateway.limits import KeyLimits
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.usage import UsageBook
from llmgw.sim.config import SimConfig
from llmgw.sim.server import build_app
from tests.unit.gateway_rig import gateway_of, serving_of
from tests.unit.server.fakes import FakeStore, api_key
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(60)

KEY = "sk-alice"


@dataclasses.dataclass
class Rig:
    url: str
    client: openai.AsyncOpenAI
    http: aiohttp.ClientSession
    usage: UsageBook
    history: RequestHistory

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with self.http.post(self.url + path, json=body, headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)


def run(body: Callable[[Rig], Awaitable[None]], profiles: dict[str, dict[str, Any]]) -> None:
    """The gateway serving a sim model per entry of ``profiles`` (name -> stored profile),
    each with one replica on a sim engine of that name."""

    async def main() -> None:
        data_plane = web.Application()
        for index, name in enumerate(profiles):
            sim = build_app(SimConfig(model=name, seed=5, embedding_dim=32))
            data_plane.add_subapp(f"/s/s{index}/", sim)
        async with serving(data_plane) as dp_port:
            cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0)
            router = Router()
            models = []
            for index, (name, profile) in enumerate(profiles.items()):
                router.set_ready(
                    Endpoint(name, f"r{index}", f"s{index}", "n1", f"127.0.0.1:{dp_port}")
                )
                tasks = profile_tasks(profile)
                models.append(
                    ServedModel(
                        name,
                        profile["engine"],
                        tasks,
                        served_paths(profile["engine"], tasks),
                        profile_max_concurrency(profile),
                        None,
                    )
                )
            key = api_key("alice", KeyPolicy())[0]
            cache = serving_of(cfg, [key], models)
            store = FakeStore()
            limits = KeyLimits(budget_spent=lambda k, since: 0)
            usage = UsageBook(store, limits)
            history = RequestHistory()
            gateway = gateway_of(
                cfg, router, cache, key_limits=limits, usage=usage, history=history
            )
            app = web.Application()
            gateway.add_routes(app)
            app.on_cleanup.append(lambda _app: gateway.close())
            async with serving(app) as port, aiohttp.ClientSession() as http:
                url = f"http://127.0.0.1:{port}"
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
                try:
                    await body(Rig(url, client, http, usage, history))
                finally:
                    await client.close()

    asyncio.run(main())


SIM = {"m": {"engine": "sim"}}


def test_embeddings_through_the_gateway() -> None:
    async def body(rig: Rig) -> None:
        result = await rig.client.embeddings.create(model="m", input=["the river", "a road"])
        vectors = [e.embedding for e in result.data]
        assert [len(v) for v in vectors] == [32, 32]
        assert all(
            math.isclose(math.sqrt(sum(x * x for x in v)), 1.0, rel_tol=1e-6) for v in vectors
        )
        assert result.usage.prompt_tokens == 4

    run(body, SIM)


def test_responses_whole_and_streamed_through_the_gateway() -> None:
    async def body(rig: Rig) -> None:
        whole = await rig.client.responses.create(
            model="m", input="the river", max_output_tokens=64
        )
        assert whole.status == "completed" and whole.output_text
        stream = await rig.client.responses.create(
            model="m", input="the river", max_output_tokens=64, stream=True
        )
        events = [event async for event in stream]
        assert events[0].type == "response.created"
        assert events[-1].type == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == whole.output_text == events[-1].response.output_text  # type: ignore[union-attr]
        # The usage the gateway books: the whole response's, and the final event's.
        await asyncio.sleep(0.05)
        [row] = rig.usage.pending()
        assert whole.usage is not None
        assert (row.requests, row.completion_tokens) == (2, 2 * whole.usage.output_tokens)
        assert row.prompt_tokens == 2 * whole.usage.input_tokens

    run(body, SIM)


def test_the_history_counts_requests_and_the_ttft_of_streamed_answers() -> None:
    async def body(rig: Rig) -> None:
        await rig.client.responses.create(model="m", input="the river", max_output_tokens=8)
        await asyncio.sleep(0.05)
        [point] = [p for p in rig.history.series("m") if p.requests]
        # A whole answer is a request, without a TTFT.
        assert (point.requests, point.errors, point.ttft_p50) == (1, 0, None)
        stream = await rig.client.responses.create(
            model="m", input="the river", max_output_tokens=8, stream=True
        )
        _ = [event async for event in stream]
        await asyncio.sleep(0.05)
        points = [p for p in rig.history.series("m") if p.requests]
        assert sum(p.requests for p in points) == 2
        assert any(p.ttft_p50 is not None and 0 < p.ttft_p50 < 5 for p in points)
        assert rig.history.models() == ["m"]

    run(body, SIM)


def test_rerank_score_and_the_tokenizer_through_the_gateway() -> None:
    async def body(rig: Rig) -> None:
        status, answer = await rig.post(
            "/v1/rerank",
            {"model": "m", "query": "stone bridge", "documents": ["a river", "the stone bridge"]},
        )
        assert status == 200, answer
        assert [r["index"] for r in answer["results"]] == [1, 0]
        status, answer = await rig.post(
            "/v1/score", {"model": "m", "text_1": "stone", "text_2": ["stone", "river"]}
        )
        assert status == 200, answer
        assert [d["score"] for d in answer["data"]] == [1.0, 0.0]
        status, tokens = await rig.post("/tokenize", {"model": "m", "prompt": "the stone road"})
        assert status == 200 and tokens["count"] == 3
        status, text = await rig.post("/detokenize", {"model": "m", "tokens": tokens["tokens"]})
        assert (status, text) == (200, {"prompt": "the stone road"})

    run(body, SIM)


def test_rerank_and_score_answer_under_the_paths_vllm_also_serves() -> None:
    # vLLM's own examples post to /rerank; Cohere's clients to /v2/rerank.
    async def body(rig: Rig) -> None:
        docs = {"model": "m", "query": "stone bridge", "documents": ["a river", "the stone bridge"]}
        for path in ("/rerank", "/v2/rerank"):
            status, answer = await rig.post(path, docs)
            assert status == 200, (path, answer)
            assert [r["index"] for r in answer["results"]] == [1, 0]
        status, answer = await rig.post(
            "/score", {"model": "m", "text_1": "stone", "text_2": ["stone", "river"]}
        )
        assert status == 200, answer
        assert [d["score"] for d in answer["data"]] == [1.0, 0.0]
        # A model without the task is refused under the alias too, naming the endpoint.
        status, answer = await rig.post("/rerank", {**docs, "model": "chat"})
        assert status == 400, answer
        assert answer["error"]["code"] == "unsupported_endpoint"
        assert "model 'chat' does not serve /v1/rerank" in answer["error"]["message"]

    run(body, {"m": {"engine": "sim"}, "chat": {"engine": "sim", "task": ["generate"]}})


def test_a_model_deployed_for_another_task_is_refused_the_path() -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APIStatusError) as info:
            await rig.client.embeddings.create(model="chat", input="the river")
        assert "model 'chat' does not serve /v1/embeddings" in str(info.value)
        assert "task: [embed]" in str(info.value)
        # Its own task still goes through, and so does the embedding model's.
        await rig.client.responses.create(model="chat", input="hi")
        await rig.client.embeddings.create(model="embed", input="hi")

    run(
        body,
        {
            "chat": {"engine": "sim", "task": ["generate"]},
            "embed": {"engine": "sim", "task": "embed"},
        },
    )
