"""A stream survives its replica, end to end: 16 concurrent streams through the official
openai client to a model of three sim replicas behind a real control plane and agent; one
engine is killed with SIGKILL mid-stream. No stream breaks, each client's text is the
uninterrupted answer for its seed (the sim's own generator is the oracle), and each usage
is one stream's: the prompt once, every token of the answer."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from typing import Any

import openai
import pytest

from llmgw.sim.generate import draw, tokenize
from tests.integration.harness import make_agent, start_agent, start_server, stop_process, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MODEL = "talk"
STREAMS = 16
TOKENS = 40


def test_sixteen_streams_survive_a_killed_engine(tmp_path: Any) -> None:
    server = start_server(tmp_path)
    agent = start_agent(make_agent(tmp_path, server, "node-a"))
    try:
        wait_for(lambda: any(n["connected"] for n in server.nodes()), what="the agent")
        server.approve_pending(1)
        profile = {"engine": "sim", "max_concurrency": 16, "params": {"tps": "20"}}
        server.api("PUT", "/api/catalog", {"models": {MODEL: {"profiles": {"p": profile}}}})
        server.api("POST", "/api/models", {"name": MODEL, "profile": "p", "replicas": 3})
        wait_for(
            lambda: sum(1 for r in server.replicas(MODEL) if r["routable"]) == 3,
            timeout=60,
            what="three ready replicas",
        )
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key=server.api_key(), max_retries=0, timeout=60
        )
        texts: dict[int, str] = {}
        usages: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        started = threading.Semaphore(0)

        def stream(i: int) -> None:
            text, first = "", True
            try:
                for chunk in client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"question number {i}"}],
                    seed=i,
                    max_tokens=TOKENS,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                ):
                    if chunk.usage is not None:
                        usages[i] = chunk.usage
                    for choice in chunk.choices:
                        text += choice.delta.content or ""
                        if text and first:
                            first = False
                            started.release()
            except BaseException as exc:
                errors[i] = exc
                if first:
                    started.release()
            texts[i] = text

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        for _ in range(STREAMS):
            assert started.acquire(timeout=30)
        time.sleep(0.3)  # a few tokens into every stream (20 a second: 2 s each)
        victim = next(iter(agent.shard_records().values()))["pid"]
        os.killpg(victim, signal.SIGKILL)
        for t in threads:
            t.join(timeout=60)

        assert errors == {}
        for i in range(STREAMS):
            prompt = f"question number {i}"
            words, _ = draw(prompt, TOKENS, i, ignore_eos=True)
            assert texts[i] == "".join(words), i
            assert usages[i].prompt_tokens == len(tokenize(prompt)), i
            assert usages[i].completion_tokens == TOKENS, i
        exposition = server.metrics()
        resumed = re.findall(
            r'^llmgw_stream_resumes_total\{model="talk",cause="[a-z]+",outcome="completed"\} (\d+)',
            exposition,
            re.M,
        )
        assert sum(int(n) for n in resumed) >= 1, exposition
        assert "llmgw_streams_broken_total{" not in exposition
        print(f"\nstreams resumed after the engine's SIGKILL: {sum(int(n) for n in resumed)}")
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)
