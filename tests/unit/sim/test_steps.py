"""The sim engine's step model: prefill and decoding in one loop of steps, so a long prompt
stalls every stream on its replica (by its whole prefill, or a chunk a step with chunked
prefill), while the texts stay those of the engine without it."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from typing import Any

import aiohttp
import pytest
from click.testing import CliRunner

from llmgw.cli import engine as engine_cli
from llmgw.engines.launch import build_command, check_params
from llmgw.engines.spec import EngineSpec
from llmgw.errors import EngineError
from llmgw.sim.config import SimConfig
from llmgw.sim.generate import tokenize
from llmgw.sim.steps import StepLoop, StepPace
from tests.unit.sim.running import running

MODEL = "llmgw-sim"
TPS = 100.0  # 10 ms a step
PREFILL_US = 100.0  # a 4,000-token prompt: 0.4 s of prefill
LONG = 4000


def words(n: int, start: int = 0) -> str:
    vocab = ["river", "stone", "bridge", "road", "valley", "forest", "cloud", "music"]
    text = " ".join(vocab[(start + i) % len(vocab)] for i in range(n))
    assert len(tokenize(text)) == n
    return text


# ------------------------------------------------------------------ the loop itself


async def _stall(chunk: int) -> tuple[list[float], float, int]:
    """A stream decoding while a long prompt is prefilled: its gaps between tokens, the
    prompt's prefill time and the steps it spanned."""
    steps = StepLoop(1 / TPS, PREFILL_US / 1e6, chunk)
    steps.start()
    loop = asyncio.get_running_loop()
    times: list[float] = []
    pace = StepPace(steps, 0, 0.0)

    async def stream() -> None:
        try:
            for k in range(60):
                await pace.token(k)
                times.append(loop.time())
        finally:
            pace.close()

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.1)
    long = StepPace(steps, LONG, 0.0)
    at, before = loop.time(), steps.steps
    await long.token(0)
    took, spanned = loop.time() - at, steps.steps - before
    long.close()
    await task
    await steps.stop()
    return [b - a for a, b in itertools.pairwise(times)], took, spanned


