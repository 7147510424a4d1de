"""Disaggregated prefill and decode end to end (issue 41's tests): a real control plane and a
real agent running a sim model in two pools, two prefill and two decode replicas, the KV
cache pulled over TCP from the prefill's transfer port (inside the node's multinode_ports);
the official ``openai`` client through the gateway. For a fixed seed every answer (chat and
completions, streamed and not) is the aggregated model's, deployed beside it. Then the
faults: a prefill replica killed while it computes prompts (retried on the other), a decode
replica killed mid-stream (the streams resumed on the other), and a transfer that never
completes in time (the whole request run on a decode replica: the aggregated fallback). The
cluster is shared by the module; each fault's test leaves it whole again."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw.contracts.ports import PortRange
from tests.integration.continuity import metric_sum
from tests.integration.harness import (
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

MODEL = "pd"
AGG = "agg"
SLOW = "pd-slow"  # its transfers outlast its transfer_timeout
PORTS = "29700-29719"
# A prompt token's prefill costs 0.3 ms (one prefill at a time per replica): a 3,000-token
# prompt is computed for about a second, long enough for a kill to land mid-prefill.
PARAMS = {"tps": "200", "kv_bytes_per_token": "4096", "prefill_us_per_token": "300"}


@dataclass
class Cluster:
    tmp: Path
    server: Server
    agent: Agent
    clients: list[openai.OpenAI] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        c = openai.OpenAI(
            base_url=self.server.url + "/v1",
            api_key=self.server.api_key(),
            max_retries=0,
            timeout=120,
        )
        self.clients.append(c)
        return c

    def pool(self, role: str, model: str = MODEL) -> list[dict[str, Any]]:
        return [r for r in self.server.replicas(model) if r.get("routable") and r["role"] == role]

    def wait_whole(self, model: str = MODEL, timeout: float = 90) -> None:
        wait_for(
            lambda: len(self.pool("prefill", model)) == 2 and len(self.pool("decode", model)) == 2,
            timeout=timeout,
            what=f"two prefill and two decode replicas of {model} routable",
        )

    def engine_pid(self, replica: dict[str, Any]) -> int:
        return int(self.agent.shard_records()[replica["shard"]]["pid"])


def _pd(params: dict[str, str], timeout: str = "30s") -> dict[str, Any]:
    return {
        "engine": "sim",
        "params": params,
        "max_concurrency": 64,
        "disaggregated": {
            "prefill": {"gpus": 0, "replicas": 2},
            "decode": {"gpus": 0, "replicas": 2},
            "transfer_timeout": timeout,
        },
    }


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Generator[Cluster, None, None]:
    tmp = tmp_path_factory.mktemp("disagg")
    server = start_server(tmp)
    agent = start_agent(make_agent(tmp, server, "node-a", extra={"multinode_ports": PORTS}))
    c = Cluster(tmp, server, agent)
    try:
        server.approve_pending(1)
        slow = {**PARAMS, "kv_bytes_per_token": "65536", "kv_transfer_mibps": "1"}
        catalog = {
            MODEL: {"profiles": {"p": _pd(PARAMS)}},
            SLOW: {"profiles": {"p": _pd(slow, timeout="1s")}},
            AGG: {"profiles": {"p": {"engine": "sim", "params": PARAMS, "max_concurrency": 64}}},
        }
        server.api("PUT", "/api/catalog", {"models": catalog})
        server.api("POST", "/api/models", {"name": MODEL, "profile": "p"})
        server.api("POST", "/api/models", {"name": SLOW, "profile": "p"})
        server.api("POST", "/api/models", {"name": AGG, "profile": "p", "replicas": 1})
        c.wait_whole(MODEL)
        c.wait_whole(SLOW)
        wait_for(
            lambda: any(r.get("routable") for r in server.replicas(AGG)), what="the aggregated"
        )
        yield c
    finally:
        for client in c.clients:
            client.close()
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def _ask(
    client: openai.OpenAI,
    model: str,
    kind: str,
    stream: bool,
    seed: int,
    tokens: int = 24,
    prompt: str = "",
) -> tuple[str, Any]:
    text = prompt or f"a question to both pools, number {seed}"
    extra = {"ignore_eos": True}
    if kind == "chat":
        messages = [{"role": "user", "content": text}]
        if not stream:
            r = client.chat.completions.create(
                model=model, messages=messages, seed=seed, max_tokens=tokens, extra_body=extra
            )
            return r.choices[0].message.content or "", r.usage
        out, usage = "", None
        for chunk in client.chat.completions.create(
            model=model,
            messages=messages,
            seed=seed,
            max_tokens=tokens,
            extra_body=extra,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                out += choice.delta.content or ""
        return out, usage
    if not stream:
        c = client.completions.create(
            model=model, prompt=text, seed=seed, max_tokens=tokens, extra_body=extra
        )
        return c.choices[0].text, c.usage
    out, usage = "", None
    for chunk in client.completions.create(
        model=model,
        prompt=text,
        seed=seed,
        max_tokens=tokens,
        extra_body=extra,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            out += choice.text
    return out, usage


@pytest.mark.parametrize("kind", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_answer_is_the_aggregated_models(cluster: Cluster, kind: str, stream: bool) -> None:
    client = cluster.client()
    before = cluster.server.metrics()
    for seed in range(3):
        text, usage = _ask(client, MODEL, kind, stream, seed)
        alone, alone_usage = _ask(client, AGG, kind, stream, seed)
        assert text == alone, seed
        assert text
        assert usage.completion_tokens == alone_usage.completion_tokens == 24
        assert usage.prompt_tokens == alone_usage.prompt_tokens
    base = metric_sum(before, "llmgw_disagg_requests_total", model=MODEL, outcome="handed_over")

    def handed() -> int:
        after = cluster.server.metrics()
        count = metric_sum(after, "llmgw_disagg_requests_total", model=MODEL, outcome="handed_over")
        return count - base

    # Counted once the gateway has relayed the end, which the client may see a moment
    # before (so the last case's may land after this one's snapshot: at least three).
    wait_for(lambda: handed() >= 3, timeout=30, what="three hand-overs counted")
    after = cluster.server.metrics()
    for outcome in ("fallback", "failed"):
        assert metric_sum(after, "llmgw_disagg_requests_total", model=MODEL, outcome=outcome) == (
            metric_sum(before, "llmgw_disagg_requests_total", model=MODEL, outcome=outcome)
        ), outcome


def test_the_pools_are_not_models_a_client_names(cluster: Cluster) -> None:
    client = cluster.client()
    names = {m.id for m in client.models.list()}
    assert {MODEL, SLOW, AGG} <= names
    assert not any("#" in n for n in names)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model=f"{MODEL}#decode", messages=[{"role": "user", "content": "hi"}]
        )


def test_the_transfer_ports_are_inside_the_nodes_range(cluster: Cluster) -> None:
    ports = PortRange.parse(PORTS)
    seen = set()
    for role in ("prefill", "decode"):
        for r in cluster.pool(role):
            port = int(str(r["transfer_addr"]).rpartition(":")[2])
            assert ports.first <= port <= ports.last, r
            seen.add(port)
    assert len(seen) == 4


def _concurrently(n: int, work: Any) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * n

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    return errors


def test_a_decode_replica_killed_mid_stream_is_resumed(cluster: Cluster) -> None:
    client = cluster.client()
    tokens = 200  # a second at 200 tokens/s: the kill lands mid-answer
    texts: dict[int, str] = {}
    before = cluster.server.metrics()

    def work(i: int) -> None:
        texts[i], _ = _ask(client, MODEL, "chat", True, 100 + i, tokens=tokens)

    victim = cluster.pool("decode")[0]
    timer = threading.Timer(0.5, lambda: os.killpg(cluster.engine_pid(victim), signal.SIGKILL))
    timer.start()
    errors = _concurrently(8, work)
    timer.join()
    assert errors == [None] * 8
    for i, text in texts.items():
        alone, _ = _ask(client, AGG, "chat", False, 100 + i, tokens=tokens)
        assert text == alone, i
    after = cluster.server.metrics()
    # Counted under the pool the stream was resumed in.
    pool = f"{MODEL}#decode"
    assert metric_sum(after, "llmgw_stream_resumes_total", model=pool) > metric_sum(
        before, "llmgw_stream_resumes_total", model=pool
    )
    cluster.wait_whole()


def test_a_prefill_replica_killed_while_computing_is_retried(cluster: Cluster) -> None:
    client = cluster.client()
    before = cluster.server.metrics()
    texts: dict[int, str] = {}

    def long_prompt(i: int) -> str:  # each its own from its first token: none cached
        return f"request {i} " + " ".join(["word"] * 3000)

    def work(i: int) -> None:
        texts[i], _ = _ask(client, MODEL, "completions", False, 200 + i, prompt=long_prompt(i))

    victim = cluster.pool("prefill")[0]
    timer = threading.Timer(0.3, lambda: os.killpg(cluster.engine_pid(victim), signal.SIGKILL))
    timer.start()
    errors = _concurrently(6, work)
    timer.join()
    assert errors == [None] * 6
    for i, text in texts.items():
        alone, _ = _ask(client, AGG, "completions", False, 200 + i, prompt=long_prompt(i))
        assert text == alone, i
    after = cluster.server.metrics()
    assert metric_sum(after, "llmgw_disagg_prefill_retries_total", model=MODEL) > metric_sum(
        before, "llmgw_disagg_prefill_retries_total", model=MODEL
    )
    cluster.wait_whole()


def test_a_transfer_that_never_completes_runs_the_request_whole(cluster: Cluster) -> None:
    client = cluster.client()
    before = cluster.server.metrics()
    text, _ = _ask(client, SLOW, "chat", True, 7, prompt=" ".join(["word"] * 400))
    alone, _ = _ask(client, AGG, "chat", True, 7, prompt=" ".join(["word"] * 400))
    assert text == alone
    after = cluster.server.metrics()
    reason = "transfer_timeout"
    assert metric_sum(after, "llmgw_disagg_fallbacks_total", model=SLOW, reason=reason) == (
        metric_sum(before, "llmgw_disagg_fallbacks_total", model=SLOW, reason=reason) + 1
    )
