"""llmgw.contracts.control_planes: the list of control-plane instances the leader sends and
the agent keeps, checked by both ends alike; one bad entry refuses the whole list."""

from __future__ import annotations

import pytest

from llmgw.contracts.control_planes import (
    MAX_CONTROL_PLANES,
    MAX_ENTRY_CHARS,
    MAX_RETIRED_SERIALS,
    MAX_SERIAL_CHARS,
    check_control_planes,
    check_retired_serials,
)
from llmgw.errors import ConfigError


def test_a_list_is_normalised_in_its_order_without_duplicates() -> None:
    got = check_control_planes(
        ["cp-2.example:7443", " 10.0.0.1:7443 ", "[fd00::1]:7443", "cp-2.example:7443"]
    )
    assert got == ("cp-2.example:7443", "10.0.0.1:7443", "[fd00::1]:7443")


def test_the_longest_list_passes_and_one_more_is_refused() -> None:
    full = [f"cp-{i}.example:7443" for i in range(MAX_CONTROL_PLANES)]
    assert len(check_control_planes(full)) == MAX_CONTROL_PLANES
    with pytest.raises(ConfigError) as info:
        check_control_planes([*full, "cp-x.example:7443"])
    assert str(info.value) == (
        f"the list names {MAX_CONTROL_PLANES + 1} control planes, more than the "
        f"{MAX_CONTROL_PLANES} an agent takes"
    )


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([], "the list of control planes is empty"),
        (["cp:7443", "cp-2"], "control plane [1]: 'cp-2' has no port; give host:port"),
        (["cp:0"], "control plane [0]: port '0' in 'cp:0' must be a number from 1 to 65535"),
        (["cp:7443", ""], "control plane [1]: is empty; give host:port, e.g. 10.0.0.1:7443"),
        (["bad host:7443"], "control plane [0]: 'bad host' in 'bad host:7443' is not a valid"),
        (["::1:7443"], "control plane [0]: '::1:7443': an IPv6 address needs brackets"),
        ([7443], "control plane [0] is not a string host:port"),
        (
            ["0.0.0.0:7443"],
            "control plane [0] '0.0.0.0:7443' is a wildcard listen address, not one to dial; "
            "the control plane should name the address agents reach it at (its 'advertise' "
            "setting)",
        ),
        (["[::]:7443"], "control plane [0] '[::]:7443' is a wildcard listen address"),
    ],
)
def test_a_bad_list_is_refused_whole_naming_the_entry(entries: list[object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_control_planes(entries)
    assert str(info.value).startswith(message), str(info.value)


def test_an_overlong_entry_is_refused_without_being_repeated_whole() -> None:
    entry = "a" * 5000 + ":7443"
    with pytest.raises(ConfigError) as info:
        check_control_planes(["cp:7443", entry])
    text = str(info.value)
    assert text == (
        f"control plane [1] is {len(entry)} characters long ({'a' * 40!r}...), longer than any "
        f"host:port ({MAX_ENTRY_CHARS})"
    )
    # The longest host name a certificate can carry, with a port, still passes.
    longest = ".".join(["a" * 63] * 3 + ["a" * 61]) + ":65535"
    assert check_control_planes([longest]) == (longest,)


# ------------------------------------------------------------------ the retired serials


def test_retired_serials_keep_their_order_without_duplicates() -> None:
    assert check_retired_serials([]) == ()
    assert check_retired_serials(["5e3", "c13", "5e3", "f" * MAX_SERIAL_CHARS]) == (
        "5e3",
        "c13",
        "f" * MAX_SERIAL_CHARS,
    )
    full = [f"{i:x}" for i in range(MAX_RETIRED_SERIALS)]
    assert len(check_retired_serials(full)) == MAX_RETIRED_SERIALS


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            [f"{i:x}" for i in range(MAX_RETIRED_SERIALS + 1)],
            f"the list names {MAX_RETIRED_SERIALS + 1} retired certificate serials, more than "
            f"the {MAX_RETIRED_SERIALS} an agent takes",
        ),
        (["ab", 12], "retired serial [1] is not a string"),
        (
            ["ab", "AB"],
            "retired serial [1] 'AB' is not a certificate serial (lowercase hex, 1 to 40 digits)",
        ),
        ([""], "retired serial [0] '' is not a certificate serial"),
        (["0x1f"], "retired serial [0] '0x1f' is not a certificate serial"),
        (["a" * 41], f"retired serial [0] {'a' * 41!r} is not a certificate serial"),
    ],
)
def test_a_bad_serial_refuses_them_all(values: list[object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_retired_serials(values)
    assert str(info.value).startswith(message)
