"""The install order's fields, one rule for the control plane and the agent: the
architectures' one table, the URL a node may be ordered to fetch, how a URL is shown."""

from __future__ import annotations

import pytest

from llmgw.contracts.install_order import (
    ARCH_ALIASES,
    MAX_URL,
    SHA256,
    VERSION,
    canonical_arch,
    display_url,
    url_problem,
)
from llmgw.contracts.update_order import ARCHES

# The agent's own table before the contract; the control plane's was ARCHES. The two gave
# the same answer for every name: the contract keeps ARCHES, the one release bundles use.
AGENT_TABLE_BEFORE = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


def test_every_spelling_of_an_architecture_has_one_uname_name() -> None:
    for name, machine in AGENT_TABLE_BEFORE.items():
        assert canonical_arch(name) == machine
    for bundle, machines in ARCHES.items():
        for name in (bundle, *machines):
            assert canonical_arch(name) == machines[0]
            assert canonical_arch(f" {name.upper()} ") == machines[0]
    assert set(ARCH_ALIASES.values()) == {"x86_64", "aarch64"}
    assert canonical_arch("riscv64") == "riscv64"


def test_version_and_sha256() -> None:
    assert VERSION.fullmatch("b4242") and VERSION.fullmatch("0.8.5+cu124")
    assert not VERSION.fullmatch("-rc1") and not VERSION.fullmatch("x" * 65)
    assert not VERSION.fullmatch("../x")
    assert SHA256.fullmatch("aB" * 32) and not SHA256.fullmatch("a" * 63)


@pytest.mark.parametrize(
    "url",
    [
        "https://pub.example/x.tgz",
        "http://mirror.lan:8080/builds/x.tgz",
        "file:///srv/builds/x.tgz",
        "https://pub.example/x.tgz?X-Amz-Signature=abc",
    ],
)
def test_a_url_some_node_may_fetch(url: str) -> None:
    assert url_problem(url) is None


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("ftp://pub.example/x.tgz", "only https://, http:// and file:// URLs are allowed"),
        ("https:///x.tgz", "needs a host"),
        ("https://[::1/x.tgz", "IPv6"),
        # What the control plane accepted before the contract, and every agent refused.
        ("https://pub.example/a/../x.tgz", "'.' or '..' segments"),
        ("https://pub.example:99999/x.tgz", "port"),
        ("file://host/srv/x.tgz", "file:///DIR/"),
        # What the agent accepted before the contract (no control plane sent one).
        ("https://pub.example/" + "x" * MAX_URL, f"at most {MAX_URL} characters"),
        ("https://pub.example/x\x00.tgz", "control characters"),
    ],
)
def test_a_url_no_node_fetches_says_why(url: str, said: str) -> None:
    problem = url_problem(url)
    assert problem is not None and said in problem


def test_a_url_is_shown_without_its_credentials() -> None:
    shown = display_url("https://user:secret@pub.example:8443/x.tgz?X-Amz-Signature=abc")
    assert shown == "https://pub.example:8443/x.tgz?…"
    assert display_url("https://[::1/x.tgz?sig=1") == "https://[::1/x.tgz"
