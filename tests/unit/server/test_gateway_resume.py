"""A stream that breaks after its first tokens goes on on another replica, in front of real
``sim`` engines: the client's text is the uninterrupted one for its seed, its id and usage
are one stream's; what cannot be resumed ends with the error event as before.

Each replica's data plane is a stand-in that relays its own sim engine and, while the test's
:class:`Breaker` has breaks left, breaks the stream after ``after`` content events: as the
agent does when its engine dies (an error event, then the end of the body), by resetting
the connection, or by ending without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest
from aiohttp import web

from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.keypolicy import KeyPolicy
from llmgw.server.common.config import load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import ServedModel
from llmgw.sim.config import SimConfig
from llmgw.sim.server import build_app
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
from tests.unit.serving import serving

pytestmark = pytest.mark.timeout(60)


@dataclasses.dataclass
class Rig:
    client: openai.AsyncOpenAI
    metrics: Metrics
    breaker: Breaker
    direct: openai.AsyncOpenAI  # one sim engine, straight: the uninterrupted answers


def run(
    body: Callable[[Rig], Awaitable[None]],
    *,
    replicas: int = 2,
    engine: str = "sim",
    breaker: Breaker | None = None,
    max_resumes: int | None = None,
    policy: KeyPolicy | None = None,
) -> None:
    breaker = breaker or Breaker()

    async def main() -> None:
        async with SimEngines(replicas) as engine_urls:
            data_plane = web.Application()
            for i, url in enumerate(engine_urls):
                data_plane.add_subapp(f"/s/s{i}/", proxy(url, breaker))
            async with serving(data_plane) as dp_port:
                cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0)
                router = Router()
                for i in range(replicas):
                    router.set_ready(
                        Endpoint("m", f"r{i}", f"s{i}", f"n{i}", f"127.0.0.1:{dp_port}")
                    )
                served = ServedModel(
                    "m",
                    engine,
                    ("generate",),
                    served_paths("sim", ("generate",)),
                    8,
                    None,
                    max_resumes=max_resumes,
                )
                metrics = Metrics()
                gateway = gateway_of(
                    cfg,
                    router,
                    serving_of(cfg, [api_key("alice", policy or KeyPolicy())[0]], [served]),
                    metrics=metrics,
                )
                app = web.Application()
                gateway.add_routes(app)
                app.on_cleanup.append(lambda _app: gateway.close())
                async with serving(app) as port:
                    client = openai.AsyncOpenAI(
                        base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0
                    )
                    direct = openai.AsyncOpenAI(
                        base_url=engine_urls[0] + "/v1", api_key="x", max_retries=0
                    )
                    try:
                        await body(Rig(client, metrics, breaker, direct))
                    finally:
                        await client.close()
                        await direct.close()

    asyncio.run(main())


class SimEngines:
    """``count`` sim engines (seed 5), each on its own port; their base URLs."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.stack: list[Any] = []

    async def __aenter__(self) -> list[str]:
        urls = []
        for _ in range(self.count):
            cm = serving(build_app(SimConfig(model="m", seed=5, tps=0)))
            port = await cm.__aenter__()
            self.stack.append(cm)
            urls.append(f"http://127.0.0.1:{port}")
        return urls

    async def __aexit__(self, *exc: object) -> None:
        for cm in reversed(self.stack):
            await cm.__aexit__(None, None, None)


@pytest.mark.parametrize("mode", ["error", "reset", "eof"])
def test_a_broken_chat_stream_goes_on_with_the_same_text(mode: str) -> None:
    async def body(rig: Rig) -> None:
        whole, _, whole_usage, whole_finish = await chat_stream(rig.direct, seed=9, max_tokens=40)
        text, ids, usage, finish = await chat_stream(rig.client, seed=9, max_tokens=40)
        assert rig.breaker.left == 0  # it did break
        assert text == whole and finish == whole_finish
        assert len(ids) == 1  # one stream: the first part's id throughout
        assert usage.prompt_tokens == whole_usage.prompt_tokens
        assert usage.completion_tokens == whole_usage.completion_tokens
        assert usage.total_tokens == whole_usage.total_tokens
        cause = {"error": "error", "reset": "reset", "eof": "eof"}[mode]
        assert resumes(rig.metrics) == {("m", cause, "completed"): 1}
        assert broken(rig.metrics) == {}

    run(body, breaker=Breaker(after=3, mode=mode))


def test_the_client_that_did_not_ask_for_usage_gets_none() -> None:
    async def body(rig: Rig) -> None:
        whole = await rig.direct.chat.completions.create(model="m", messages=MESSAGES, seed=3)
        stream = await rig.client.chat.completions.create(
            model="m", messages=MESSAGES, seed=3, stream=True
        )
        chunks = [c async for c in stream]
        assert all(c.choices for c in chunks)  # no usage chunk
        assert (
            "".join(c.choices[0].delta.content or "" for c in chunks)
            == whole.choices[0].message.content
        )
        assert sum(1 for c in chunks if c.choices[0].delta.role) == 1  # one role chunk

    run(body, breaker=Breaker(after=1))


