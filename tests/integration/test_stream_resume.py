"""A stream survives its replica, end to end (issue 40's tests): 64 concurrent streams
through the official openai client to a model of three sim replicas, one on each of three
nodes (agents) behind a real control plane; in turn one engine is killed with SIGKILL, one
agent (its engine lives on, in a session of its own, and is adopted when the agent starts
again), and a whole node (its agent and its engine). No stream breaks, each client's text
is the uninterrupted answer for its seed (the sim's own generator is the oracle), and each
usage is one stream's: the prompt once, every token of the answer. A stream that cannot be
resumed (n=2) ends with the error event as before. The cluster is shared by the module:
each fault's test leaves it whole again (tests/integration/continuity.py)."""

from __future__ import annotations

from collections.abc import Generator

import openai
import pytest

from tests.integration.continuity import (
    Fleet,
    deal,
    engine_pids,
    expected,
    metric_sum,
    prompt_tokens,
    recover,
    resumed_ids,
    run_streams,
    start_fleet,
)
from tests.integration.harness import alive, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

STREAMS = 64
TOKENS = 40
TPS = 40  # a second per stream: the fault lands mid-answer


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Generator[Fleet, None, None]:
    fleet = start_fleet(tmp_path_factory.mktemp("resume"), tps=TPS)
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.mark.parametrize(("fault", "node"), [("engine", 0), ("agent", 1), ("node", 2)])
def test_sixty_four_streams_survive(fleet: Fleet, fault: str, node: int) -> None:
    server = fleet.server
    agent = fleet.agents[node]
    before, logged = server.metrics(), len(server.log())
    killed: dict[str, int] = {}
    streams = run_streams(
        server.url + "/v1",
        server.api_key(),
        STREAMS,
        TOKENS,
        lambda: killed.update(deal(fleet, fault, agent)),
    )
    after = server.metrics()

    assert {s.i: s.error for s in streams if s.error is not None} == {}
    for s in streams:
        assert s.text == expected(s.i, TOKENS), s.i
        assert len(s.ids) == 1, s.i  # one stream: its first part's id throughout
        assert s.usage.prompt_tokens == prompt_tokens(s.i), s.i
        assert s.usage.completion_tokens == TOKENS, s.i
    resumed = metric_sum(after, "llmgw_stream_resumes_total", outcome="completed")
    resumed -= metric_sum(before, "llmgw_stream_resumes_total", outcome="completed")
    assert resumed >= 1, after  # the fault did break streams
    assert metric_sum(after, "llmgw_streams_broken_total") == metric_sum(
        before, "llmgw_streams_broken_total"
    )
    # Each logged by the stream's id (the sim's ids are its seed's: the same in every test).
    ids = {next(iter(s.ids)) for s in streams}
    wait_for(
        lambda: len(resumed_ids(server.log()[logged:]) & ids) >= resumed,
        timeout=10,
        what="each resume in the log",
    )
    # (On a loaded machine the log has named a few more streams than the metric's
    # completed resumes, 2-13 of 20: not explained yet.)
    assert len(resumed_ids(server.log()[logged:]) & ids) >= resumed
    print(f"\n{fault}: {resumed} of {STREAMS} streams resumed, none broken")

    (pid,) = killed.values()
    if fault == "agent":
        # The engine outlived its agent; the agent started again adopts it.
        assert alive(pid)
    recover(fleet, fault, agent)
    if fault == "agent":
        assert list(engine_pids(agent).values()) == [pid]
        assert "adopted=1" in agent.log()


def test_a_stream_that_cannot_be_resumed_ends_with_the_error_event(fleet: Fleet) -> None:
    server = fleet.server
    before = server.metrics()
    streams = run_streams(
        server.url + "/v1",
        server.api_key(),
        8,
        TOKENS,
        lambda: deal(fleet, "engine", fleet.agents[0]),
        n_two=6,  # least outstanding: two on each replica
    )
    after = server.metrics()
    single = [s for s in streams if s.n == 1]
    double = [s for s in streams if s.n == 2]
    assert [s.i for s in single if s.error is not None] == []
    failed = [s for s in double if s.error is not None]
    assert failed, "no n=2 stream was on the killed engine"
    for s in failed:
        assert isinstance(s.error, openai.APIError)
        assert "ended early" in str(s.error) or "engine" in str(s.error), s.error
    broken = metric_sum(after, "llmgw_streams_broken_total", reason="n")
    assert broken - metric_sum(before, "llmgw_streams_broken_total", reason="n") == len(failed)
    recover(fleet, "engine", fleet.agents[0])
