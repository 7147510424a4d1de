"""Unit tests of llmgw.configfile: YAML loading and the Checker's errors naming key and file."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.configfile import Checker, binary_amount, load_yaml, unknown_key_message
from llmgw.errors import ConfigError

CHECK = Checker(file="/etc/llmgw/server.yaml", base_dir=Path("/etc/llmgw"))


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("http_listen: a:1\nhttp_listen: b:2\n")
    with pytest.raises(ConfigError, match=r"line 2, column 1: .*found key 'http_listen' twice"):
        load_yaml(path, missing_hint="create it")


def test_a_missing_file_gives_the_hint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file; create it"):
        load_yaml(tmp_path / "nope.yaml", missing_hint="create it")


@pytest.mark.parametrize(("value", "seconds"), [(90, 90.0), ("30d", 2592000.0), ("500ms", 0.5)])
def test_checker_duration(value: object, seconds: float) -> None:
    assert CHECK.duration(value, "cert_lifetime") == seconds


def test_checker_duration_names_key_and_file() -> None:
    with pytest.raises(ConfigError) as info:
        CHECK.duration("soon", "replica_wait")
    assert str(info.value).startswith("/etc/llmgw/server.yaml: replica_wait: must be seconds")
    assert info.value.key == "replica_wait"


def test_checker_duration_range() -> None:
    assert CHECK.duration("10m", "loss_timeout", minimum=0, maximum=600) == 600.0
    with pytest.raises(
        ConfigError, match=r"loss_timeout: must be from 0\.1 to 600 seconds, got '1h'"
    ):
        CHECK.duration("1h", "loss_timeout", minimum=0.1, maximum=600)
    with pytest.raises(ConfigError, match="must be at least 60 seconds, got '30s'"):
        CHECK.duration("30s", "cert_lifetime", minimum=60)
    with pytest.raises(ConfigError, match="must be at most 1 seconds, got 2"):
        CHECK.duration(2, "x", maximum=1)


def test_checker_number_range_is_unchanged() -> None:
    with pytest.raises(ConfigError, match="must be from 1 to 5, got 9"):
        CHECK.number(9, "n", minimum=1, maximum=5)


def test_checker_hostport_normalises_and_names_the_key() -> None:
    assert CHECK.hostport("[::1]", "grpc_listen", default_port=7443) == "[::1]:7443"
    with pytest.raises(ConfigError, match=r"server\.yaml: grpc_listen: 'cp1' has no port"):
        CHECK.hostport("cp1", "grpc_listen")


def test_unknown_key_message_suggests() -> None:
    message = unknown_key_message("sever", ["server", "node_id"])
    assert message.startswith("unknown key 'sever'; did you mean 'server'?")


_GRAINS = {"": 1, "kg": 1024, "mg": 1024 * 1024}


def _grains(value: object) -> int:
    return binary_amount(value, _GRAINS, base="grains", names="KG or MG", shape="an amount")


@pytest.mark.parametrize(
    ("value", "amount"), [(7, 7), ("7", 7), ("2KG", 2048), ("1.5 mg", 1572864), ("0.5kg", 512)]
)
def test_binary_amount_is_a_whole_number_of_the_base_unit(value: object, amount: int) -> None:
    assert _grains(value) == amount
    assert isinstance(_grains(value), int)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0.3kg", "'0.3kg' is not a whole number of grains"),
        ("3tg", "unknown unit 'tg'; use KG or MG"),
        (True, "must be an amount; got True"),
        ("lots", "must be an amount; got 'lots'"),
    ],
)
def test_binary_amount_refusals(value: object, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        _grains(value)
    assert message in str(info.value)


def test_binary_amount_refuses_decimal_units_naming_the_binary_one() -> None:
    with pytest.raises(ConfigError, match=r"MB is ambiguous; use binary units, e\.g\. 8MiB"):
        binary_amount("8MB", {"mib": 1}, base="MiB", names="MiB", shape="memory")