def test_a_whole_prompt_stalls_a_stream_by_its_prefill() -> None:
    gaps, took, spanned = asyncio.run(_stall(0))
    assert took >= LONG * PREFILL_US / 1e6
    assert spanned <= 2  # one step (the one under way when it came may end first)
    assert max(gaps) >= LONG * PREFILL_US / 1e6  # every stream waited for it
    assert sorted(gaps)[len(gaps) // 2] < 0.1  # otherwise a token a step


def test_chunked_prefill_bounds_the_stall_per_step() -> None:
    chunk = 400  # 40 ms of prefill a step
    gaps, took, spanned = asyncio.run(_stall(chunk))
    assert spanned >= LONG // chunk  # spread over ten steps
    assert took >= LONG * PREFILL_US / 1e6  # the prompt pays all of it all the same
    assert max(gaps) < 0.25  # a step: 10 ms + 40 ms (generous for a shared machine)


def test_prompts_are_prefilled_in_arrival_order() -> None:
    async def go() -> list[str]:
        steps = StepLoop(0.001, 1e-4, 100)
        steps.start()
        done: list[str] = []

        async def one(name: str, tokens: int) -> None:
            pace = StepPace(steps, tokens, 0.0)
            await pace.token(0)
            done.append(name)
            pace.close()

        await asyncio.gather(one("first", 300), one("second", 50), one("cached", 0))
        await steps.stop()
        return done

    assert asyncio.run(go()) == ["first", "second", "cached"]


def test_an_idle_loop_runs_no_steps() -> None:
    async def go() -> int:
        steps = StepLoop(0.001, 0.0, 0)
        steps.start()
        pace = StepPace(steps, 0, 0.0)
        for k in range(3):
            await pace.token(k)
        pace.close()
        ran = steps.steps
        await asyncio.sleep(0.05)  # 50 steps' time with nothing to do
        idle = steps.steps - ran
        await steps.stop()
        return idle

    assert asyncio.run(go()) <= 1


# ------------------------------------------------------------------ through the engine


async def _stream_gaps(url: str, long_prompt: str) -> list[float]:
    """Stream a long answer; once it runs, send ``long_prompt``: the stream's token gaps."""
    loop = asyncio.get_running_loop()
    body = {
        "model": MODEL,
        "prompt": "a story",
        "max_tokens": 50,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    running_ = asyncio.Event()  # set once the stream is well under way
    async with aiohttp.ClientSession() as session:

        async def stream() -> None:
            async with session.post(f"{url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        times.append(loop.time())
                        if len(times) == 10:
                            running_.set()

        task = asyncio.create_task(stream())
        await running_.wait()
        long = {"model": MODEL, "prompt": long_prompt, "max_tokens": 1}
        async with session.post(f"{url}/v1/completions", json=long) as resp:
            assert resp.status == 200
            await resp.read()
        await task
    return [b - a for a, b in itertools.pairwise(times)]


def test_engine_stalls_its_streams_only_with_the_step_model() -> None:
    timing: dict[str, Any] = {"tps": TPS, "prefill_us_per_token": PREFILL_US}
    prompt = words(LONG)
    with running(SimConfig(port=0, step_model=True, **timing)) as url:
        stepped = asyncio.run(_stream_gaps(url, prompt))
    with running(SimConfig(port=0, step_model=True, prefill_chunk=256, **timing)) as url:
        chunked = asyncio.run(_stream_gaps(url, prompt))
    with running(SimConfig(port=0, **timing)) as url:
        laned = asyncio.run(_stream_gaps(url, prompt))
    assert max(stepped) >= LONG * PREFILL_US / 1e6
    assert max(chunked) < 0.25  # 10 ms + 25.6 ms a step
    assert max(laned) < 0.25  # each stream at its own pace: no interference


@pytest.mark.parametrize("stream", [False, True])
def test_the_step_model_changes_timing_not_text(stream: bool) -> None:
    async def answer(url: str) -> str:
        body = {"model": MODEL, "prompt": words(30), "max_tokens": 30, "seed": 5}
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{url}/v1/completions", json={**body, "stream": stream}) as resp,
        ):
            raw = await resp.text()
        if not stream:
            data = json.loads(raw)
            return data["choices"][0]["text"] + data["choices"][0]["finish_reason"]
        events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
        return "".join(c["text"] + (c["finish_reason"] or "") for e in events for c in e["choices"])

    with running(SimConfig(port=0, tps=500, step_model=True, prefill_chunk=7)) as url:
        stepped = asyncio.run(answer(url))
    with running(SimConfig(port=0, tps=500)) as url:
        laned = asyncio.run(answer(url))
    assert stepped == laned and stepped


def test_a_decode_with_pulled_blocks_steps_without_prefill() -> None:
    kv = {"kv_transfer_addr": "127.0.0.1:0", "tps": 200.0, "step_model": True}
    slow = {"prefill_us_per_token": 1000.0}  # 1 s for the 1,000-token prompt, if computed
    body = {"model": MODEL, "prompt": words(1000), "max_tokens": 3}

    async def go(p_url: str, d_url: str) -> tuple[float, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            prefill = {
                **body,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
            }
            async with session.post(f"{p_url}/v1/completions", json=prefill) as resp:
                params = (await resp.json())["kv_transfer_params"]
            start = time.monotonic()
            decode = {**body, "kv_transfer_params": params}
            async with session.post(f"{d_url}/v1/completions", json=decode) as resp:
                answer = await resp.json()
            return time.monotonic() - start, answer

    with running(SimConfig(port=0, **kv)) as p_url, running(SimConfig(port=0, **kv, **slow)) as d:
        took, answer = asyncio.run(go(p_url, d))
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 999
    assert took < 0.9  # generous: three 5 ms steps and a loopback pull


# ------------------------------------------------------------------ settings


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"step_model": True}, "step_model needs tps > 0"),
        ({"step_model": "yes", "tps": 1.0}, "step_model must be true or false"),
        ({"prefill_chunk": -1}, "prefill_chunk must be an integer >= 0"),
        ({"prefill_chunk": 2.5}, "prefill_chunk must be an integer >= 0"),
    ],
)
def test_bad_step_settings_are_refused(settings: dict[str, Any], says: str) -> None:
    with pytest.raises(EngineError, match=re.escape(says)):
        SimConfig(**settings)


def test_step_params_become_flags_the_engine_takes() -> None:
    params = {"step_model": "true", "prefill_chunk": "512"}
    check_params("sim", params)
    argv = build_command(EngineSpec(engine="sim", model="m", port=5, params=params)).argv
    assert argv[argv.index("--step-model") + 1] == "true"
    assert argv[argv.index("--prefill-chunk") + 1] == "512"
    with pytest.raises(EngineError, match="at least"):
        check_params("sim", {"prefill_chunk": "-1"})
    runner = CliRunner()
    refused = runner.invoke(engine_cli.engine, ["sim", "--step-model", "maybe"])
    assert refused.exit_code != 0 and "maybe" in refused.output
    refused = runner.invoke(engine_cli.engine, ["sim", "--step-model", "True", "--port", "0"])
    assert refused.exit_code != 0 and "step_model needs tps > 0" in refused.output
