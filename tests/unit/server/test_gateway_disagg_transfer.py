"""What a disaggregated model's hand-overs moved, as the gateway counts it
(``llmgw_disagg_transfer_tokens_total``, ``llmgw_disagg_transfer_bytes_total``), through the
stand-in engines of :mod:`tests.unit.server.disagg_gateway_rig`; and the model's KV bytes per
token as the gateway's serving cache reads them from a stored profile."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.server.gateway.serving import ServedModel
from llmgw.server.store.rows import Model
from tests.unit.server.disagg_gateway_rig import PROMPT_TOKENS, Rig, chat, chat_stream, run

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_vllm_hand_over_counts_the_prefills_prompt_tokens_and_their_bytes(stream: bool) -> None:
    async def body(rig: Rig) -> None:
        for _ in range(2):
            await (chat_stream(rig) if stream else chat(rig))
        assert rig.counted("disagg_transfer_tokens") == {("m",): 2 * PROMPT_TOKENS}
        assert rig.counted("disagg_transfer_bytes") == {("m",): 2 * PROMPT_TOKENS * 4096}
        text = rig.metrics.render()
        assert f'llmgw_disagg_transfer_bytes_total{{model="m"}} {2 * PROMPT_TOKENS * 4096}' in text

    run(body, kv_bytes=4096)


def test_without_kv_bytes_per_token_the_tokens_are_counted_not_the_bytes() -> None:
    async def body(rig: Rig) -> None:
        await chat(rig)
        assert rig.counted("disagg_transfer_tokens") == {("m",): PROMPT_TOKENS}
        assert rig.counted("disagg_transfer_bytes") == {}

    run(body)


def test_an_sglang_hand_over_counts_the_decodes_prompt_tokens() -> None:
    async def body(rig: Rig) -> None:
        await chat(rig)
        assert rig.counted("disagg_transfer_tokens") == {("m",): PROMPT_TOKENS}
        assert rig.counted("disagg_transfer_bytes") == {("m",): PROMPT_TOKENS * 100}

    run(body, protocol="sglang", kv_bytes=100)


def test_a_fallback_or_a_failed_decode_moves_nothing() -> None:
    async def body(rig: Rig) -> None:
        await chat(rig)  # every prefill fails: run whole on a decode replica
        assert rig.counted("disagg_requests") == {("m", "fallback"): 1}
        assert rig.counted("disagg_transfer_tokens") == {}
        assert rig.counted("disagg_transfer_bytes") == {}

    run(body, kv_bytes=4096, prefill=1, fails={"p0": ["500", "500", "500"]})


def _served(engine: str, disaggregated: dict[str, Any], **params: Any) -> ServedModel:
    profile = {"engine": engine, "source": "x", "gpus": 1, "disaggregated": disaggregated}
    if params:
        profile["params"] = params
    model = Model("m", engine, {}, 0, 0.0, 0.0, profiles={"pd": profile}, profile="pd")
    return ServedModel.of(model)


POOLS = {"prefill": {"gpus": 1}, "decode": {"gpus": 1}}


def test_kv_bytes_per_token_is_the_profiles_else_the_sims_own() -> None:
    given = _served("vllm", {**POOLS, "kv_bytes_per_token": 131072}).handover
    assert given is not None and given.kv_bytes_per_token == 131072
    unknown = _served("vllm", POOLS).handover
    assert unknown is not None and unknown.kv_bytes_per_token is None
    sim_param = _served("sim", POOLS, kv_bytes_per_token=2048).handover
    assert sim_param is not None and sim_param.kv_bytes_per_token == 2048
    sim_default = _served("sim", POOLS).handover
    assert sim_default is not None and sim_default.kv_bytes_per_token == 1024
    sim_given = _served("sim", {**POOLS, "kv_bytes_per_token": 64}).handover
    assert sim_given is not None and sim_given.kv_bytes_per_token == 64