def test_a_broken_completions_stream_goes_on() -> None:
    async def body(rig: Rig) -> None:
        whole = await rig.direct.completions.create(
            model="m", prompt="Q: a tale\nA:", seed=4, max_tokens=30
        )
        stream = await rig.client.completions.create(
            model="m", prompt="Q: a tale\nA:", seed=4, max_tokens=30, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        assert rig.breaker.left == 0
        assert text == whole.choices[0].text
        assert resumes(rig.metrics) == {("m", "error", "completed"): 1}

    run(body, breaker=Breaker(after=4))


def test_it_is_resumed_at_most_max_resumes_times() -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APIError, match="engine went away"):
            await chat_stream(rig.client, seed=9, max_tokens=40)
        assert resumes(rig.metrics) == {("m", "error", "broken"): 1}
        assert broken(rig.metrics) == {("m", "max_resumes"): 1}

    run(body, replicas=3, breaker=Breaker(after=2, left=3), max_resumes=1)


def test_no_other_replica_ends_it_with_an_error() -> None:
    async def body(rig: Rig) -> None:
        # The error the client would have had, and why it was not resumed.
        with pytest.raises(openai.APIError, match=r"engine went away; no other replica of m"):
            await chat_stream(rig.client, seed=9, max_tokens=40)
        assert resumes(rig.metrics) == {("m", "error", "no_replica"): 1}
        assert broken(rig.metrics) == {("m", "no_replica"): 1}

    run(body, replicas=1)


@pytest.mark.parametrize(
    ("kw", "engine", "max_resumes", "reason", "mode"),
    [
        ({"n": 2}, "sim", None, "n", "error"),
        ({"logprobs": True}, "sim", None, "logprobs", "error"),
        ({}, "llamacpp", None, "engine", "error"),
        # Resume off: the gateway reads nothing of the stream; what it sees is the connection.
        ({}, "sim", 0, "off", "reset"),
    ],
)
def test_what_is_not_resumed_ends_with_the_error_event(
    kw: dict[str, Any], engine: str, max_resumes: int | None, reason: str, mode: str
) -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APIError, match=r"engine went away|ended early"):
            await chat_stream(rig.client, seed=9, max_tokens=40, **kw)
        assert rig.breaker.left == 0
        assert resumes(rig.metrics) == {}
        assert broken(rig.metrics) == {("m", reason): 1}

    run(body, engine=engine, max_resumes=max_resumes, breaker=Breaker(mode=mode))


def test_a_key_with_resume_off_ends_its_broken_stream() -> None:
    """Off for the key wins over the profile's on (here the default)."""

    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APIError, match="ended early"):
            await chat_stream(rig.client, seed=9, max_tokens=40)
        assert rig.breaker.left == 0
        assert resumes(rig.metrics) == {}
        assert broken(rig.metrics) == {("m", "off"): 1}

    run(body, breaker=Breaker(mode="reset"), policy=KeyPolicy(resume=False))


def retries(metrics: Metrics) -> dict[tuple[str, ...], float]:
    return dict(metrics.request_retries.values)


@pytest.mark.parametrize(("how", "cause"), [("engine", "engine_reset"), ("cut", "reset")])
def test_a_non_streamed_answer_that_failed_is_retried_whole(how: str, cause: str) -> None:
    async def body(rig: Rig) -> None:
        whole = await rig.direct.chat.completions.create(
            model="m", messages=MESSAGES, seed=9, max_tokens=30
        )
        got = await rig.client.chat.completions.create(
            model="m", messages=MESSAGES, seed=9, max_tokens=30
        )
        assert rig.breaker.left == 0 and rig.breaker.answers == 2
        assert got.choices[0].message.content == whole.choices[0].message.content
        assert got.usage is not None and whole.usage is not None
        assert got.usage.total_tokens == whole.usage.total_tokens  # the second answer's only
        assert retries(rig.metrics) == {("m", cause, "answered"): 1}
        assert resumes(rig.metrics) == {}

    run(body, breaker=Breaker(answer=how))


@pytest.mark.parametrize(
    ("how", "policy", "max_resumes", "replicas"),
    [
        ("old_agent", None, None, 2),  # an older agent does not say the engine failed
        ("engine", KeyPolicy(resume=False), None, 2),  # off for the key
        ("cut", None, 0, 2),  # off for the profile
        ("engine", None, None, 1),  # no other replica
    ],
)
def test_a_failed_answer_that_is_not_retried_is_the_clients_502(
    how: str, policy: KeyPolicy | None, max_resumes: int | None, replicas: int
) -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APIStatusError) as caught:
            await rig.client.chat.completions.create(model="m", messages=MESSAGES, seed=9)
        assert caught.value.status_code == 502
        assert rig.breaker.answers == 1
        assert retries(rig.metrics) == {}

    run(
        body,
        replicas=replicas,
        breaker=Breaker(answer=how),
        max_resumes=max_resumes,
        policy=policy,
    )


def test_a_failed_answer_is_retried_at_most_max_resumes_times() -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APIStatusError) as caught:
            await rig.client.chat.completions.create(model="m", messages=MESSAGES, seed=9)
        assert caught.value.status_code == 502
        assert rig.breaker.answers == 2  # the first, and one retry
        assert retries(rig.metrics) == {("m", "engine_reset", "failed"): 1}

    run(body, replicas=3, breaker=Breaker(answer="engine", left=3), max_resumes=1)


def test_a_client_that_went_away_is_not_retried_for() -> None:
    """A client-side disconnect is not a fault: nothing is sent again for it."""

    async def body(rig: Rig) -> None:
        with pytest.raises(openai.APITimeoutError):
            await rig.client.with_options(timeout=0.3).chat.completions.create(
                model="m", messages=MESSAGES, seed=9
            )
        await asyncio.sleep(1.0)  # past the replica's failure
        assert rig.breaker.answers == 1
        assert retries(rig.metrics) == {}

    run(body, breaker=Breaker(answer="engine", delay=0.6))
