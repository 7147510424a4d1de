"""Streams under faults, for tests/integration/test_stream_resume.py and bench/continuity.py:
a control plane and three agents (three nodes on this machine), a sim model of three
replicas spread over them, many concurrent streams through the official ``openai`` client,
and the faults of issue 40 dealt while the streams are mid-answer:

- ``engine``: one engine killed with SIGKILL (its agent lives, relays the error, and starts
  the shard again);
- ``agent``: one agent killed with SIGKILL. The process runtime starts each engine in a
  session of its own (``start_new_session``), so its engine lives on; but the gateway reaches
  engines through their agent's data plane, which died with it: the streams through it
  break (the connection reset) and are resumed elsewhere. The agent started again adopts the
  engine (the same pid) and its replica is routable again;
- ``node``: the agent and its engines killed together, as when the node is lost (on one
  machine the connections are reset at once; a node that vanishes silently is the gateway's
  ``upstream_idle_timeout``, not tested here). The agent started again finds its engine gone
  and the control plane's replica is started anew.

Each stream's oracle is the sim's own generator: for its seed, the uninterrupted text.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from llmgw.sim.generate import draw, tokenize
from tests.integration.harness import (
    Agent,
    Server,
    alive,
    make_agent,
    start_agent,
    start_server,
    stop_process,
    wait_for,
)

MODEL = "talk"
NODES = ("node-a", "node-b", "node-c")
FAULTS = ("engine", "agent", "node")


@dataclass
class Fleet:
    tmp: Path
    server: Server
    agents: list[Agent]

    def routable(self) -> int:
        return sum(1 for r in self.server.replicas(MODEL) if r["routable"])

    def wait_whole(self, timeout: float = 90) -> None:
        """Every agent connected and three replicas routable again (after a fault)."""
        wait_for(
            lambda: (
                sum(1 for n in self.server.nodes() if n["connected"]) == len(self.agents)
                and self.routable() == 3
            ),
            timeout=timeout,
            what="three agents and three routable replicas",
        )

    def stop(self) -> None:
        for agent in self.agents:
            if agent.proc is not None:
                stop_process(agent.proc)
        stop_process(self.server.proc)
        for agent in self.agents:  # the engines of an agent killed and not started again
            for pid in engine_pids(agent).values():
                if alive(pid):
                    kill_group(pid)


def start_fleet(tmp: Path, *, tps: int) -> Fleet:
    """A control plane, three agents, and three replicas of MODEL (one on each node)."""
    server = start_server(tmp)
    fleet = Fleet(tmp, server, [])
    try:
        for node in NODES:
            fleet.agents.append(start_agent(make_agent(tmp, server, node)))
        wait_for(
            lambda: sum(1 for n in server.nodes() if n["connected"]) == len(NODES),
            what="three agents",
        )
        server.approve_pending(len(NODES))
        profile = {
            "engine": "sim",
            "placement": "spread",
            "max_concurrency": 128,
            "params": {"tps": str(tps)},
        }
        server.api("PUT", "/api/catalog", {"models": {MODEL: {"profiles": {"p": profile}}}})
        server.api("POST", "/api/models", {"name": MODEL, "profile": "p", "replicas": 3})
        fleet.wait_whole(timeout=90)
        nodes = {r["node_id"] for r in server.replicas(MODEL) if "node_id" in r}
        assert not nodes or len(nodes) == 3, nodes  # spread: one on each node
    except BaseException:
        fleet.stop()
        raise
    return fleet


def engine_pids(agent: Agent) -> dict[str, int]:
    return {sid: int(rec["pid"]) for sid, rec in agent.shard_records().items()}


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def deal(fleet: Fleet, fault: str, agent: Agent) -> dict[str, int]:
    """``fault`` dealt to ``agent``'s node; the engine pids it had."""
    pids = engine_pids(agent)
    assert pids, f"{agent.node_id} runs no engine"
    if fault == "engine":
        kill_group(next(iter(pids.values())))
    elif fault in ("agent", "node"):
        assert agent.proc is not None
        agent.proc.kill()
        agent.proc.wait(timeout=10)
        if fault == "node":
            for pid in pids.values():
                kill_group(pid)
    else:
        raise ValueError(f"unknown fault {fault!r}; one of {', '.join(FAULTS)}")
    return pids


def recover(fleet: Fleet, fault: str, agent: Agent) -> None:
    """After ``fault``: the agent started again where it was killed; the fleet whole."""
    if fault in ("agent", "node"):
        start_agent(agent)
    fleet.wait_whole()


def prompt_of(i: int) -> str:
    return f"question number {i}"


def expected(i: int, tokens: int) -> str:
    """The uninterrupted answer to stream ``i`` (its seed is ``i``)."""
    words, _ = draw(prompt_of(i), tokens, i, ignore_eos=True)
    return "".join(words)


def prompt_tokens(i: int) -> int:
    return len(tokenize(prompt_of(i)))


@dataclass
class Stream:
    i: int
    n: int = 1
    text: str = ""
    ids: set[str] = field(default_factory=set)
    usage: Any = None
    error: BaseException | None = None
    times: list[float] = field(default_factory=list)  # when each content chunk came

    def largest_gap(self) -> float:
        return max((b - a for a, b in zip(self.times, self.times[1:], strict=False)), default=0.0)


def run_streams(
    url: str,
    key: str,
    count: int,
    tokens: int,
    fault: Callable[[], object] | None,
    *,
    n_two: int = 0,
    after_s: float = 0.3,
) -> list[Stream]:
    """``count`` streams of ``tokens`` (and ``n_two`` streams with n=2) at once; once every
    one has its first token and ``after_s`` passed, ``fault`` is dealt; all joined."""
    client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)
    streams = [Stream(i) for i in range(count)] + [Stream(count + j, n=2) for j in range(n_two)]
    started = threading.Semaphore(0)

    def run(s: Stream) -> None:
        first = True
        try:
            for chunk in client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": prompt_of(s.i)}],
                seed=s.i,
                max_tokens=tokens,
                n=s.n,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                s.ids.add(chunk.id)
                if chunk.usage is not None:
                    s.usage = chunk.usage
                for choice in chunk.choices:
                    if choice.delta.content:
                        s.times.append(time.monotonic())
                        if choice.index == 0:
                            s.text += choice.delta.content
                        if first:
                            first = False
                            started.release()
        except BaseException as exc:  # the client's error: what the test reports
            s.error = exc
        if first:
            started.release()

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    for _ in streams:
        assert started.acquire(timeout=60), "a stream had no first token in 60 s"
    if fault is not None:
        time.sleep(after_s)
        fault()
    for t in threads:
        t.join(timeout=120)
    client.close()
    return streams


def metric_sum(exposition: str, name: str, **labels: str) -> int:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} ([0-9.e+]+)$", exposition, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += int(float(match.group(2)))
    return total


def resumed_ids(log: str) -> set[str]:
    """The ids of the streams the gateway resumed (its log says each, by the stream's id)."""
    return set(re.findall(r"msg=\"a stream broke; resuming it.*?request=(\S+)", log))
