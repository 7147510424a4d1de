"""llmgw.agent.servers: agent.yaml's seeds first and always, then the control planes the
leader named, kept in STATE/servers.json across restarts; a bad list or file changes
nothing and is never fatal."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from llmgw.agent.servers import SERVERS_FILE, KnownServers
from llmgw.contracts.control_planes import (
    MAX_CONTROL_PLANES,
    MAX_RETIRED_SERIALS,
    MAX_SERIAL_CHARS,
)
from llmgw.errors import ConfigError

SEEDS = ("cp-1.example:7443", "cp-2.example:7443")
LOGGER = "llmgw.agent.servers"


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return dict(record.__dict__["fields"])


def test_without_a_file_it_dials_the_seeds_in_their_order(tmp_path: Path) -> None:
    known = KnownServers(SEEDS, tmp_path)
    assert known.learnt == ()
    assert known.rotation() == SEEDS
    assert not (tmp_path / SERVERS_FILE).exists()  # nothing learnt, nothing written


def test_no_seed_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        KnownServers((), Path("/nonexistent"))
    assert info.value.key == "servers"


def test_the_learnt_come_after_the_seeds_and_never_twice(tmp_path: Path) -> None:
    known = KnownServers(SEEDS, tmp_path)
    assert known.learn(["cp-3.example:7443", "cp-2.example:7443", "cp-4.example:7443"], source="x")
    assert known.rotation() == (*SEEDS, "cp-3.example:7443", "cp-4.example:7443")


def test_a_list_is_persisted_0600_and_read_back_by_the_next_agent(tmp_path: Path) -> None:
    known = KnownServers(SEEDS, tmp_path)
    assert known.learn(["10.0.0.3:7443", "[fd00::4]:7443"], source="cp-1.example:7443")
    path = tmp_path / SERVERS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"servers": ["10.0.0.3:7443", "[fd00::4]:7443"]}
    assert not [p for p in tmp_path.iterdir() if p.name != SERVERS_FILE]  # no temporary left

    # The next agent, even with an agent.yaml that names only a gone instance.
    again = KnownServers(("gone.example:7443",), tmp_path)
    assert again.rotation() == ("gone.example:7443", "10.0.0.3:7443", "[fd00::4]:7443")


def test_each_list_replaces_the_learnt_one_and_the_seeds_stay(tmp_path: Path) -> None:
    known = KnownServers(SEEDS, tmp_path)
    known.learn(["cp-3.example:7443", "cp-4.example:7443"], source="x")
    # cp-3 retired, cp-1 (a seed) not named by the leader: still dialled first.
    assert known.learn(["cp-2.example:7443", "cp-4.example:7443"], source="x")
    assert known.learnt == ("cp-2.example:7443", "cp-4.example:7443")
    assert known.rotation() == (*SEEDS, "cp-4.example:7443")
    assert KnownServers(SEEDS, tmp_path).rotation() == (*SEEDS, "cp-4.example:7443")


def test_the_same_list_again_writes_nothing(tmp_path: Path) -> None:
    known = KnownServers(SEEDS, tmp_path)
    assert known.learn(["cp-3.example:7443"], source="x")
    path = tmp_path / SERVERS_FILE
    os.utime(path, (1, 1))
    # Sent on every connection: the same list (once normalised) is no change.
    assert not known.learn([" cp-3.example:7443", "cp-3.example:7443"], source="x")
    assert path.stat().st_mtime == 1


def test_a_learnt_change_is_logged_with_what_was_added_and_retired(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    known = KnownServers(SEEDS, tmp_path)
    known.learn(["cp-3.example:7443"], source="x")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        known.learn(["cp-4.example:7443", "cp-1.example:7443"], source="cp-1.example:7443")
    (line,) = caplog.records
    assert line.getMessage() == "learnt the control planes from the leader"
    assert _fields(line) == {
        "server": "cp-1.example:7443",
        "servers": "cp-4.example:7443,cp-1.example:7443",
        "added": "cp-4.example:7443",
        "retired": "cp-3.example:7443",
        "refused_serials": "-",
    }


@pytest.mark.parametrize(
    "servers",
    [
        [],
        ["cp-3.example:7443", "not a host:7443"],
        ["cp-3.example"],  # no port
        ["0.0.0.0:7443"],
        [f"cp-{i}.example:7443" for i in range(MAX_CONTROL_PLANES + 1)],
    ],
)
def test_a_bad_list_is_refused_whole_and_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, servers: list[str]
) -> None:
    known = KnownServers(SEEDS, tmp_path)
    known.learn(["cp-3.example:7443"], source="x")
    before = (tmp_path / SERVERS_FILE).read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not known.learn(servers, source="cp-1.example:7443")
    assert known.rotation() == (*SEEDS, "cp-3.example:7443")
    assert (tmp_path / SERVERS_FILE).read_bytes() == before
    (line,) = caplog.records
    assert line.getMessage() == (
        "ignoring the control plane's list of control planes; still dialling the ones known before"
    )
    assert _fields(line)["server"] == "cp-1.example:7443"
    assert _fields(line)["entries"] == len(servers)


# ------------------------------------------------------------------ the retired serials


def test_retired_serials_are_kept_with_the_list_and_read_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    known = KnownServers(SEEDS, tmp_path)
    assert known.retired_serials == () and not known.is_retired("5e3")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert known.learn(
            ["cp-1.example:7443", "cp-2.example:7443"],
            source="cp-1.example:7443",
            retired_serials=["5e3", "c13", "5e3"],
        )
    assert known.retired_serials == ("5e3", "c13")
    assert known.is_retired("5e3") and known.is_retired("c13") and not known.is_retired("5e2")
    assert _fields(caplog.records[-1])["refused_serials"] == "5e3,c13"
    assert json.loads((tmp_path / SERVERS_FILE).read_text()) == {
        "servers": ["cp-1.example:7443", "cp-2.example:7443"],
        "retired_serials": ["5e3", "c13"],
    }
    again = KnownServers(SEEDS, tmp_path)  # the next agent refuses them from its start
    assert again.is_retired("c13") and again.retired_serials == ("5e3", "c13")
    # Only the serials changed: a change, written.
    assert again.learn(
        ["cp-1.example:7443", "cp-2.example:7443"], source="x", retired_serials=["5e3", "c13", "ab"]
    )
    assert KnownServers(SEEDS, tmp_path).is_retired("ab")
    # The same again: no change.
    assert not again.learn(
        ["cp-1.example:7443", "cp-2.example:7443"], source="x", retired_serials=["5e3", "c13", "ab"]
    )


def test_a_file_from_before_retired_serials_is_read_as_none_retired(tmp_path: Path) -> None:
    (tmp_path / SERVERS_FILE).write_text('{"servers": ["cp-3.example:7443"]}')
    known = KnownServers(SEEDS, tmp_path)
    assert known.rotation() == (*SEEDS, "cp-3.example:7443")
    assert known.retired_serials == ()


@pytest.mark.parametrize(
    "serials",
    [
        ["5e3", "not-hex"],
        ["5E3"],  # serial_hex writes lowercase: anything else is not ours
        [""],
        ["a" * (MAX_SERIAL_CHARS + 1)],
        [f"{i:x}" for i in range(MAX_RETIRED_SERIALS + 1)],
    ],
)
def test_bad_retired_serials_refuse_the_whole_list(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, serials: list[str]
) -> None:
    known = KnownServers(SEEDS, tmp_path)
    known.learn(["cp-3.example:7443"], source="x", retired_serials=["c1"])
    before = (tmp_path / SERVERS_FILE).read_bytes()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not known.learn(["cp-4.example:7443"], source="x", retired_serials=serials)
    assert known.rotation() == (*SEEDS, "cp-3.example:7443")  # the servers not taken either
    assert known.retired_serials == ("c1",) and known.is_retired("c1")
    assert (tmp_path / SERVERS_FILE).read_bytes() == before
    (line,) = caplog.records
    assert "retired" in str(_fields(line)["error"])
    assert _fields(line)["retired_serials"] == len(serials)


def test_the_most_serials_pass(tmp_path: Path) -> None:
    known = KnownServers(SEEDS, tmp_path)
    full = ["f" * MAX_SERIAL_CHARS] + [f"{i:x}" for i in range(MAX_RETIRED_SERIALS - 1)]
    servers = [f"cp-{i}.example:{7000 + i}" for i in range(MAX_CONTROL_PLANES)]
    assert known.learn(servers, source="x", retired_serials=full)
    # Read back whole by the next agent (the file stays under its bound).
    again = KnownServers(SEEDS, tmp_path)
    assert len(again.retired_serials) == MAX_RETIRED_SERIALS and len(again.learnt) == len(servers)


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"{not json", "Expecting property name"),
        (
            b'{"servers": ["cp-3.example:7443"], "retired_serials": "5e3"}',
            "its 'retired_serials' is not a list",
        ),
        (
            b'{"servers": ["cp-3.example:7443"], "retired_serials": ["5e3", 7]}',
            "retired serial [1] is not a string",
        ),
        (
            b'{"servers": ["cp-3.example:7443"], "retired_serials": ["x"]}',
            "retired serial [0] 'x' is not a certificate serial",
        ),
        (b'["cp-3.example:7443"]', "it is not an object with a list 'servers'"),
        (b'{"servers": "cp-3.example:7443"}', "it is not an object with a list 'servers'"),
        (b'{"servers": ["cp-3.example:7443", "x y:1"]}', "control plane [1]: 'x y' in"),
        (b'{"servers": []}', "the list of control planes is empty"),
        (b'{"servers": ["\xc3\x28"]}', "codec can't decode"),  # not UTF-8
        (b" " * 100_000, "it is larger than"),
    ],
)
def test_a_corrupt_file_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, error: str
) -> None:
    (tmp_path / SERVERS_FILE).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        known = KnownServers(SEEDS, tmp_path)
    assert known.rotation() == SEEDS
    (line,) = caplog.records
    assert line.getMessage().startswith("the control planes learnt before are unreadable;")
    assert error in str(_fields(line)["error"]), _fields(line)
    # The leader's next list replaces it.
    assert known.learn(["cp-3.example:7443"], source="x")
    assert KnownServers(SEEDS, tmp_path).rotation() == (*SEEDS, "cp-3.example:7443")


def test_an_unreadable_file_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / SERVERS_FILE).mkdir()  # read fails whoever runs the test (root included)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        known = KnownServers(SEEDS, tmp_path)
    assert known.rotation() == SEEDS
    (line,) = caplog.records
    assert line.getMessage() == (
        "cannot read the control planes learnt before; dialling agent.yaml's servers"
    )


def test_a_list_that_cannot_be_persisted_is_used_until_the_agent_stops(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / SERVERS_FILE).mkdir()  # the rename onto it fails
    known = KnownServers(SEEDS, tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert known.learn(["cp-3.example:7443"], source="x")
    assert known.rotation() == (*SEEDS, "cp-3.example:7443")
    (line,) = caplog.records
    assert line.getMessage() == (
        "cannot keep the learnt control planes in the state directory; they are used until "
        "the agent stops"
    )
    assert (tmp_path / SERVERS_FILE).is_dir()
    assert [p.name for p in tmp_path.iterdir()] == [SERVERS_FILE]  # no temporary left
