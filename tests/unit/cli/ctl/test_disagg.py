"""ctl and a disaggregated model: ``models`` shows it with its two pools (ready of desired
each), ``replicas`` its pools' replicas with a ROLE, ``deploy --prefill/--decode`` the body
the admin API gets, and the refusals made before anything is sent (a pool named on its own,
--replicas beside the pools' counts, a bad count); ``models show`` a model's pools' load
and hand-over, and its refusals."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.cli.ctl.fakeapi import FakeAPI


def _model(**pools: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "m",
        "profile": "pd",
        "engine": "vllm",
        "gpus": 1,
        "nodes": 1,
        "replicas": 0,
        "ready": 0,
        "scaling": None,
        "unplaceable": None,
        "routing": "kv-events",
        "pools": pools or None,
    }


def _pool(gpus: int, ready: int, replicas: int, scaling: Any = None) -> dict[str, Any]:
    return {"gpus": gpus, "ready": ready, "replicas": replicas, "scaling": scaling}


def _models() -> list[dict[str, Any]]:
    plain = {**_model(), "name": "plain", "profile": "default", "replicas": 2, "ready": 1}
    pools = {
        "prefill": _pool(1, 1, 1),
        "decode": _pool(2, 2, 3, {"min": 2, "max": 4}),
    }
    return [_model(**pools), plain]


def test_models_shows_each_pool_ready_of_desired() -> None:
    api = FakeAPI(lambda method, path, body: _models())
    result = api.ctl("models")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    (row,) = [line for line in lines if line.startswith("m ")]
    assert "prefill 1/1, decode 2/3 (2-4)" in row
    assert " 1+2 " in row  # GPUs per replica, prefill+decode
    assert " 3 " in row  # ready: both pools'
    (plain,) = [line for line in lines if line.startswith("plain ")]
    assert "prefill" not in plain and " 2 " in plain


def test_replicas_lists_both_pools_with_their_role() -> None:
    def row(replica: str, role: str | None) -> dict[str, Any]:
        return {
            "replica": replica,
            "model": "m",
            "role": role,
            "state": "ready",
            "node": "gpu-1",
            "port": 8001,
            "restarts": 0,
            "inflight": 0,
            "exit_code": None,
            "reason": "",
        }

    rows = [row("m-prefill-1", "prefill"), row("m-decode-1", "decode"), row("x-1", None)]
    api = FakeAPI(lambda method, path, body: rows)
    result = api.ctl("replicas", "m")
    assert result.exit_code == 0, result.output
    header, *lines = result.output.splitlines()
    assert header.split()[:4] == ["REPLICA", "MODEL", "ROLE", "STATE"]
    assert [line.split()[:3] for line in lines] == [
        ["m-prefill-1", "m", "prefill"],
        ["m-decode-1", "m", "decode"],
        ["x-1", "m", "-"],
    ]


def _deployed(method: str, path: str, body: Any) -> dict[str, Any]:
    return {
        **_model(prefill=_pool(1, 0, 2), decode=_pool(2, 0, 1, {"min": 1, "max": 4})),
        "profile": body.get("profile", "pd"),
    }


def test_deploy_sends_each_pools_count() -> None:
    api = FakeAPI(_deployed)
    result = api.ctl("deploy", "m", "--profile", "pd", "--prefill", "2", "--decode", "1-4")
    assert result.exit_code == 0, result.output
    assert api.calls == [
        (
            "POST",
            "/api/models",
            {"name": "m", "profile": "pd", "pools": {"prefill": 2, "decode": {"min": 1, "max": 4}}},
        )
    ]
    assert "deployed m: prefill 2 replicas, decode 1-4 replicas by demand (1 now)" in result.output


def test_deploy_sends_each_pools_target_tokens() -> None:
    api = FakeAPI(_deployed)
    result = api.ctl(
        "deploy", "m", "--prefill", "1-4", "--prefill-target-tokens", "16000",
        "--decode", "1-8", "--decode-target-tokens", "4096",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert api.calls[0][2]["pools"] == {
        "prefill": {"min": 1, "max": 4, "target_tokens": 16000},
        "decode": {"min": 1, "max": 8, "target_tokens": 4096},
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["deploy", "m#prefill", "--replicas", "2"], "'llmgw ctl deploy m --prefill N|MIN-MAX'"),
        (["undeploy", "m#decode"], "'llmgw ctl undeploy m' removes the model with both pools"),
        (["replicas", "m#decode"], "'llmgw ctl replicas m' lists both pools' replicas"),
        (["deploy", "m", "--replicas", "2", "--decode", "3"], "give --prefill/--decode, or"),
        (["deploy", "m", "--decode", "3-x"], "--decode"),
        (["deploy", "m", "--prefill", "1001"], "Invalid value for --prefill: '1001'"),
        (
            ["deploy", "m", "--prefill-target-tokens", "8000"],
            "--prefill-target-tokens goes with --prefill MIN-MAX",
        ),
        (
            ["deploy", "m", "--decode", "3", "--decode-target-tokens", "8000"],
            "--decode-target-tokens tunes scaling by demand; give --decode as MIN-MAX",
        ),
        (["deploy", "m", "--prefill", "1-2", "--prefill-target-tokens", "0"], "0 is not in"),
    ],
)
def test_refusals_before_anything_is_sent(args: list[str], message: str) -> None:
    api = FakeAPI(_deployed)
    result = api.ctl(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert api.calls == []


def _shown() -> list[dict[str, Any]]:
    models = _models()
    pools = models[0]["pools"]
    pools["prefill"]["load"] = {"inflight": 2, "tokens": 16000, "decoding": 0}
    pools["decode"]["load"] = {"inflight": 5, "tokens": 1200, "decoding": 900}
    models[0]["handover"] = {
        "requests": {"handed_over": 40, "fallback": 3},
        "handed_over": 40,
        "fallbacks": {"transfer_timeout": 2, "no_prefill": 1},
        "prefill_retries": 1,
        "handover_seconds": {"p50": 0.012, "p99": 1.5, "count": 40},
        "transfer_tokens": 48000,
        "transfer_bytes": 48000 * 131072,
        "seen_by": "this instance's gateway",
    }
    return models


def test_models_show_gives_the_pools_load_and_the_hand_over() -> None:
    api = FakeAPI(lambda method, path, body: _shown())
    result = api.ctl("models", "show", "m")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "Profile:  pd (vllm)" in lines
    (prefill,) = [line.split() for line in lines if line.startswith("prefill ")]
    assert prefill == ["prefill", "1", "1/1", "2", "16,000", "-"]
    (decode,) = [line.split() for line in lines if line.startswith("decode ")]
    assert decode == ["decode", "2", "2/3", "5", "1,200", "900"]
    assert "Hand-over, as this instance's gateway saw it:" in lines
    text = "\n".join(" ".join(line.split()) for line in lines)
    assert "handed over 40" in text
    assert "fallbacks (run whole) 3" in text
    assert "transfer_timeout 2" in text and "no_prefill 1" in text
    assert "retried prefills 1" in text
    assert "hand-over p50 / p99 12 ms / 1.50 s" in text
    assert "tokens moved 48,000" in text
    assert "bytes moved 5.9 GiB" in text


def test_models_show_without_bytes_says_what_to_set() -> None:
    models = _shown()
    models[0]["handover"]["transfer_bytes"] = None
    models[0]["handover"]["handover_seconds"] = {"p50": None, "p99": None, "count": 0}
    api = FakeAPI(lambda method, path, body: models)
    result = api.ctl("models", "show", "m")
    assert result.exit_code == 0, result.output
    text = "\n".join(" ".join(line.split()) for line in result.output.splitlines())
    assert "bytes moved - (kv_bytes_per_token not set in the profile)" in text
    assert "hand-over p50 / p99 -" in text


def test_models_show_of_an_aggregated_model_has_no_hand_over() -> None:
    api = FakeAPI(lambda method, path, body: _shown())
    result = api.ctl("models", "show", "plain")
    assert result.exit_code == 0, result.output
    assert "Replicas: 1 ready of 2" in result.output
    assert "Hand-over" not in result.output and "POOL" not in result.output


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("nope", "no model nope is deployed (deployed: m, plain)"),
        ("m#decode", "m#decode is the decode pool of m: 'llmgw ctl models show m'"),
    ],
)
def test_models_show_refuses_a_model_not_deployed_or_a_pool(name: str, message: str) -> None:
    api = FakeAPI(lambda method, path, body: _shown())
    result = api.ctl("models", "show", name)
    assert result.exit_code != 0
    assert message in " ".join(result.output.split())


def test_models_show_json_is_the_apis_model() -> None:
    api = FakeAPI(lambda method, path, body: _shown())
    result = api.ctl("--json", "models", "show", "m")
    assert result.exit_code == 0, result.output
    assert '"transfer_tokens": 48000' in result.output
