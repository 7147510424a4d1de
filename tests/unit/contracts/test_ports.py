"""llmgw.contracts.ports: the default ports, and the one "A-B" multi-node range every side
reads (agent.yaml, the inventory, the scheduler, the installer through ``--print``)."""

from __future__ import annotations

import pytest

from llmgw.contracts.ports import DEFAULT_DATA_PORT, DEFAULT_MULTINODE_PORTS, PortRange
from llmgw.errors import ConfigError


def test_the_default_range_is_pytorchs_and_misses_the_data_plane() -> None:
    assert DEFAULT_MULTINODE_PORTS == PortRange(29500, 29999)
    assert str(DEFAULT_MULTINODE_PORTS) == "29500-29999"
    assert len(DEFAULT_MULTINODE_PORTS) == 500
    assert DEFAULT_DATA_PORT not in DEFAULT_MULTINODE_PORTS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("29500-29999", PortRange(29500, 29999)),
        ("  40000-40010\n", PortRange(40000, 40010)),
        ("1024-1024", PortRange(1024, 1024)),
        ("1024-65535", PortRange(1024, 65535)),
    ],
)
def test_parse_and_print_round_trip(text: str, expected: PortRange) -> None:
    parsed = PortRange.parse(text)
    assert parsed == expected
    assert PortRange.parse(str(parsed)) == parsed
    assert str(parsed) == f"{expected.first}-{expected.last}"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "'' is not a port range; write two port numbers joined by '-', e.g. 29500-29999"),
        ("29500", "'29500' is not a port range"),
        ("29500:29999", "'29500:29999' is not a port range"),
        ("29500 - 29999", "is not a port range"),
        ("-29500", "is not a port range"),
        ("29500-", "is not a port range"),
        ("1-2-3", "is not a port range"),
        ("0x10-0x20", "is not a port range"),
        ("123456-123457", "is not a port range"),
        (
            "\uff12\uff19\uff15\uff10\uff10-\uff13\uff10\uff10\uff10\uff10",
            "is not a port range",
        ),  # not ASCII digits
        (
            "29999-29500",
            "29999-29500 is reversed: it starts above where it ends; write the "
            "lower port first (29500-29999)",
        ),
        (
            "1023-2000",
            "1023-2000: port 1023 is outside 1024-65535; give a range of "
            "unprivileged ports, e.g. 29500-29999",
        ),
        ("0-0", "port 0 is outside 1024-65535"),
        ("60000-65536", "port 65536 is outside 1024-65535"),
    ],
)
def test_what_is_no_range_is_refused_saying_why(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        PortRange.parse(text)
    assert message in str(info.value)
    assert info.value.key is None and info.value.file is None  # the caller names them


def test_building_one_checks_it_too() -> None:
    with pytest.raises(ConfigError, match="is reversed"):
        PortRange(30001, 30000)
    with pytest.raises(ConfigError, match="port 80 is outside"):
        PortRange(80, 8080)


def test_contains_iterates_and_overlaps() -> None:
    ports = PortRange(30000, 30002)
    assert [p for p in (29999, 30000, 30002, 30003) if p in ports] == [30000, 30002]
    assert "30000" not in ports  # a port is a number
    assert list(ports) == [30000, 30001, 30002]
    assert len(ports) == 3
    assert ports.overlap(PortRange(30002, 31000)) == PortRange(30002, 30002)
    assert PortRange(29000, 40000).overlap(ports) == ports
    assert ports.overlap(PortRange(30003, 30010)) is None
    assert PortRange(30003, 30010).overlap(ports) is None
