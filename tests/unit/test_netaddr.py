"""Unit tests of llmgw.netaddr: host:port, host names, node ids, this machine's addresses."""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import pytest

from llmgw import netaddr
from llmgw.errors import ConfigError
from llmgw.netaddr import format_hostport, parse_hostport

# -- host:port ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cp1:7443", ("cp1", 7443)),
        ("cp1", ("cp1", 1234)),
        ("10.0.0.1:1", ("10.0.0.1", 1)),
        ("[::1]:65535", ("::1", 65535)),
        ("[fe80::1%eth0]", ("fe80::1%eth0", 1234)),
        (" cp1.example.com:80 ", ("cp1.example.com", 80)),
        ("node_1.fabric:29500", ("node_1.fabric", 29500)),
    ],
)
def test_parse_hostport(value: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(value, default_port=1234) == expected


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("cp1", "has no port"),
        ("", "is empty"),
        ("cp1:", "must be a number from 1 to 65535"),
        ("[::1", "without ']'"),
        ("::1", "needs brackets"),
        ("::1:29500", "needs brackets"),
        ("cp1:65536", "must be a number from 1 to 65535"),
        ("cp1:0", "must be a number from 1 to 65535"),
        ("a b:1", "not a valid host name"),
        ("999.1.1.1:5", "not a valid IPv4 address"),
        ("[cp1]:5", "brackets are only for IPv6"),
        ("[::1]x", "expected ':port' after ']'"),
        (":80", "has no host"),
        ("-bad-:80", "not a valid host name"),
    ],
)
def test_parse_hostport_refuses(value: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_hostport(value)
    assert words in str(info.value)
    assert info.value.key is None and info.value.file is None


def test_parse_hostport_port_zero_for_listeners() -> None:
    assert parse_hostport("0.0.0.0:0", allow_zero=True) == ("0.0.0.0", 0)
    with pytest.raises(ConfigError, match=r"from 0 to 65535 \(0: pick a free port\)"):
        parse_hostport("0.0.0.0:70000", allow_zero=True)


def test_parse_hostport_names_what_it_parses() -> None:
    with pytest.raises(ConfigError) as info:
        parse_hostport("node-1", what="dist_init_addr")
    assert str(info.value) == "dist_init_addr: 'node-1' has no port; give host:port"
    with pytest.raises(ConfigError, match="must be a string host:port, got int"):
        parse_hostport(7443)  # type: ignore[arg-type]


def test_format_hostport_round_trips() -> None:
    assert format_hostport("::1", 7443) == "[::1]:7443"
    assert format_hostport("cp1", 7443) == "cp1:7443"
    assert parse_hostport(format_hostport("fd00::2", 9)) == ("fd00::2", 9)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cp1", True),
        ("a_b.c-d", True),
        ("x" * 63, True),
        ("x" * 64, False),
        ("-a", False),
        ("a..b", False),
        ("", False),
    ],
)
def test_is_hostname(value: str, expected: bool) -> None:
    assert netaddr.is_hostname(value) is expected


def test_is_ip_address() -> None:
    assert netaddr.is_ip_address("10.0.0.1") and netaddr.is_ip_address("fd00::1")
    assert not netaddr.is_ip_address("[::1]") and not netaddr.is_ip_address("cp1")


def test_parse_host_for_certificates() -> None:
    assert netaddr.parse_host(" [fe80::1%eth0] ") == ipaddress.ip_address("fe80::1")
    assert netaddr.parse_host("CP.Example.COM.") == "cp.example.com"
    assert netaddr.parse_host("*.example.com") == "*.example.com"
    assert netaddr.parse_host("  ") is None
    with pytest.raises(ConfigError, match="neither an IP address nor a DNS name") as info:
        netaddr.parse_host("bad host")
    assert info.value.key == "hosts"


# -- node ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node_id",
    [
        "gpu1",
        "a",
        "node-7",
        "gpu1.rack2.example.com",
        "0node",
        "x" * 63,
        ".".join(["a" * 63] * 3) + "." + "b" * 61,  # 253 characters
        "llmgw",
        "my-llmgw-node",
    ],
)
def test_valid_node_ids(node_id: str) -> None:
    assert netaddr.validate_node_id(node_id) == node_id


