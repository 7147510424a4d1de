"""A disaggregated sim model end to end through the gateway with the official ``openai``
client: real prefill and decode sim engines (``--kv-transfer-addr``: the decode pulls the
prompt's KV blocks from the prefill over TCP, as vLLM's NixlConnector does), chat and
completions, streamed and not; for a seed the text equals the aggregated sim's."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from aiohttp import web

from llmgw.contracts.endpoints import served_paths
from llmgw.server.common.config import load_server_config
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.serving import Handover, ServedModel
from llmgw.sim.config import SimConfig
from tests.unit.server.disagg_gateway_rig import gateway_serving
from tests.unit.server.resume_rig import Breaker, proxy
from tests.unit.serving import serving
from tests.unit.sim.running import running

pytestmark = pytest.mark.timeout(120)

SEED = 3
PROMPT = "river stone bridge road valley forest cloud music " * 6


def kv_sim() -> SimConfig:
    return SimConfig(port=0, model="m", seed=SEED, kv_transfer_addr="127.0.0.1:0")


@contextlib.contextmanager
def sims() -> Iterator[tuple[str, str, str]]:
    """A prefill, a decode and an aggregated sim engine; their base URLs."""
    with (
        running(kv_sim()) as prefill,
        running(kv_sim()) as decode,
        running(SimConfig(port=0, model="m", seed=SEED)) as whole,
    ):
        yield prefill, decode, whole


def pulls(url: str) -> float:
    """The decode engine's KV pulls so far (its /metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("llmgw_sim_kv_pulls_total "):
                return float(line.split()[1])
    return 0.0


async def ask(client: openai.AsyncOpenAI, chat: bool, stream: bool) -> str:
    common: dict[str, Any] = {"model": "m", "max_tokens": 24, "stream": stream}
    if chat:
        messages: Any = [{"role": "user", "content": PROMPT}]
        answer: Any = await client.chat.completions.create(messages=messages, **common)
    else:
        answer = await client.completions.create(prompt=PROMPT, **common)
    if not stream:
        choice = answer.choices[0]
        return str(choice.message.content if chat else choice.text)
    text = ""
    async for chunk in answer:
        for choice in chunk.choices:
            text += (choice.delta.content if chat else choice.text) or ""
    return text


def test_a_disaggregated_sim_model_answers_as_the_aggregated_one() -> None:
    with sims() as (prefill, decode, whole):

        async def main() -> None:
            data_plane = web.Application()
            data_plane.add_subapp("/s/p0/", proxy(prefill, Breaker(left=0)))
            data_plane.add_subapp("/s/d0/", proxy(decode, Breaker(left=0)))
            async with serving(data_plane) as dp_port:
                cfg = dataclasses.replace(load_server_config(None), replica_wait=0.0)
                router = Router()
                addr = f"127.0.0.1:{dp_port}"
                router.set_ready(Endpoint("m#prefill", "p0", "p0", "n0", addr))
                router.set_ready(Endpoint("m#decode", "d0", "d0", "n0", addr))
                paths = served_paths("sim", ("generate",))
                handover = Handover("m#prefill", "m#decode", "vllm", 10.0)
                models = [
                    ServedModel("m", "sim", ("generate",), paths, 8, None, handover=handover),
                    ServedModel("m#prefill", "sim", ("generate",), paths, 8, None),
                    ServedModel("m#decode", "sim", ("generate",), paths, 8, None),
                ]
                async with gateway_serving(cfg, router, models) as (_, metrics, through, _port):
                    direct = openai.AsyncOpenAI(base_url=f"{whole}/v1", api_key="x", max_retries=0)
                    try:
                        for chat in (True, False):
                            for stream in (False, True):
                                before = await asyncio.to_thread(pulls, decode)
                                got = await ask(through, chat, stream)
                                assert got, (chat, stream)
                                assert got == await ask(direct, chat, stream), (chat, stream)
                                # The decode pulled the prompt's KV from the prefill.
                                assert await asyncio.to_thread(pulls, decode) == before + 1
                    finally:
                        await direct.close()
                counted = {k: v for k, v in metrics.disagg_requests.values.items() if v}
                assert counted == {("m", "handed_over"): 4}
                assert not any(metrics.disagg_fallbacks.values.values())

        asyncio.run(main())
