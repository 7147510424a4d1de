"""``llmgw ctl engines``: what install, forget and the listing send, what the operator reads,
the usage refusals, and the exit code when a node cannot get the build. The admin API is a
stand-in answering each call from a script."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from tests.unit.cli.ctl.fakeapi import FakeAPI

# The module (the package's attribute of that name is the click group).
engines_module = importlib.import_module("llmgw.cli.ctl.engines")

SHA = "a" * 64
URL = "https://pub.example/llama-b1-x64.tar.gz"


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeAPI:
    """The admin API; a test sets its answers (``api.handler = fn``)."""
    monkeypatch.setattr(engines_module.time, "sleep", lambda _s: None)
    return FakeAPI(lambda method, path, body: pytest.fail(f"unexpected {method} {path}"))


def row(
    node: str, state: str, reason: str = "", op: str | None = None, **kw: Any
) -> dict[str, Any]:
    out = {
        "node": node,
        "arch": "x86_64",
        "engine": "llamacpp",
        "desired": "b1",
        "desired_for": "all",
        "installed": "",
        "offered": "",
        "state": state,
        "reason": reason,
        "op_id": op,
        "connected": True,
    }
    out.update(kw)
    return out


def test_install_all_records_waits_for_the_connected_and_shows_each_node(
    api: FakeAPI,
) -> None:
    seen = api.calls
    polls = iter(
        [
            [{"op_id": "op1", "node": "gpu-1", "state": "installing", "error": ""}],
            [{"op_id": "op1", "node": "gpu-1", "state": "installed", "error": ""}],
        ]
    )

    def reply(method: str, path: str, body: Any) -> Any:
        if method == "POST":
            return {
                "replaced": True,
                "nodes": [
                    row("gpu-1", "installing", "llamacpp b1 is being installed", op="op1"),
                    row("gpu-2", "waiting", "llamacpp b1 is ordered when the node connects"),
                ],
            }
        return next(polls)

    api.handler = reply
    out = api.ctl("engines", "install", "--all", "llamacpp", "b1", "--url", URL, "--sha256", SHA)
    assert out.exit_code == 0, out.output
    assert seen[0] == (
        "POST",
        "/api/engines/install",
        {
            "engine": "llamacpp",
            "version": "b1",
            "all": True,
            "builds": [{"arch": "", "url": URL, "sha256": SHA}],
        },
    )
    assert seen[1:] == [("GET", "/api/engines/installs?op=op1", None)] * 2
    assert out.output == (
        "llamacpp b1 replaces the version desired before\n"
        "NODE   ARCH    ENGINE    VERSION  STATE    REASON\n"
        "gpu-1  x86_64  llamacpp  b1       ready\n"
        "gpu-2  x86_64  llamacpp  b1       waiting  llamacpp b1 is ordered when the node connects\n"
    )


def test_install_on_one_node_with_a_build_per_arch_and_a_failure_exits_1(
    api: FakeAPI,
) -> None:
    seen = api.calls

    def reply(method: str, path: str, body: Any) -> Any:
        if method == "POST":
            return {"replaced": False, "nodes": [row("gpu-1", "installing", op="op9")]}
        return [{"op_id": "op9", "node": "gpu-1", "state": "failed", "error": "checksum mismatch"}]

    api.handler = reply
    out = api.ctl(
        "engines",
        "install",
        "gpu-1",
        "llamacpp",
        "b1",
        "--build",
        "x86_64",
        URL,
        SHA,
        "--build",
        "aarch64",
        "https://pub.example/arm.tgz",
        "b" * 64,
    )
    assert out.exit_code == 1, out.output
    assert seen[0][2]["node"] == "gpu-1"
    assert [b["arch"] for b in seen[0][2]["builds"]] == ["x86_64", "aarch64"]
    assert out.output.splitlines()[-1] == (
        "gpu-1  x86_64  llamacpp  b1       failed  checksum mismatch"
    )


def test_install_without_waiting_and_a_node_without_a_build_exits_1(
    api: FakeAPI,
) -> None:
    seen = api.calls
    api.handler = lambda m, p, b: {
        "replaced": False,
        "nodes": [row("arm-1", "no-build", "no llamacpp b1 build for aarch64", arch="aarch64")],
    }
    out = api.ctl("--json", "engines", "install", "--all", "llamacpp", "b1", "--url", URL,
              "--sha256", SHA, "--arch", "x86_64", "--no-wait")  # fmt: skip
    assert out.exit_code == 1
    assert len(seen) == 1
    assert '"state": "no-build"' in out.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llamacpp", "b1", "--url", URL, "--sha256", SHA], "give NODE ENGINE VERSION, or --all ENGINE VERSION"),
        (["gpu-1", "llamacpp", "b1", "--all", "--url", URL, "--sha256", SHA], "give NODE ENGINE VERSION, or --all ENGINE VERSION"),
        (["--all", "sim", "1", "--url", URL, "--sha256", SHA], "engine 'sim' cannot be installed: use one of llamacpp, sglang, vllm"),
        (["--all", "llamacpp", "b1", "--url", URL], "give --url and --sha256 (with --arch), or --build ARCH URL SHA256"),
        (["--all", "llamacpp", "b1", "--url", URL, "--sha256", SHA, "--build", "x86_64", URL, SHA], "give --build ARCH URL SHA256, or --url/--sha256/--arch"),
    ],
)  # fmt: skip
def test_install_usage_refusals_send_nothing(api: FakeAPI, args: list[str], message: str) -> None:
    seen = api.calls
    out = api.ctl("engines", "install", *args)
    assert out.exit_code == 2
    assert f"Error: {message}" in out.output
    assert seen == []


def test_forget_one_arch_everywhere(api: FakeAPI) -> None:
    seen = api.calls
    api.handler = lambda m, p, b: {"removed": 1}
    out = api.ctl("engines", "forget", "--all", "vllm", "--arch", "aarch64")
    assert out.exit_code == 0, out.output
    assert seen == [
        ("POST", "/api/engines/forget", {"engine": "vllm", "all": True, "arch": "aarch64"})
    ]
    assert out.output == "vllm is no longer desired on every node (1 build(s) removed)\n"
    out = api.ctl("engines", "forget", "gpu-1")
    assert out.exit_code == 2 and "give NODE ENGINE, or --all ENGINE" in out.output


def test_the_listing_shows_the_desired_set_then_each_node(
    api: FakeAPI,
) -> None:
    seen = api.calls
    api.handler = lambda m, p, b: {
        "desired": [
            {
                "node": None,
                "engine": "llamacpp",
                "version": "b1",
                "builds": [
                    {"arch": "x86_64", "url": URL, "sha256": SHA},
                    {"arch": "", "url": "https://pub.example/any.tgz?…", "sha256": "b" * 64},
                ],
            }
        ],
        "nodes": [
            row("gpu-1", "ready", installed="b1"),
            row("gpu-2", "failed", "llamacpp b1 failed to install: download failed"),
            row("gpu-2", "offered", engine="vllm", desired="", arch=""),
        ],
    }
    out = api.ctl("engines")
    assert out.exit_code == 0, out.output
    assert seen == [("GET", "/api/engines", None)]
    assert out.output == (
        "DESIRED ON  ENGINE    VERSION  ARCH    SHA256        URL\n"
        f"(all)       llamacpp  b1       x86_64  aaaaaaaaaaaa  {URL}\n"
        "(all)       llamacpp  b1       any     bbbbbbbbbbbb  https://pub.example/any.tgz?…\n"
        "\n"
        "NODE   ARCH    ENGINE    DESIRED  INSTALLED  STATE    REASON\n"
        "gpu-1  x86_64  llamacpp  b1       b1         ready\n"
        "gpu-2  x86_64  llamacpp  b1       -          failed   llamacpp b1 failed to install: "
        "download failed\n"
        "gpu-2  ?       vllm      -        -          offered\n"
    )


def test_the_listing_says_how_to_desire_when_nothing_is(
    api: FakeAPI,
) -> None:
    api.handler = lambda m, p, b: {"desired": [], "nodes": []}
    out = api.ctl("engines")
    assert out.output.splitlines()[0] == (
        "no engine is desired; 'llmgw ctl engines install --all ENGINE VERSION ...'"
    )
