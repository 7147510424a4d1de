"""A profile's routing policy and the files the gateway keys its prompts with (catalog keys
``routing``, ``tokenizer``, ``chat_template``): accepted, stored and read back, and every
refusal naming the key and the fix."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.contracts.catalog import (
    DEFAULT_ROUTING,
    ROUTINGS,
    FileRef,
    parse_catalog,
    parse_profile,
    profile_file,
    profile_routing,
)
from llmgw.errors import ConfigError

SHA = "ab" * 32
VLLM = {"engine": "vllm", "source": "llama-3-8b", "gpus": 1}


def profile(**given: Any) -> dict[str, Any]:
    catalog = parse_catalog({"models": {"m": {"profiles": {"p": given}}}}, source="catalog.yaml")
    return catalog.models["m"].profiles["p"].to_dict()


@pytest.mark.parametrize("policy", ROUTINGS)
def test_every_policy_is_kept_and_read_back(policy: str) -> None:
    stored = profile(engine="sim", routing=policy)
    assert stored["routing"] == policy
    assert profile_routing(stored) == policy
    again = parse_profile(stored, model="m", profile="p", source="stored")
    assert again.routing_policy == policy


def test_no_routing_is_least_outstanding_and_not_stored() -> None:
    stored = profile(engine="sim")
    assert "routing" not in stored
    assert profile_routing(stored) == DEFAULT_ROUTING == "least-outstanding"
    assert profile_routing({"routing": "nonsense"}) == DEFAULT_ROUTING
    assert profile_routing(None) == DEFAULT_ROUTING


def test_kv_events_with_vllm_keeps_its_tokenizer_and_template() -> None:
    stored = profile(
        **VLLM,
        routing="kv-events",
        tokenizer={"url": "https://models.example/tokenizer.json", "sha256": SHA.upper()},
        chat_template="/srv/llmgw/chat_template.jinja",
    )
    assert stored["tokenizer"] == {"url": "https://models.example/tokenizer.json", "sha256": SHA}
    assert stored["chat_template"] == {"path": "/srv/llmgw/chat_template.jinja"}
    assert profile_file(stored, "tokenizer") == FileRef(
        "https://models.example/tokenizer.json", SHA
    )
    assert profile_file(stored, "chat_template") == FileRef("/srv/llmgw/chat_template.jinja")
    assert profile_file(stored, "missing") is None
    assert profile_file({"tokenizer": "not a mapping"}, "tokenizer") is None


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"engine": "sim", "routing": "fastest"},
            r"profiles\.p\.routing: unknown routing 'fastest'",
        ),
        ({"engine": "sim", "routing": 3}, r"profiles\.p\.routing: must be one of .*got int"),
        (
            {"engine": "llamacpp", "source": "tiny.gguf", "gpus": 0, "routing": "kv-events"},
            r"kv-events needs an engine that publishes .*engine llamacpp does not: use "
            r"routing: prefix-approx",
        ),
        (
            {**VLLM, "routing": "kv-events"},
            r"kv-events with engine vllm needs the model's tokenizer.*add tokenizer:",
        ),
        (
            {**VLLM, "tokenizer": {"url": "https://models.example/tokenizer.json"}},
            r"tokenizer\.sha256: is missing: a fetched file is checked by its SHA-256",
        ),
        (
            {**VLLM, "tokenizer": {"url": "https://h/t.json", "sha256": "xyz"}},
            r"tokenizer\.sha256: must be 64 hexadecimal digits",
        ),
        (
            {**VLLM, "tokenizer": "relative/tokenizer.json"},
            r"tokenizer\.path: 'relative/tokenizer\.json' must be an absolute path",
        ),
        (
            {**VLLM, "tokenizer": {"url": "https://h/t.json", "path": "/t.json", "sha256": SHA}},
            r"tokenizer: give one of url \(with its sha256\) or path",
        ),
        ({**VLLM, "tokenizer": {}}, r"tokenizer: give one of url"),
        ({**VLLM, "tokenizer": 7}, r"tokenizer: must be an absolute path .* got int"),
        (
            {**VLLM, "tokenizer": {"url": "ftp://h/t.json", "sha256": SHA}},
            r"tokenizer\.url: 'ftp://h/t\.json' is not an http:// or https:// URL",
        ),
        (
            {**VLLM, "chat_template": {"path": "/t.jinja", "size": 1}},
            r"chat_template\.size: unknown key 'size' \(accepted keys .*: path, sha256, url\)",
        ),
    ],
)
def test_refusals_name_the_key_and_the_fix(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        profile(**given)
    assert str(refused.value).startswith("catalog.yaml: models.m.profiles.p.")
