"""A disaggregated profile: its two pools parsed and checked (the catalog's and a stored
profile's words), the pools' own stored profiles and names."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.contracts.catalog import STORED, parse_catalog, parse_profile
from llmgw.contracts.disagg import (
    DEFAULT_TRANSFER_TIMEOUT,
    Disaggregation,
    Pool,
    handover_of,
    parse_disaggregated,
    pool_name,
    pool_profile,
    served_name,
    split_pool,
)
from llmgw.contracts.scaling import ScalingPolicy
from llmgw.errors import ConfigError

PD: dict[str, Any] = {
    "prefill": {"gpus": 1, "replicas": 2, "args": ["--max-num-batched-tokens", "8192"]},
    "decode": {"gpus": 2, "replicas": {"min": 1, "max": 4}, "max_concurrency": 64},
    "transfer_timeout": "5s",
    "kv_bytes_per_token": 131072,
}


def _catalog(profile: dict[str, Any]) -> Any:
    return parse_catalog({"models": {"m": {"profiles": {"pd": profile}}}}, source="cat.yaml")


def test_both_pools_with_their_gpus_counts_args_and_concurrency() -> None:
    parsed = parse_disaggregated(PD, key="d", engine="vllm")
    assert parsed.prefill == Pool("prefill", 1, 2, ("--max-num-batched-tokens", "8192"))
    assert parsed.decode.replicas == ScalingPolicy(min=1, max=4)
    assert parsed.decode.max_concurrency == 64
    assert parsed.transfer_timeout == 5.0
    assert parsed.pool("decode") is parsed.decode


def test_defaults_one_replica_each_and_the_default_timeout() -> None:
    parsed = parse_disaggregated(
        {"prefill": {"gpus": 1}, "decode": {"gpus": 1}}, key="d", engine="sim"
    )
    assert (parsed.prefill.replicas, parsed.decode.replicas) == (1, 1)
    assert parsed.transfer_timeout == DEFAULT_TRANSFER_TIMEOUT
    assert parsed.backend == ""
    assert parsed.kv_bytes_per_token is None
    assert "kv_bytes_per_token" not in parsed.to_dict()


def test_kv_bytes_per_token_is_kept_and_stored() -> None:
    parsed = parse_disaggregated(PD, key="d", engine="vllm")
    assert parsed.kv_bytes_per_token == 131072
    assert parsed.to_dict()["kv_bytes_per_token"] == 131072


def test_a_catalog_profile_round_trips_through_its_stored_form() -> None:
    profile = _catalog({"engine": "vllm", "source": "llama", "gpus": 1, "disaggregated": PD})
    profile = profile.models["m"].profiles["pd"]
    assert isinstance(profile.disaggregated, Disaggregation)
    again = parse_profile(profile.to_dict(), model="m", profile="pd", source=STORED)
    assert again == profile


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([], "must be a mapping with prefill and decode"),
        ({"prefill": {"gpus": 1}}, "needs both prefill and decode, decode is missing"),
        ({"prefill": {"gpus": 1}, "decode": {"gpus": 1}, "chunk": 2}, "unknown key 'chunk'"),
        ({"prefill": {"replicas": 1}, "decode": {"gpus": 1}}, r"prefill\.gpus: is missing"),
        ({"prefill": {"gpus": -1}, "decode": {"gpus": 1}}, r"prefill\.gpus: must be a whole"),
        ({"prefill": {"gpus": True}, "decode": {"gpus": 1}}, r"prefill\.gpus: must be a whole"),
        ({"prefill": 2, "decode": {"gpus": 1}}, "must be a mapping with gpus and replicas"),
        ({"prefill": {"gpus": 1, "nodes": 2}, "decode": {"gpus": 1}}, "unknown key 'nodes'"),
        (
            {"prefill": {"gpus": 1, "replicas": {"min": 3, "max": 1}}, "decode": {"gpus": 1}},
            r"prefill\.replicas: min \(3\) is above max",
        ),
        ({"prefill": {"gpus": 1, "args": "-x"}, "decode": {"gpus": 1}}, "list of strings"),
        (
            {"prefill": {"gpus": 1}, "decode": {"gpus": 1, "max_concurrency": 0}},
            r"decode\.max_concurrency: must be a whole number from 1",
        ),
        (
            {"prefill": {"gpus": 1}, "decode": {"gpus": 1}, "transfer_timeout": "0s"},
            r"transfer_timeout: must be above 0",
        ),
        (
            {"prefill": {"gpus": 1}, "decode": {"gpus": 1}, "transfer_timeout": "soon"},
            r"transfer_timeout: ",
        ),
        (
            {"prefill": {"gpus": 1}, "decode": {"gpus": 1}, "backend": "nixl"},
            "is SGLang's transfer backend; engine vllm has one of its own",
        ),
        *(
            (
                {"prefill": {"gpus": 1}, "decode": {"gpus": 1}, "kv_bytes_per_token": bad},
                rf"kv_bytes_per_token: must be a whole number of bytes >= 1 .*got {kind}",
            )
            for bad, kind in ((0, "int"), (-5, "int"), (True, "bool"), ("128k", "str"), (1.5, ""))
        ),
    ],
)
def test_refusals_name_the_key_and_the_fix(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_disaggregated(value, key="models.m.profiles.pd.disaggregated", engine="vllm")


def test_sglangs_backend_is_one_it_is_started_with() -> None:
    pools = {"prefill": {"gpus": 1}, "decode": {"gpus": 1}}
    parsed = parse_disaggregated({**pools, "backend": "mooncake"}, key="d", engine="sglang")
    assert parsed.backend == "mooncake"
    with pytest.raises(ConfigError, match="must be one of nixl, mooncake; got 'tcp'"):
        parse_disaggregated({**pools, "backend": "tcp"}, key="d", engine="sglang")


def test_an_engine_without_a_hand_over_is_refused_with_those_that_have_one() -> None:
    with pytest.raises(
        ConfigError, match=r"engine llamacpp cannot disaggregate.*sglang, sim, vllm"
    ):
        _catalog({"engine": "llamacpp", "source": "x.gguf", "gpus": 1, "disaggregated": PD})
    assert (handover_of("vllm"), handover_of("sim"), handover_of("sglang")) == (
        "vllm",
        "vllm",
        "sglang",
    )
    assert handover_of("llamacpp") is None


def test_a_multi_node_profile_cannot_be_disaggregated() -> None:
    with pytest.raises(ConfigError, match=r"run on one node each .nodes is 2"):
        _catalog({"engine": "vllm", "source": "x", "gpus": 1, "nodes": 2, "disaggregated": PD})


def test_a_catalog_cannot_give_a_pools_own_role() -> None:
    with pytest.raises(ConfigError, match=r"pd\.role: is set by llmgw on a disaggregated"):
        _catalog({"engine": "sim", "role": "prefill"})


def test_each_pools_stored_profile_is_the_models_with_the_pools_shape() -> None:
    stored = _catalog(
        {"engine": "sim", "routing": "kv-events", "args": ["--x"], "disaggregated": PD}
    )
    stored = stored.models["m"].profiles["pd"].to_dict()
    prefill = parse_profile(
        pool_profile(stored, "prefill"), model="m#prefill", profile="pd", source=STORED
    )
    decode = parse_profile(
        pool_profile(stored, "decode"), model="m#decode", profile="pd", source=STORED
    )
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert (prefill.gpus, decode.gpus) == (1, 2)
    assert prefill.args == ("--x", "--max-num-batched-tokens", "8192")
    assert decode.args == ("--x",)
    assert decode.max_concurrency == 64
    # The prefix cache routes prompts to where they are computed; decode goes by load.
    assert (prefill.routing, decode.routing) == ("kv-events", None)
    assert prefill.disaggregated is None and decode.disaggregated is None
    with pytest.raises(ValueError, match="not a disaggregated profile"):
        pool_profile(prefill.to_dict(), "prefill")


def test_a_pools_profile_keeps_sglangs_backend() -> None:
    stored = _catalog(
        {
            "engine": "sglang",
            "source": "x",
            "gpus": 1,
            "disaggregated": {"prefill": {"gpus": 1}, "decode": {"gpus": 1}, "backend": "nixl"},
        }
    )
    pool = pool_profile(stored.models["m"].profiles["pd"].to_dict(), "decode")
    parsed = parse_profile(pool, model="m#decode", profile="pd", source=STORED)
    # Last on the command line, after llmgw's default: SGLang takes the last one.
    assert parsed.args[-2:] == ("--disaggregation-transfer-backend", "nixl")
    assert parsed.to_dict() == pool


def test_a_stored_role_the_engine_cannot_take_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be one of prefill, decode; got 'both'"):
        parse_profile({"engine": "sim", "role": "both"}, model="m", profile="p", source=STORED)


def test_pool_names_are_no_model_name_a_client_gives() -> None:
    assert pool_name("llama:8b", "prefill") == "llama:8b#prefill"
    assert split_pool("llama:8b#decode") == ("llama:8b", "decode")
    for name in ("llama", "m#both", "#prefill", "m#"):
        assert split_pool(name) is None
    with pytest.raises(ValueError, match="no pool 'both'"):
        pool_name("m", "both")


def test_a_pools_engines_answer_to_the_models_name() -> None:
    assert served_name("llama:8b#prefill") == served_name("llama:8b#decode") == "llama:8b"
    assert served_name("llama:8b") == "llama:8b"


def test_each_pool_takes_its_own_target_tokens() -> None:
    value = {
        "prefill": {"gpus": 1, "replicas": {"min": 1, "max": 4, "target_tokens": 16000}},
        "decode": {"gpus": 1, "replicas": {"min": 1, "max": 8, "target_tokens": 4096}},
    }
    parsed = parse_disaggregated(value, key="d", engine="vllm")
    assert isinstance(parsed.prefill.replicas, ScalingPolicy)
    assert isinstance(parsed.decode.replicas, ScalingPolicy)
    assert (parsed.prefill.replicas.target_tokens, parsed.decode.replicas.target_tokens) == (
        16000,
        4096,
    )
    bad = {**value, "decode": {"gpus": 1, "replicas": {"min": 1, "max": 8, "target_tokens": 0}}}
    with pytest.raises(ConfigError, match=r"d\.decode\.replicas\.target_tokens: must be a whole"):
        parse_disaggregated(bad, key="d", engine="vllm")
