"""The data-plane address a node reports (llmgw.agent.address): mgmt_interface's address
(IPv4 first, then a global IPv6), refused at ``llmgw agent --check`` when the interface is
missing or has none, and the route-based default. Run in a network namespace of the test's
own, with veth interfaces (no dummy module on these machines), as root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci import require_tools, unavailable

LLMGW = Path(sys.executable).parent / "llmgw"

# v0: IPv4 and a global IPv6; v1: IPv6 only (its link-local too); v2: up, no address of its
# own (only the tentative link-local the kernel gives it); v3, v2's peer, in 10.8.0.0/24.
SETUP = """
ip link set lo up
ip link add v0 type veth peer name v1
ip link add v2 type veth peer name v3
ip addr add 10.9.0.2/24 dev v0
ip -6 addr add fd00:a::2/64 dev v0 nodad
ip -6 addr add fd00:9::2/64 dev v1 nodad
ip addr add 10.8.0.2/24 dev v3
for i in v0 v1 v2 v3; do ip link set "$i" up; done
"""


def ip_netns(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def netns() -> Iterator[str]:
    if os.geteuid() != 0:
        unavailable("network namespaces need root: run the tests as root")
    require_tools("ip")
    name = f"llmgw-addr-{os.getpid()}"
    made = ip_netns("add", name)
    if made.returncode != 0:
        unavailable(f"ip netns add failed here ({made.stderr.strip()})")
    try:
        setup = ip_netns("exec", name, "sh", "-ec", SETUP)
        assert setup.returncode == 0, setup.stderr
        yield name
    finally:
        ip_netns("del", name)


def run_in(netns: str, code: str) -> object:
    """Python ``code`` run inside the namespace; what it prints, as JSON."""
    done = ip_netns("exec", netns, sys.executable, "-c", textwrap.dedent(code))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def check(netns: str, tmp_path: Path, extra: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "agent.yaml"
    config.write_text(f"server: 10.9.0.7:7443\nnode_id: gpu-01\n{extra}")
    return ip_netns("exec", netns, str(LLMGW), "agent", "--config", str(config), "--check")


def test_an_interfaces_address_ipv4_first_then_a_global_ipv6(netns: str) -> None:
    said = run_in(
        netns,
        """
        import json
        from llmgw.errors import ConfigError
        from llmgw.netaddr import interface_address
        out = {}
        for name in ("v0", "v1", "v2", "eth9"):
            try:
                out[name] = interface_address(name)
            except ConfigError as exc:
                out[name] = "error: " + str(exc)
        print(json.dumps(out))
        """,
    )
    assert said == {
        "v0": "10.9.0.2",
        "v1": "fd00:9::2",
        "v2": "error: network interface 'v2' has no IPv4 or global IPv6 address (is it up "
        "and configured? 'ip address show v2'); give it one, name another interface, or set "
        "mgmt_addr: ADDRESS instead",
        "eth9": "error: this machine has no network interface 'eth9' (it has: lo, v0, v1, v2, "
        "v3); name the one the control plane reaches this node on ('ip -brief address' lists "
        "them), or set mgmt_addr: ADDRESS instead",
    }


def test_check_says_the_address_and_refuses_an_interface_without_one(
    netns: str, tmp_path: Path
) -> None:
    good = check(netns, tmp_path, "mgmt_interface: v1\n")
    assert good.returncode == 0, good.stderr
    assert good.stdout.endswith(", data plane address fd00:9::2 from v1)\n"), good.stdout
    config = tmp_path / "agent.yaml"
    for iface, why in (
        ("eth9", "this machine has no network interface 'eth9' (it has: lo, v0, v1, v2, v3)"),
        ("v2", "network interface 'v2' has no IPv4 or global IPv6 address"),
    ):
        bad = check(netns, tmp_path, f"mgmt_interface: {iface}\n")
        assert bad.returncode == 2, bad.stdout
        assert bad.stderr.startswith(f"error: {config}: mgmt_interface: {why}"), bad.stderr
    fixed = check(netns, tmp_path, "mgmt_addr: 10.9.0.5\n")
    assert fixed.stdout.endswith(", data plane address 10.9.0.5)\n"), fixed.stdout


def test_the_reported_address_comes_from_the_interface_then_the_route(netns: str) -> None:
    """mgmt_interface wins over the route (the node reports v1's address though the control
    plane is reached through v0); without it the route's source address is reported, the
    bound address when it is not a wildcard; an interface that loses its address while the
    agent runs keeps reporting the last one it had."""
    said = run_in(
        netns,
        """
        import json, subprocess
        from llmgw.agent.address import DataplaneAddress, source_address_towards
        from llmgw.agent.config import parse_agent_config
        def address(**extra):
            cfg = parse_agent_config({"server": "10.9.0.7:7443", "node_id": "gpu-01", **extra})
            return DataplaneAddress(cfg)
        out = {
            "towards 10.9.0.7": source_address_towards("10.9.0.7:7443"),
            "towards 10.8.0.9": source_address_towards("10.8.0.9:7443"),
            "towards fd00:9::7": source_address_towards("[fd00:9::7]:7443"),
            "no route": source_address_towards("192.0.2.1:7443"),
            "default, wildcard": address().host("0.0.0.0", "10.8.0.9:7443"),
            "default, bound": address().host("10.9.0.2", "10.8.0.9:7443"),
        }
        on_v1 = address(mgmt_interface="v1")
        out["mgmt_interface"] = on_v1.host("0.0.0.0", "10.9.0.7:7443")
        subprocess.run(["ip", "-6", "addr", "del", "fd00:9::2/64", "dev", "v1"], check=True)
        out["address gone"] = on_v1.host("0.0.0.0", "10.9.0.7:7443")
        subprocess.run(["ip", "-6", "addr", "add", "fd00:9::2/64", "dev", "v1", "nodad"], check=True)
        subprocess.run(["ip", "route", "add", "default", "via", "10.9.0.1"], check=True)
        out["default route"] = source_address_towards("192.0.2.1:7443")
        subprocess.run(["ip", "route", "del", "default"], check=True)
        print(json.dumps(out))
        """,
    )
    assert said == {
        "towards 10.9.0.7": "10.9.0.2",
        "towards 10.8.0.9": "10.8.0.2",
        "towards fd00:9::7": "fd00:9::2",
        "no route": "127.0.0.1",
        "default, wildcard": "10.8.0.2",
        "default, bound": "10.9.0.2",
        "mgmt_interface": "fd00:9::2",
        "address gone": "fd00:9::2",
        "default route": "10.9.0.2",
    }


def test_the_agent_refuses_to_start_without_the_interfaces_address(netns: str) -> None:
    said = run_in(
        netns,
        """
        import json
        from llmgw.agent.address import DataplaneAddress
        from llmgw.agent.config import parse_agent_config
        from llmgw.errors import ConfigError
        cfg = parse_agent_config({"server": "cp:7443", "node_id": "gpu-01", "mgmt_interface": "v2"})
        try:
            DataplaneAddress(cfg)
            print(json.dumps("started"))
        except ConfigError as exc:
            print(json.dumps(str(exc)))
        """,
    )
    assert isinstance(said, str) and said.startswith(
        "mgmt_interface: network interface 'v2' has no IPv4"
    ), said
