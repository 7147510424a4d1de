"""A disaggregated model through the gateway with the official ``openai`` client, in front of
stand-in engines that answer as vLLM's and SGLang's do (:mod:`tests.unit.server.disagg_gateway_rig`):
the prefill's and the decode's requests are the engines' own proxies' (the fixtures), the
client gets one ordinary answer and usage, the key is charged once; every failure of the
hand-over (a prefill failing, none ready, a transfer that never completes, a decode failing
before or after its first token) ends in an answer; the pools are never a client's."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import openai
import pytest

from llmgw.contracts.catalog import Routing
from llmgw.contracts.disagg import pool_profile
from llmgw.server.gateway.disagg import prefill_body
from llmgw.server.gateway.routing import Endpoint
from llmgw.server.gateway.serving import Handover, ServedModel
from llmgw.server.store.rows import Model
from tests.unit.server.disagg_gateway_rig import (
    MESSAGES,
    Rig,
    chat,
    chat_stream,
    fixture,
    run,
    words,
)

pytestmark = pytest.mark.timeout(60)


def text(count: int) -> str:
    return "".join(words(0, count))


# -- the hand-over (vLLM's protocol) ----------------------------------------------------------


def test_a_chat_is_prefilled_then_decoded_with_the_fields_vllms_proxy_sends() -> None:
    async def body(rig: Rig) -> None:
        answer = await chat(rig, extra_body={"min_tokens": 2})
        assert answer.choices[0].message.content == text(8)
        (prefilled,) = rig.sent("prefill")
        (decoded,) = rig.sent("decode")
        # Field by field, as vLLM's toy_proxy_server makes them from the client's body.
        assert prefilled == fixture("vllm_chat_prefill_request.json")
        assert decoded == fixture("vllm_chat_decode_request.json")
        # One usage: the prompt once, the decode's completion, the prefill's cached tokens.
        usage = answer.usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (12, 8)
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 8
        # The key is charged once, the model's name the client's.
        tokens = rig.counted("key_tokens")
        assert tokens == {
            ("alice", "m", "prompt"): 12,
            ("alice", "m", "completion"): 8,
            ("alice", "m", "cached"): 8,
        }
        assert rig.counted("key_requests") == {("alice", "m", "200"): 1}
        assert rig.counted("disagg_requests") == {("m", "handed_over"): 1}
        assert rig.counted("disagg_fallbacks") == {}
        assert sum(rig.metrics.disagg_prefill.counts[("m",)]) >= 1

    run(body)


def test_the_prefill_body_is_the_proxys_for_any_client_body() -> None:
    client = fixture("vllm_chat_client.json")
    import json

    made = json.loads(prefill_body(json.dumps(client).encode()))
    assert made == fixture("vllm_chat_prefill_request.json")
    # max_completion_tokens only when given; stream_options dropped; stream false.
    streamed = {**client, "stream": True, "stream_options": {"include_usage": True}}
    del streamed["max_completion_tokens"]
    made = json.loads(prefill_body(json.dumps(streamed).encode()))
    assert "max_completion_tokens" not in made and "stream_options" not in made
    assert made["stream"] is False and made["max_tokens"] == 1


def test_a_streamed_chat_is_relayed_from_the_decode_with_one_usage() -> None:
    async def body(rig: Rig) -> None:
        got, usage = await chat_stream(rig)
        assert got == text(8)
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (12, 8)
        # The prefill's cached tokens in the stream's usage chunk too (the decode said 0).
        assert usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens == 8
        (prefilled,) = rig.sent("prefill")
        (decoded,) = rig.sent("decode")
        assert prefilled["stream"] is False and prefilled["max_tokens"] == 1
        assert "stream_options" not in prefilled
        assert decoded["stream"] is True
        assert (
            decoded["kv_transfer_params"]
            == fixture("vllm_chat_prefill_response.json")["kv_transfer_params"]
        )
        # The hand-over's time: the prefill's answer to the decode's first token.
        assert sum(rig.metrics.disagg_handover.counts[("m",)]) == 1
        assert rig.counted("key_tokens")[("alice", "m", "cached")] == 8

    run(body)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_are_handed_over_too(stream: bool) -> None:
    async def body(rig: Rig) -> None:
        if stream:
            out = ""
            async for chunk in await rig.client.completions.create(
                model="m", prompt="Rivers", max_tokens=5, stream=True
            ):
                out += chunk.choices[0].text if chunk.choices else ""
        else:
            answer = await rig.client.completions.create(model="m", prompt="Rivers", max_tokens=5)
            out = answer.choices[0].text
        assert out == text(5)
        (prefilled,) = rig.sent("prefill")
        (decoded,) = rig.sent("decode")
        assert prefilled["prompt"] == "Rivers" and prefilled["max_tokens"] == 1
        assert prefilled["kv_transfer_params"]["do_remote_decode"] is True
        assert decoded["kv_transfer_params"]["do_remote_prefill"] is True
        assert decoded["max_tokens"] == 5
        assert rig.counted("disagg_requests") == {("m", "handed_over"): 1}

    run(body)


def test_decode_replicas_are_chosen_by_the_tokens_they_are_generating() -> None:
    async def body(rig: Rig) -> None:
        decodes = [ep for ep in rig.gateway.router.endpoints("m#decode")]
        decodes[0].decoding = 1000  # d0 is busy generating
        await chat(rig)
        assert len(rig.replica("d1").got) == 1 and not rig.replica("d0").got
        # What was charged there is given back when the answer ended.
        assert decodes[1].decoding == 0
        assert rig.metrics.decoding_tokens.values[("m#decode", "d1")] == 0

    run(body)


def test_prefill_replicas_are_chosen_by_the_prefix_they_hold_in_the_pools_own_index() -> None:
    long = [{"role": "system", "content": "You answer about rivers. " * 40}]

    async def body(rig: Rig) -> None:
        for turn in ("Nile?", "Amazon?", "Danube?"):
            await rig.client.chat.completions.create(
                model="m", messages=[*long, {"role": "user", "content": turn}], max_tokens=2
            )
        # All three to the replica that computed the shared prefix first, by the prefill
        # pool's own index (its replicas are registered under the pool's name).
        shards = [len(rig.replica(s).got) for s in ("p0", "p1")]
        assert sorted(shards) == [0, 3]
        indexed = {model for model, _ in rig.gateway.router.prefixes.index_sizes()}
        assert indexed == {"m#prefill"}

    run(body, routing=Routing.PREFIX_APPROX)


def test_a_stored_disaggregated_model_is_served_by_its_pools() -> None:
    profile = {
        "engine": "vllm",
        "routing": "kv-events",
        "disaggregated": {
            "prefill": {"gpus": 1, "replicas": 1},
            "decode": {"gpus": 1, "replicas": 2},
            "transfer_timeout": "12s",
        },
    }
    model = Model("m", "vllm", {}, 0, 0.0, 0.0, profiles={"p": profile}, profile="p")
    served = ServedModel.of(model)
    assert served.handover == Handover("m#prefill", "m#decode", "vllm", 12.0)
    assert not served.is_pool
    prefill = ServedModel.of(
        Model(
            "m#prefill",
            "vllm",
            {},
            1,
            0.0,
            0.0,
            profiles={"p": pool_profile(profile, "prefill")},
            profile="p",
        )
    )
    assert prefill.is_pool and prefill.handover is None
    assert prefill.routing == Routing.KV_EVENTS  # the prefix cache is the prefill pool's
    sglang = ServedModel.of(
        Model(
            "s",
            "sglang",
            {},
            0,
            0.0,
            0.0,
            profiles={"p": {**profile, "engine": "sglang"}},
            profile="p",
        )
    )
    assert sglang.handover is not None and sglang.handover.protocol == "sglang"
    # An ordinary model has none.
    plain = ServedModel.of(
        Model("o", "vllm", {}, 1, 0.0, 0.0, profiles={"p": {"engine": "vllm"}}, profile="p")
    )
    assert plain.handover is None and not plain.is_pool


# -- the pools are never a client's -------------------------------------------------------------


def test_pools_are_hidden_from_clients() -> None:
    async def body(rig: Rig) -> None:
        listed = [m.id for m in (await rig.client.models.list()).data]
        assert listed == ["m"]
        assert (await rig.client.models.retrieve("m")).id == "m"
        for pool in ("m#prefill", "m#decode"):
            with pytest.raises(openai.NotFoundError) as exc:
                await rig.client.models.retrieve(pool)
            with pytest.raises(openai.NotFoundError) as exc:
                await rig.client.chat.completions.create(model=pool, messages=MESSAGES)
            # The models it names are those a client may name.
            assert "Models on this gateway: m." in str(exc.value.body)
        assert not rig.sent("prefill") and not rig.sent("decode")

    run(body)


# -- failures --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["refuse", "reset", "500"])
def test_a_failed_prefill_is_sent_to_another_prefill_replica(mode: str) -> None:
    async def body(rig: Rig) -> None:
        answer = await chat(rig)
        assert answer.choices[0].message.content == text(8)
        assert len(rig.replica("p0").got) == 1 and len(rig.replica("p1").got) == 1
        (decoded,) = rig.sent("decode")
        assert "kv_transfer_params" in decoded
        assert rig.counted("disagg_prefill_retries") == {("m",): 1}
        assert rig.counted("disagg_requests") == {("m", "handed_over"): 1}

    run(body, fails={"p0": [mode]}, prefill=2)


def test_a_prefill_that_never_answers_is_sent_to_another_after_the_idle_timeout() -> None:
    async def body(rig: Rig) -> None:
        answer = await chat(rig)
        assert answer.choices[0].message.content == text(8)
        assert len(rig.replica("p0").got) == 1 and len(rig.replica("p1").got) == 1
        assert rig.counted("disagg_prefill_retries") == {("m",): 1}
        assert rig.counted("disagg_requests") == {("m", "handed_over"): 1}

    run(body, fails={"p0": ["hang"]}, idle_timeout=0.5)


def test_a_request_runs_whole_on_a_decode_replica_when_every_prefill_failed() -> None:
    async def body(rig: Rig) -> None:
        answer = await chat(rig)
        assert answer.choices[0].message.content == text(8)
        (decoded,) = rig.sent("decode")
        assert "kv_transfer_params" not in decoded  # the client's own body
        client = fixture("vllm_chat_client.json")
        del client["min_tokens"]
        assert decoded == client
        assert rig.counted("disagg_fallbacks") == {("m", "no_prefill"): 1}
        assert rig.counted("disagg_requests") == {("m", "fallback"): 1}

    run(body, fails={"p0": ["reset"], "p1": ["500"]})


def test_no_prefill_replica_ready_runs_whole_and_wakes_the_pool() -> None:
    async def body(rig: Rig) -> None:
        got, _ = await chat_stream(rig)
        assert got == text(8)
        (decoded,) = rig.sent("decode")
        assert "kv_transfer_params" not in decoded
        assert rig.counted("disagg_fallbacks") == {("m", "no_prefill"): 1}
        # The pool at zero is woken: its demand counted while the request ran whole.
        assert rig.gateway.capacity.waiting("m#prefill") == 1

    run(body, prefill=0, prefill_cold=30.0)


def test_prefill_replicas_all_full_past_queue_timeout_run_whole() -> None:
    async def body(rig: Rig) -> None:
        for ep in rig.gateway.router.endpoints("m#prefill"):
            ep.inflight = 8  # every place taken (max_concurrency 8)
        answer = await chat(rig)
        assert answer.choices[0].message.content == text(8)
        assert not rig.sent("prefill")
        (decoded,) = rig.sent("decode")
        assert "kv_transfer_params" not in decoded
        assert rig.counted("disagg_fallbacks") == {("m", "prefill_busy"): 1}

    run(body, queue_timeout=0.3)


def test_an_endpoint_without_hand_over_runs_whole_on_a_decode_replica() -> None:
    async def body(rig: Rig) -> None:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{rig.port}/tokenize",
                json={"model": "m", "prompt": "Rivers"},
                headers={"Authorization": "Bearer sk-alice"},
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
            assert (await resp.json())["tokens"] == [1, 2, 3]
        assert not rig.sent("prefill")
        assert len(rig.sent("decode")) == 1
        assert rig.counted("disagg_fallbacks") == {("m", "endpoint"): 1}

    run(body)


def test_a_prefills_refusal_is_the_clients_answer() -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.BadRequestError):
            await chat(rig)
        assert not rig.sent("decode")
        assert rig.counted("key_requests") == {("alice", "m", "400"): 1}

    run(body, fails={"p0": ["400"], "p1": ["400"]})


def test_a_transfer_that_never_completes_falls_back_to_a_whole_request() -> None:
    async def body(rig: Rig) -> None:
        got, usage = await chat_stream(rig)
        assert got == text(8)
        handed, whole = rig.sent("decode")
        assert "kv_transfer_params" in handed and "kv_transfer_params" not in whole
        assert rig.counted("disagg_fallbacks") == {("m", "transfer_timeout"): 1}
        assert rig.counted("disagg_requests") == {("m", "fallback"): 1}
        assert usage is not None and usage.completion_tokens == 8

    run(body, decode=1, transfer_timeout=0.5, fails={"d0": ["hang"]})


@pytest.mark.parametrize("mode", ["engine", "reset", "refuse"])
def test_a_decode_failing_before_its_first_byte_is_sent_whole_to_another(mode: str) -> None:
    async def body(rig: Rig) -> None:
        rig.gateway.router.endpoints("m#decode")[1].decoding = 100  # d0 first
        answer = await chat(rig)
        assert answer.choices[0].message.content == text(8)
        first, second = rig.replica("d0").got + rig.replica("d1").got
        assert "kv_transfer_params" in first[1]
        if mode == "engine":  # taken and failed: recomputed, no KV to pull
            assert "kv_transfer_params" not in second[1]
        else:  # not taken (or not known to be): the hand-over goes on on the other
            assert "kv_transfer_params" in second[1]
        assert rig.counted("disagg_requests") == {("m", "handed_over"): 1}

    run(body, fails={"d0": [mode]}, decode=2)


def test_a_decodes_error_is_the_clients_answer_and_counted_failed() -> None:
    async def body(rig: Rig) -> None:
        with pytest.raises(openai.InternalServerError):
            await chat(rig)
        assert rig.counted("disagg_requests") == {("m", "failed"): 1}
        assert rig.counted("key_requests") == {("alice", "m", "500"): 1}

    run(body, decode=1, fails={"d0": ["500"]})


def test_a_decode_stream_broken_after_its_first_tokens_is_resumed_on_another() -> None:
    async def body(rig: Rig) -> None:
        rig.gateway.router.endpoints("m#decode")[1].decoding = 100  # d0 first
        got, usage = await chat_stream(rig)
        assert got == text(8)
        first, second = rig.replica("d0").got + rig.replica("d1").got
        assert "kv_transfer_params" in first[1]
        resumed = second[1]
        assert "kv_transfer_params" not in resumed  # the client's chat and the text so far
        assert resumed["continue_final_message"] is True
        assert resumed["messages"][-1] == {"role": "assistant", "content": text(3)}
        assert rig.counted("stream_resumes") == {("m#decode", "error", "completed"): 1}
        assert usage is not None and usage.completion_tokens == 8

    run(body, fails={"d0": ["break"]})


# -- SGLang's protocol ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_sglang_gets_both_requests_at_once_with_the_prefills_bootstrap(stream: bool) -> None:
    async def body(rig: Rig) -> None:
        if stream:
            got, _ = await chat_stream(rig, max_completion_tokens=8)
        else:
            got = (await chat(rig)).choices[0].message.content
        assert got == text(8)
        (prefilled,) = rig.sent("prefill")
        (decoded,) = rig.sent("decode")
        assert prefilled == decoded  # the same body to both, as SGLang's router sends it
        expected = fixture("sglang_chat_request.json")
        room = decoded.pop("bootstrap_room")
        assert isinstance(room, int) and 0 <= room < 2**63
        expected.pop("bootstrap_room")
        expected.pop("min_tokens")
        if stream:
            expected.pop("temperature")
            expected |= {"stream": True, "stream_options": {"include_usage": True}}
        assert decoded == expected
        assert rig.counted("disagg_requests") == {("m", "handed_over"): 1}

    run(body, protocol="sglang")


def test_sglang_rooms_differ_between_requests() -> None:
    async def body(rig: Rig) -> None:
        await chat(rig)
        await chat(rig)
        rooms = {b["bootstrap_room"] for b in rig.sent("decode")}
        assert len(rooms) == 2

    run(body, protocol="sglang", prefill=1, decode=1)


def test_sglang_a_prefill_failing_before_the_first_token_is_sent_again_with_another() -> None:
    async def body(rig: Rig) -> None:
        got, _ = await chat_stream(rig)
        assert got == text(8)
        assert len(rig.replica("p0").got) == 1 and len(rig.replica("p1").got) == 1
        rooms = [b["bootstrap_room"] for b in rig.sent("decode")]
        assert len(rooms) == 2 and rooms[0] != rooms[1]
        assert rig.counted("disagg_prefill_retries") == {("m",): 1}
        assert rig.counted("disagg_requests") == {("m", "handed_over"): 1}

    run(body, protocol="sglang", fails={"p0": ["reset"]}, transfer_timeout=5.0)


def test_sglang_a_non_streamed_decode_is_given_up_when_its_prefill_fails() -> None:
    async def body(rig: Rig) -> None:
        got = (await chat(rig)).choices[0].message.content
        assert got == text(8)
        assert len(rig.sent("decode")) == 2
        assert rig.counted("disagg_prefill_retries") == {("m",): 1}

    run(body, protocol="sglang", fails={"p0": ["500"]}, transfer_timeout=5.0)


def test_sglang_a_prefill_replica_without_a_transfer_address_runs_whole() -> None:
    async def body(rig: Rig) -> None:
        got = (await chat(rig)).choices[0].message.content
        assert got == text(8)
        (decoded,) = rig.sent("decode")
        assert "bootstrap_room" not in decoded
        assert not rig.sent("prefill")
        assert rig.counted("disagg_fallbacks") == {("m", "no_transfer_addr"): 1}

    run(body, protocol="sglang", transfer_addr="")


def test_sglang_a_transfer_that_never_completes_falls_back() -> None:
    async def body(rig: Rig) -> None:
        got, _ = await chat_stream(rig)
        assert got == text(8)
        assert rig.counted("disagg_fallbacks") == {("m", "transfer_timeout"): 1}

    run(body, protocol="sglang", decode=1, transfer_timeout=0.5, fails={"d0": ["hang"]})


# -- other endpoints, and /metrics ---------------------------------------------------------------


def test_the_metrics_are_exported() -> None:
    async def body(rig: Rig) -> None:
        await chat(rig)
        text_ = rig.metrics.render()
        for name in (
            'llmgw_disagg_requests_total{model="m",outcome="handed_over"} 1',
            "llmgw_disagg_prefill_seconds_count",
            "# TYPE llmgw_disagg_handover_seconds histogram",
            "# TYPE llmgw_disagg_fallbacks_total counter",
            "# TYPE llmgw_disagg_prefill_retries_total counter",
            'llmgw_decoding_tokens{model="m#decode",replica="d0"} 0',
        ):
            assert name in text_

    run(body, decode=1)


# -- the tokens each pool carries, for the planner's target_tokens ----------------------------


def test_a_prefill_weighs_its_prompt_on_its_pool_until_it_answers() -> None:
    async def body(rig: Rig) -> None:
        prefills = rig.gateway.router.endpoints("m#prefill")
        asked = asyncio.ensure_future(chat(rig))
        for _ in range(100):  # until the prefill is on p0 (which hangs)
            await asyncio.sleep(0.01)
            if rig.replica("p0").got:
                break
        demand = rig.gateway.capacity.demand()
        prompt = demand["m#prefill"].tokens
        assert prompt > 0 and prompt == sum(ep.tokens for ep in prefills)
        assert demand["m#prefill"].inflight == 1
        assert "m#decode" not in demand  # nothing decodes yet
        answer = await asyncio.wait_for(asked, 10)
        assert answer.choices[0].message.content == text(8)
        # Everything charged was given back: the retried prefill's and the decode's.
        assert [ep.tokens for ep in rig.gateway.router.endpoints()] == [0, 0, 0, 0]
        assert "m#prefill" not in rig.gateway.capacity.demand()

    run(body, fails={"p0": ["hang"]}, idle_timeout=0.5)


def test_a_decode_weighs_its_output_on_its_pool_while_it_runs() -> None:
    async def body(rig: Rig) -> None:
        decodes = rig.gateway.router.endpoints("m#decode")
        seen: list[int] = []
        # The engines answer at once: the decode's weight is read as its place is taken.
        admission = rig.gateway.admission
        take = admission.try_acquire

        def spying(model: str, *args: Any, **kw: Any) -> Endpoint | None:
            ep = take(model, *args, **kw)
            if ep is not None and model == "m#decode":
                seen.append(rig.gateway.capacity.demand()["m#decode"].tokens)
            return ep

        admission.try_acquire = spying  # type: ignore[method-assign]
        await chat(rig)  # max_completion_tokens 8
        assert seen == [8]
        assert [ep.tokens for ep in decodes] == [0, 0]

    run(body)
