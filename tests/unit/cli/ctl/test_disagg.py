"""ctl and a disaggregated model: ``models`` shows it with its two pools (ready of desired
each), ``replicas`` its pools' replicas with a ROLE, ``deploy --prefill/--decode`` the body
the admin API gets, and the refusals made before anything is sent (a pool named on its own,
--replicas beside the pools' counts, a bad count)."""

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