@pytest.mark.parametrize(
    ("node_id", "reason"),
    [
        ("", "empty"),
        ("GPU1", "upper-case"),
        ("gpu_1", "label"),
        ("gpu 1", "label"),
        ("-gpu", "label"),
        ("gpu-", "label"),
        ("a..b", "empty label"),
        (".gpu", "empty label"),
        ("gpu.", "empty label"),
        ("x" * 64, "64 characters"),
        (".".join(["a" * 63] * 4), "255 characters"),
        ("llmgw-control-plane", "reserved"),
        ("llmgw-anything", "reserved"),
        ("localhost", "localhost"),
        ("gpu.localhost", "localhost"),
        ("10.0.0.1", "IP address"),
        ("gpü1", "label"),
        ("gpu/1", "label"),
    ],
)
def test_invalid_node_ids(node_id: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        netaddr.validate_node_id(node_id)
    message = str(info.value)
    assert message.startswith("node_id: invalid node id")
    assert reason in message
    assert "a node id must be a DNS name" in message
    assert info.value.exit_code == 2
    assert info.value.key == "node_id"


def test_the_reserved_name_is_never_a_node_id() -> None:
    with pytest.raises(ConfigError, match="control-plane certificate carries"):
        netaddr.validate_node_id(netaddr.CONTROL_PLANE_NAME)


def test_node_ids_the_control_plane_answers_to_are_refused() -> None:
    taken = ["cp-host.rack1.", "Other.Example", "10.0.0.5"]
    for node_id in ("cp-host.rack1", "other.example"):
        with pytest.raises(ConfigError, match="the control plane answers to that name"):
            netaddr.check_node_id_free(node_id, taken)
    assert netaddr.check_node_id_free("gpu-1", taken) == "gpu-1"
    with pytest.raises(ConfigError, match="upper-case"):
        netaddr.check_node_id_free("Bad_Name", taken)


# -- this machine ------------------------------------------------------------------------------


def test_local_addresses() -> None:
    addrs = netaddr.local_addresses()
    assert len(addrs) == len(set(addrs))
    for must in ("localhost", "127.0.0.1", "::1"):
        assert must in addrs
    hostname = socket.gethostname()
    assert hostname in addrs or hostname.lower() in [a.lower() for a in addrs]
    for a in addrs:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            continue
        assert not (ip.version == 6 and ip.is_link_local)
    assert addrs == netaddr.local_addresses()


def test_local_addresses_never_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(*_: object) -> object:
        raise OSError("nope")

    monkeypatch.setattr(socket, "if_nameindex", boom)
    monkeypatch.setattr(socket, "gethostname", boom)
    monkeypatch.setattr(socket, "getfqdn", boom)
    monkeypatch.setattr(netaddr, "_IF_INET6", tmp_path / "missing")
    assert netaddr.local_addresses() == ["localhost", "127.0.0.1", "::1"]


def test_local_addresses_reads_if_inet6(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = tmp_path / "if_inet6"
    f.write_text(
        "00000000000000000000000000000001 01 80 10 80       lo\n"
        "fe80000000000000021122fffe334455 02 40 20 80     eth0\n"
        "20010db8000000000000000000000042 02 40 00 80     eth0\n"
        "garbage\n"
    )
    monkeypatch.setattr(netaddr, "_IF_INET6", f)
    addrs = netaddr.local_addresses()
    assert "2001:db8::42" in addrs
    assert not any(a.startswith("fe80") for a in addrs)


def test_local_addresses_drops_names_no_certificate_can_carry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "bad host name")
    monkeypatch.setattr(socket, "getfqdn", lambda: "LOCALHOST.")
    monkeypatch.setattr(socket, "if_nameindex", lambda: [])
    monkeypatch.setattr(netaddr, "_IF_INET6", tmp_path / "missing")
    assert netaddr.local_addresses() == ["LOCALHOST.", "127.0.0.1", "::1"]
