"""The gateway for the people who call it, end to end: a real control plane, a real agent and
sim engines, the official ``openai`` client.

Every endpoint (chat, completions, responses streamed and not, embeddings; rerank, score and
tokenize over plain HTTP), a model that does not serve an endpoint, keys with policy (the
429s with OpenAI's headers, 403, the expired 401), ``ctl usage --json`` against what the
client counted, a control plane killed with SIGKILL losing at most its last flush, and fair
queueing on one replica at ``max_concurrency`` 4.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    LLMGW,
    Agent,
    Server,
    make_agent,
    start_agent,
    start_server_with,
    stop_process,
    wait_for,
)

pytestmark = pytest.mark.integration

CATALOG = {
    "models": {
        # Every task (sim's default), four requests at a time per replica.
        "sim": {"profiles": {"default": {"engine": "sim", "max_concurrency": 4}}},
        # Only generation: no embeddings, no rerank.
        "gen": {"profiles": {"default": {"engine": "sim", "task": ["generate"]}}},
        # 0.1 s before the first token: a replica that is easy to fill.
        "slow": {
            "profiles": {
                "default": {
                    "engine": "sim",
                    "max_concurrency": 4,
                    "params": {"ttft_ms": "100", "tps": "1000"},
                }
            }
        },
    }
}


@dataclass
class Cluster:
    server: Server
    agent: Agent
    tmp: Path

    def key(self, name: str, **policy: Any) -> str:
        return str(self.server.api("POST", "/api/keys", {"name": name, **policy})["key"])

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.server.url + "/v1", api_key=key, max_retries=0)

    def ctl(self, *args: str) -> Any:
        out = subprocess.run(
            [
                *LLMGW,
                "ctl",
                "--server",
                self.server.url,
                "--token",
                self.server.admin_token,
                "--json",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)


def start(tmp: Path, **server_keys: Any) -> tuple[Server, Agent]:
    server = start_server_with(tmp, **server_keys)
    agent = start_agent(make_agent(tmp, server, "node-a"))
    wait_for(lambda: any(n["connected"] for n in server.nodes()), what="the agent")
    server.approve_pending(1)
    return server, agent


def deploy(server: Server) -> None:
    server.api("PUT", "/api/catalog", CATALOG)
    for model in CATALOG["models"]:
        server.api("POST", "/api/models", {"name": model, "profile": "default", "replicas": 1})
    wait_for(
        lambda: (
            sorted(r["model"] for r in server.replicas() if r["routable"])
            == sorted(CATALOG["models"])
        ),
        timeout=60,
        what="a routable replica of each model",
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("gateway-api")
    server, agent = start(tmp, queue_timeout=20)
    try:
        deploy(server)
        yield Cluster(server, agent, tmp)
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def post(url: str, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


# --------------------------------------------------------------------------- endpoints


def test_every_endpoint_through_the_official_client(cluster: Cluster) -> None:
    key = cluster.key("endpoints")
    client = cluster.client(key)
    chat = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert chat.choices[0].message.content
    text = client.completions.create(model="sim", prompt="hello", max_tokens=8)
    assert text.choices[0].text

    emb = client.embeddings.create(model="sim", input=["one", "two"], dimensions=32)
    assert [len(d.embedding) for d in emb.data] == [32, 32]
    norm = sum(x * x for x in emb.data[0].embedding)
    assert abs(norm - 1.0) < 1e-3
    assert emb.data[0].embedding != emb.data[1].embedding
    assert emb.usage.prompt_tokens > 0

    resp = client.responses.create(model="sim", input="Say hello", max_output_tokens=16)
    assert resp.status in ("completed", "incomplete")
    assert resp.output_text and resp.usage is not None and resp.usage.output_tokens > 0

    kinds: list[str] = []
    deltas: list[str] = []
    with client.responses.stream(model="sim", input="Say hello", max_output_tokens=16) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = events.get_final_response()
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(deltas) == final.output_text

    url = cluster.server.url
    status, rerank, _ = post(
        url + "/v1/rerank",
        key,
        {"model": "sim", "query": "red apples", "documents": ["blue sky", "red apples grow"]},
    )
    assert status == 200, rerank
    assert rerank["results"][0]["index"] == 1
    status, score, _ = post(url + "/v1/score", key, {"model": "sim", "text_1": "a", "text_2": "a"})
    assert status == 200 and score["data"][0]["object"] == "score"
    status, tokens, _ = post(url + "/tokenize", key, {"model": "sim", "prompt": "hello there"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"])
    status, back, _ = post(url + "/detokenize", key, {"model": "sim", "tokens": tokens["tokens"]})
    assert status == 200 and back["prompt"] == "hello there"

    models = {m.id: m for m in client.models.list()}
    assert set(models) == {"sim", "gen", "slow"}
    one = client.models.retrieve("gen")
    assert one.id == "gen"


def test_a_model_that_does_not_serve_an_endpoint_says_what_it_serves(cluster: Cluster) -> None:
    client = cluster.client(cluster.key("gen-only"))
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="gen", input="x")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_endpoint"
    assert "does not serve /v1/embeddings" in error["message"]
    assert "/v1/chat/completions" in error["message"]
    assert "task" in error["message"]
    assert client.chat.completions.create(
        model="gen", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    ).choices


# --------------------------------------------------------------------------- keys


def test_policy_refusals_through_the_official_client(cluster: Cluster) -> None:
    limited = cluster.client(cluster.key("limited", rpm=2, models=["sim"]))
    for _ in range(2):
        raw = limited.chat.completions.with_raw_response.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
    with pytest.raises(openai.RateLimitError) as caught:
        limited.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.response.headers["retry-after"] == "30"
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert caught.value.code == "rate_limit_exceeded"
    with pytest.raises(openai.PermissionDeniedError, match="it may use sim"):
        limited.chat.completions.create(
            model="gen", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )

    broke = cluster.client(cluster.key("broke", budget="20/day"))
    with pytest.raises(openai.RateLimitError) as caught:
        for _ in range(20):  # each costs some tokens; the budget runs out
            broke.chat.completions.create(
                model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=8
            )
    assert caught.value.code == "insufficient_quota"


def test_concurrency_limit_counts_streams_until_their_last_chunk(cluster: Cluster) -> None:
    client = cluster.client(cluster.key("one-at-a-time", max_concurrent=1))
    # 3,000 tokens at the slow model's 1,000 a second: the stream is still running when the
    # second request arrives, however loaded the machine (32 tokens once ended in 30 ms, and
    # the second request sometimes came after).
    stream = client.chat.completions.create(
        model="slow",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3000,
        stream=True,
        extra_body={"min_tokens": 3000, "ignore_eos": True},
    )
    first = next(iter(stream))
    assert first is not None
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.code == "concurrency_limit_exceeded"
    for _ in stream:
        pass
    assert client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    ).choices


# --------------------------------------------------------------------------- usage


def test_ctl_usage_equals_what_the_client_counted(cluster: Cluster) -> None:
    client = cluster.client(cluster.key("counted"))
    prompt = completion = requests = 0
    for i in range(5):
        chat = client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=8
        )
        assert chat.usage is not None
        prompt += chat.usage.prompt_tokens
        completion += chat.usage.completion_tokens
        requests += 1
    stream = client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            prompt += chunk.usage.prompt_tokens
            completion += chunk.usage.completion_tokens
    requests += 1
    emb = client.embeddings.create(model="sim", input="count me")
    prompt += emb.usage.prompt_tokens
    requests += 1
    resp = client.responses.create(model="sim", input="and me", max_output_tokens=8)
    assert resp.usage is not None
    prompt += resp.usage.input_tokens
    completion += resp.usage.output_tokens
    requests += 1
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="gen", input="refused")
    requests += 1

    def counted() -> list[dict[str, Any]]:
        return [r for r in cluster.ctl("usage", "--key", "counted") if r["key"] == "counted"]

    rows = wait_for(lambda: counted() or None, what="the key's usage")
    by_model = {r["model"]: r for r in rows}
    assert sum(r["requests"] for r in rows) == requests
    assert sum(r["prompt_tokens"] for r in rows) == prompt
    assert sum(r["completion_tokens"] for r in rows) == completion
    assert by_model["gen"]["errors"] == 1 and by_model["sim"]["errors"] == 0
    shown = cluster.ctl("keys", "show", "counted")
    assert shown["usage"]["today"]["requests"] == requests
    metrics = cluster.server.metrics()
    assert 'llmgw_key_requests_total{key="counted",model="sim",code="200"} 8' in metrics


def test_a_stream_without_include_usage_is_charged_its_prompt_against_the_budget(
    cluster: Cluster,
) -> None:
    """Issue 36: such a stream used to be charged its completion tokens only (5 streams of
    108k prompt tokens cost 5 tokens of a 2k budget). The gateway asks the engine for the
    usage and keeps the chunk from a client that did not ask."""
    client = cluster.client(cluster.key("streamer", budget="6k/day"))
    messages: Any = [{"role": "user", "content": " ".join(["the river runs to the sea"] * 430)}]
    whole = client.chat.completions.create(model="sim", messages=messages, max_tokens=8)
    assert whole.usage is not None and whole.usage.prompt_tokens > 3000
    chunks = list(
        client.chat.completions.create(model="sim", messages=messages, max_tokens=8, stream=True)
    )
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "insufficient_quota"
    rows = wait_for(
        lambda: (
            [r for r in cluster.ctl("usage", "--key", "streamer") if r["requests"] >= 3] or None
        ),
        what="the key's usage",
    )
    assert sum(r["prompt_tokens"] for r in rows) == 2 * whole.usage.prompt_tokens


def test_metrics_and_healthz_say_less_to_strangers(cluster: Cluster) -> None:
    url = cluster.server.url
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url + "/metrics", timeout=10)
    assert refused.value.code == 401
    assert "llmgw_requests_total" in cluster.server.metrics()  # STATE/metrics.token
    as_admin = urllib.request.Request(
        url + "/metrics", headers={"Authorization": f"Bearer {cluster.server.admin_token}"}
    )
    with urllib.request.urlopen(as_admin, timeout=10) as resp:
        assert resp.status == 200
    with urllib.request.urlopen(url + "/healthz", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok", "role": "leader"}


def test_a_control_plane_killed_loses_at_most_its_last_flush(tmp_path: Path) -> None:
    server, agent = start(tmp_path)
    try:
        server.api("POST", "/api/models", {"name": "m", "engine": "sim", "replicas": 1})
        wait_for(
            lambda: any(r["routable"] for r in server.replicas("m")), timeout=60, what="replica"
        )
        key = server.api_key("killed")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        done: list[float] = []
        stop = threading.Event()

        def send() -> None:
            while not stop.is_set():
                try:
                    client.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1
                    )
                except openai.APIError:
                    return
                done.append(time.monotonic())

        with ThreadPoolExecutor(2) as pool:
            for _ in range(2):
                pool.submit(send)
            time.sleep(3.0)
            killed_at = time.monotonic()
            os.kill(server.proc.pid, signal.SIGKILL)
            server.proc.wait(10)
            stop.set()
        answered = [t for t in done if t <= killed_at]
        assert len(answered) > 20
        # Started again on the same state: what the usage holds.
        restarted = subprocess.Popen(
            [*LLMGW, "server", "--config", str(tmp_path / "server.yaml")],
            stdout=open(tmp_path / "server2.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        server.proc = restarted
        wait_for(lambda: _healthy(server), what="the restarted control plane")
        rows = server.api("GET", "/api/usage?key=killed")
        stored = sum(r["requests"] for r in rows)
        # Everything answered up to one flush interval (1 s) before the kill was stored; a
        # second more of slack for a flush that was running when the kill struck.
        assert stored >= len([t for t in answered if t <= killed_at - 2.0]), (stored, len(answered))
        assert stored <= len(done)
    finally:
        if agent.proc is not None:
            stop_process(agent.proc)
        stop_process(server.proc)


def _healthy(server: Server) -> bool:
    try:
        with urllib.request.urlopen(server.url + "/healthz", timeout=1) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


# --------------------------------------------------------------------------- fairness


def test_a_lone_caller_is_served_within_a_few_requests_of_a_flood(cluster: Cluster) -> None:
    """max_concurrency 4 on one replica; key A keeps 40 requests queued while key B sends one
    at a time: each of B's waits for a few requests, not for A's queue (40 x 0.1 s / 4)."""
    flood = cluster.client(cluster.key("flood"))
    lone = cluster.client(cluster.key("lone"))
    stop = threading.Event()

    def keep_busy() -> None:
        while not stop.is_set():
            try:
                flood.chat.completions.create(
                    model="slow", messages=[{"role": "user", "content": "x"}], max_tokens=1
                )
            except openai.APIError:
                time.sleep(0.05)

    waits: list[float] = []
    with ThreadPoolExecutor(44) as pool:
        for _ in range(44):  # 4 in flight, 40 waiting
            pool.submit(keep_busy)
        try:
            wait_for(lambda: _queued(cluster.server, "slow") >= 30, timeout=30, what="a's queue")
            for _ in range(5):
                started = time.monotonic()
                lone.chat.completions.create(
                    model="slow", messages=[{"role": "user", "content": "x"}], max_tokens=1
                )
                waits.append(time.monotonic() - started)
        finally:
            stop.set()
    # A's whole queue is 40 x 0.1 s / 4 = 1 s; one request takes 0.1 s. Generous: < 0.6 s.
    assert max(waits) < 0.6, waits


def _queued(server: Server, model: str) -> float:
    text = server.metrics()
    for line in text.splitlines():
        if line.startswith(f'llmgw_queued_requests{{model="{model}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
