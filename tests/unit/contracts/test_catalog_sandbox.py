"""A profile's sandbox key: false, or extra_ro/extra_rw paths; refused with the fix and the
dotted key; stored only when given; carried to the agent in StartShard."""

from __future__ import annotations

import json
from typing import Any

import pytest

from llmgw.contracts.catalog import Profile, parse_catalog, parse_profile
from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.errors import ConfigError
from llmgw.proto import control_pb2 as pb

P = "models.m.profiles.p"


def _parse(sandbox: Any) -> Profile:
    profile = {"engine": "llamacpp", "source": "m.gguf", "gpus": 0, "sandbox": sandbox}
    catalog = parse_catalog({"models": {"m": {"profiles": {"p": profile}}}}, source="c.yaml")
    return catalog.models["m"].profiles["p"]


def _refusal(sandbox: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _parse(sandbox)
    return str(info.value)


def test_without_the_key_a_profile_is_sandboxed_and_stores_nothing_of_it() -> None:
    profile = (
        parse_catalog({"models": {"m": {"profiles": {"p": {"engine": "sim"}}}}}, source="c.yaml")
        .models["m"]
        .profiles["p"]
    )
    assert profile.sandbox == SandboxPolicy() and profile.sandbox.enabled
    assert "sandbox" not in profile.to_dict()


def test_false_turns_it_off_and_the_extras_are_kept_in_order() -> None:
    off = _parse(False)
    assert off.sandbox == SandboxPolicy(enabled=False)
    assert off.to_dict()["sandbox"] is False
    on = _parse({"extra_ro": ["/opt/data", "/srv/shared/"], "extra_rw": ["/scratch/big"]})
    assert on.sandbox == SandboxPolicy(
        extra_ro=("/opt/data", "/srv/shared"), extra_rw=("/scratch/big",)
    )
    assert _parse(True).sandbox == SandboxPolicy()
    # Stored and read back (the control plane parses stored profiles again).
    for profile in (off, on):
        stored = json.loads(json.dumps(profile.to_dict()))
        again = parse_profile(stored, model="m", profile="p", source="<store>")
        assert again.sandbox == profile.sandbox


def test_the_order_carries_it_and_an_order_without_it_is_sandboxed() -> None:
    policy = SandboxPolicy(extra_ro=("/opt/data",), extra_rw=("/scratch",))
    order = pb.StartShard(shard_id="s1", sandbox=policy.to_order())
    assert SandboxPolicy.from_order(
        pb.StartShard.FromString(order.SerializeToString()).sandbox
    ) == (policy)
    off = pb.StartShard(sandbox=SandboxPolicy(enabled=False).to_order())
    assert not SandboxPolicy.from_order(off.sandbox).enabled
    # A control plane that predates sandboxes sends none: the agent sandboxes.
    assert SandboxPolicy.from_order(pb.StartShard(shard_id="s1").sandbox) == SandboxPolicy()


@pytest.mark.parametrize(
    ("sandbox", "key", "words"),
    [
        ("off", "sandbox", "must be false (the engine runs unconfined) or {extra_ro:"),
        ({"extra_ro": "/opt"}, "sandbox.extra_ro", "must be a list"),
        ({"ro": ["/opt"]}, "sandbox.ro", "extra_ro"),
        ({"extra_ro": ["opt/data"]}, "sandbox.extra_ro[0]", "must be an absolute path"),
        ({"extra_rw": [7]}, "sandbox.extra_rw[0]", "must be an absolute path on the node"),
        ({"extra_ro": ["/opt/../etc"]}, "sandbox.extra_ro[0]", "without '..'"),
        ({"extra_ro": ["/"]}, "sandbox.extra_ro[0]", "the node's whole filesystem"),
        ({"extra_rw": ["/etc"]}, "sandbox.extra_rw[0]", "llmgw's configuration (/etc/llmgw)"),
        ({"extra_ro": ["/etc/llmgw/pki"]}, "sandbox.extra_ro[0]", "(/etc/llmgw)"),
        (
            {"extra_ro": ["/opt/d"], "extra_rw": ["/opt/d"]},
            "sandbox.extra_ro",
            "/opt/d is in extra_rw too",
        ),
        ({"extra_ro": [f"/p{i}" for i in range(65)]}, "sandbox.extra_ro", "at most 64"),
    ],
)
def test_a_bad_sandbox_is_refused_naming_the_key(sandbox: Any, key: str, words: str) -> None:
    message = _refusal(sandbox)
    assert message.startswith(f"c.yaml: {P}.{key}: "), message
    assert words in message
