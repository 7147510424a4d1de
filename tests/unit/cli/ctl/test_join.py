"""``llmgw ctl join-command``: --ttl in llmgw's one duration syntax (``llmgw.durations``; "500ms"
is new, "-5m" and "1e3" are refused here now rather than by the control plane), what is sent,
and what the operator reads. The admin API is a stand-in recording each call."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import Result

from llmgw.contracts.joining import refusal
from tests.unit.cli.ctl.fakeapi import FakeAPI


def said(out: Result) -> str:
    """What the command said on stderr, its lines joined (click does not wrap an error,
    but a terminal's width must not decide a test)."""
    return " ".join(out.stderr.split())


ANSWER = {
    "id": "jt1",
    "node": "gpu-01",
    "kind": "join",
    "expires_at": 2_000_000_000,
    "enroll_url": "https://cp:8443",
    "ca_hash": "sha256:ab",
    "command": "curl -sfL https://cp:8080/install | sh -s -- --node-id gpu-01",
}


@pytest.fixture
def api() -> FakeAPI:
    return FakeAPI(lambda method, path, body: ANSWER)


@pytest.fixture
def calls(api: FakeAPI) -> list[tuple[str, str, Any]]:
    return api.calls


@pytest.mark.parametrize(
    ("ttl", "seconds"),
    [("1h", 3600.0), ("90", 90.0), ("30m", 1800.0), ("2d", 172800.0), ("500ms", 0.5)],
)
def test_ttl_is_a_duration(
    api: FakeAPI, calls: list[tuple[str, str, Any]], ttl: str, seconds: float
) -> None:
    out = api.ctl("join-command", "--node", "gpu-01", "--ttl", ttl)
    assert out.exit_code == 0, out.output
    assert calls == [
        (
            "POST",
            "/api/join-tokens",
            {"node": "gpu-01", "ttl": seconds, "rekey": False, "require_approval": False},
        )
    ]


def test_the_default_ttl_is_an_hour(api: FakeAPI, calls: list[tuple[str, str, Any]]) -> None:
    assert api.ctl("join-command", "--node", "gpu-01").exit_code == 0
    assert calls[0][2]["ttl"] == 3600.0


@pytest.mark.parametrize("ttl", ["1x", "-5m", "1e3", "h", ""])
def test_a_ttl_that_is_not_a_duration_is_refused_before_any_call(
    api: FakeAPI, calls: list[tuple[str, str, Any]], ttl: str
) -> None:
    out = api.ctl("join-command", "--node", "gpu-01", "--ttl", ttl)
    assert out.exit_code == 2
    assert "Invalid value for '--ttl': must be seconds, or a duration like 500ms, 30s" in out.stderr
    assert calls == []


def test_rekey_and_what_the_operator_reads(api: FakeAPI, calls: list[tuple[str, str, Any]]) -> None:
    out = api.ctl(
        "join-command", "--rekey", "gpu-01", "--require-approval", "--address", "cp.example:8080"
    )
    assert out.exit_code == 0, out.output
    assert calls[0][2] == {
        "node": "gpu-01",
        "ttl": 3600.0,
        "rekey": True,
        "require_approval": True,
        "address": "cp.example:8080",
    }
    lines = out.stdout.splitlines()
    assert lines[0].startswith("join token jt1 for node gpu-01, valid until ")
    assert lines[1:3] == ["enrol URL: https://cp:8443", "CA hash:   sha256:ab"]
    assert f"  {ANSWER['command']}" in lines
    assert lines[-1] == (
        "then compare the fingerprint it prints and approve: llmgw ctl approve gpu-01 "
        "--fingerprint sha256:…"
    )


def test_node_and_rekey_go_alone(api: FakeAPI, calls: list[tuple[str, str, Any]]) -> None:
    out = api.ctl("join-command", "--node", "a", "--rekey", "b")
    assert out.exit_code == 2
    assert "give exactly one of --node NODE (a new node) or --rekey NODE" in out.stderr
    out = api.ctl("join-command", "--node", "a", "--require-approval")
    assert out.exit_code == 2
    assert refusal("require_approval_on_join", node="a") in said(out)
    assert calls == []


@pytest.mark.parametrize("flag", ["--re-pair", "--lost-state"])
def test_re_pair_goes_with_rekey(
    api: FakeAPI, calls: list[tuple[str, str, Any]], flag: str
) -> None:
    out = api.ctl("join-command", "--node", "gpu-01", flag)
    assert out.exit_code == 2
    assert refusal("repair_without_rekey", node="gpu-01") in said(out)
    assert calls == []


def test_lost_state_is_re_pairs_old_name_and_warns(
    api: FakeAPI, calls: list[tuple[str, str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = dict(ANSWER, kind="rekey", re_pair=True, node_uid="0123abcd")
    api.handler = lambda method, path, body: answer
    out = api.ctl("join-command", "--rekey", "gpu-01", "--lost-state")
    assert out.exit_code == 0, out.output
    assert calls[0][2]["re_pair"] is True and "lost_state" not in calls[0][2]
    assert "warning: --lost-state is the old name of --re-pair; use --re-pair" in out.stderr


def test_lost_state_is_sent_and_the_uid_shown(
    api: FakeAPI, calls: list[tuple[str, str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    answer = dict(ANSWER, kind="rekey", re_pair=True, node_uid="0123abcd")
    api.handler = lambda method, path, body: answer
    out = api.ctl("join-command", "--rekey", "gpu-01", "--re-pair", "--fabric", "ib-a:mlx5_0")
    assert out.exit_code == 0, out.output
    assert calls[0][2] == {
        "node": "gpu-01",
        "ttl": 3600.0,
        "rekey": True,
        "require_approval": False,
        "re_pair": True,
        "facts": {"fabrics": ["ib-a:mlx5_0"]},
    }
    lines = out.stdout.splitlines()
    assert lines[0].startswith("re-pair token jt1 for node gpu-01, valid until ")
    assert lines[1] == "node uid:  0123abcd (kept: same record, history and placement)"


def test_node_facts_are_checked_here_and_sent(
    api: FakeAPI, calls: list[tuple[str, str, Any]]
) -> None:
    out = api.ctl("join-command",
        "--node", "gpu-01",
        "--fabric", "ib-a:mlx5_0,mlx5_1", "--fabric", "ib-b:mlx5_2",
        "--nvidia-smi", "/usr/bin/nvidia-smi", "--ib-root", "/sys/class/infiniband",
        "--engine", "vllm=/opt/vllm/bin/vllm",
        "--models-root", "/data/models", "--cache-root", "/data/cache",
        "--firewall-from", "10.0.0.1", "--fabric-peers", "192.168.50.0/24",
        "--node-address", "10.0.0.5",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    assert calls[0][2]["facts"] == {
        "node_address": "10.0.0.5",
        "fabrics": ["ib-a:mlx5_0,mlx5_1", "ib-b:mlx5_2"],
        "nvidia_smi": "/usr/bin/nvidia-smi",
        "ib_root": "/sys/class/infiniband",
        "engines": ["vllm=/opt/vllm/bin/vllm"],
        "models_root": "/data/models",
        "cache_root": "/data/cache",
        "firewall_from": ["10.0.0.1"],
        "fabric_peers": ["192.168.50.0/24"],
    }


@pytest.mark.parametrize(
    ("args", "piece"),
    [
        (["--fabric", "IB:mlx5_0"], "--fabric: 'IB:mlx5_0' does not start with a fabric name"),
        (["--fabric", "ib-a", "--fabric", "ib-b"], "fabrics ib-a and ib-b both name no adapters"),
        (["--node-address", "gpu-01.lan"], "--node-address: 'gpu-01.lan' is not an IP address"),
        (["--node-address", "10.0.0.5", "--mgmt-interface", "eth1"], "give one"),
        (["--mgmt-interface", "eth1 up"], "is not a network interface name"),
        (["--set-hostname"], refusal("set_hostname_without_cloud_init", node="gpu-01")),
        (["--nvidia-smi", "/opt/nv smi"], "other than letters, digits"),
        (["--engine", "sim=/x"], "built in and takes no program"),
        (["--engine", "tgi=/x"], "names no engine llmgw knows"),
        (["--nvidia-smi", "nvidia-smi"], "is not an absolute path"),
        (["--models-root", "/my models"], "other than letters, digits"),
        (["--firewall-from", "anyone"], "is not an IP address or CIDR"),
        (["--fabric-peers", "10.0.0.0/40"], "is not an IP address or CIDR"),
    ],
)
def test_bad_node_facts_are_refused_before_any_call(
    api: FakeAPI, calls: list[tuple[str, str, Any]], args: list[str], piece: str
) -> None:
    out = api.ctl("join-command", "--node", "gpu-01", *args)
    assert out.exit_code == 2
    assert piece in said(out)
    assert calls == []


def test_a_plain_rekey_takes_no_node_facts(api: FakeAPI, calls: list[tuple[str, str, Any]]) -> None:
    out = api.ctl("join-command", "--rekey", "gpu-01", "--fabric", "ib-a:mlx5_0")
    assert out.exit_code == 2
    assert refusal("facts_on_rekey", facts="--fabric") in said(out)
    assert calls == []


def test_tokens_lists_a_re_pair_token_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = [
        {
            "id": "jt1",
            "node": "gpu-01",
            "kind": "rekey",
            "re_pair": True,
            "prefix": "llmgwjt_abcdef",
            "expires_at": 4_000_000_000,
            "used_at": None,
            "revoked_at": None,
            "active": True,
        },
        {
            "id": "jt2",
            "node": "gpu-02",
            "kind": "rekey",
            "lost_state": False,
            "prefix": "llmgwjt_ghijkl",
            "expires_at": 4_000_000_000,
            "used_at": None,
            "revoked_at": None,
            "active": True,
        },
    ]
    out = FakeAPI(lambda method, path, body: listed).ctl("tokens")
    assert out.exit_code == 0, out.output
    rows = out.stdout.splitlines()[1:]
    assert rows[0].split()[:4] == ["jt1", "gpu-01", "rekey", "(re-pair)"]
    assert rows[1].split()[:4] == ["jt2", "gpu-02", "rekey", "llmgwjt_ghijkl…"]


def test_auto_approve_is_sent_and_the_operator_told_no_approval_follows(
    api: FakeAPI, monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str, Any]]
) -> None:
    monkeypatch.setitem(ANSWER, "auto_approve", True)
    out = api.ctl("join-command", "--node", "gpu-01", "--auto-approve")
    assert out.exit_code == 0, out.output
    assert calls[0][2]["auto_approve"] is True and calls[0][2]["ttl"] == 3600.0
    assert "approved when it joins (auto-approve: trust on first use" in out.stdout
    assert "llmgw ctl approve" not in out.stdout


def test_cloud_init_prints_only_the_user_data_and_leaves_the_ttl_to_the_server(
    api: FakeAPI, monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, str, Any]]
) -> None:
    user_data = "#cloud-config\nwrite_files: []\n"
    monkeypatch.setitem(ANSWER, "user_data", user_data)
    out = api.ctl("join-command", "--node", "gpu-01", "--cloud-init", "--fabric", "ib-a:mlx5_0")
    assert out.exit_code == 0, out.output
    body = calls[0][2]
    assert body["cloud_init"] is True and "ttl" not in body  # the server's default: 24 h
    assert body["facts"] == {"fabrics": ["ib-a:mlx5_0"]}
    assert out.stdout == user_data
    assert api.ctl("join-command", "--node", "gpu-01", "--cloud-init", "--ttl", "2h").exit_code == 0
    assert calls[1][2]["ttl"] == 7200.0
    assert "set_hostname" not in calls[1][2]
    named = api.ctl(
        "join-command", "--node", "gpu-01", "--cloud-init", "--set-hostname", "--fabric", "ib-b"
    )
    assert named.exit_code == 0, named.output
    assert calls[2][2]["set_hostname"] is True
    assert calls[2][2]["facts"] == {"fabrics": ["ib-b"]}  # found on the node at install


@pytest.mark.parametrize(
    ("args", "piece"),
    [
        (
            ["--rekey", "gpu-01", "--auto-approve"],
            refusal(
                "auto_approve_on_rekey", node="gpu-01", kind="rekey", proof="proved by the old one"
            ),
        ),
        (["--rekey", "gpu-01", "--re-pair", "--auto-approve"], "--node gpu-01 --auto-approve"),
        (
            ["--rekey", "gpu-01", "--cloud-init"],
            refusal("cloud_init_on_rekey", node="gpu-01", kind="rekey", repair_flag=""),
        ),
    ],
)
def test_auto_approve_and_cloud_init_refuse_a_rekey_before_any_call(
    api: FakeAPI, calls: list[tuple[str, str, Any]], args: list[str], piece: str
) -> None:
    out = api.ctl("join-command", *args)
    assert out.exit_code == 2
    assert piece in said(out)
    assert calls == []


def test_tokens_show_an_auto_approve_token_and_the_key_it_approved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed = [
        {
            "id": "jt3",
            "node": "gpu-03",
            "kind": "join",
            "lost_state": False,
            "auto_approve": True,
            "approved_fingerprint": "sha256:feed",
            "prefix": "llmgwjt_mnopqr",
            "expires_at": 4_000_000_000,
            "used_at": 3_000_000_000,
            "revoked_at": None,
            "active": False,
        },
    ]
    out = FakeAPI(lambda method, path, body: listed).ctl("tokens", "--all")
    assert out.exit_code == 0, out.output
    row = out.stdout.splitlines()[1]
    assert row.split()[:4] == ["jt3", "gpu-03", "join", "(auto-approve)"]
    assert row.rstrip().endswith("used, approved sha256:feed")


def test_without_bundles_it_says_how_to_get_the_one_liner(
    api: FakeAPI, calls: list[tuple[str, str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control plane serves no bundles: the command is 'llmgw agent join', and ctl says
    where a one-line install comes from (the bundles package, or bundle_dir)."""
    agent_join = "LLMGW_JOIN_TOKEN=s3cret llmgw agent join --node-id gpu-01 --enroll-url x"
    monkeypatch.setitem(ANSWER, "command", agent_join)
    out = api.ctl("join-command", "--node", "gpu-01")
    assert out.exit_code == 0, out.output
    assert f"  {agent_join}\n" in out.stdout
    assert "install the llmgw-agent-bundles package on the control plane" in out.stderr
    # With bundles, the one-liner alone.
    monkeypatch.setitem(ANSWER, "command", "(set -eu; ... /agent/bundles/ ...)")
    assert "llmgw-agent-bundles" not in api.ctl("join-command", "--node", "gpu-01").stderr
