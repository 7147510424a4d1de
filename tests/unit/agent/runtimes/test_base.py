"""llmgw.agent.runtimes.base: what every runtime shares (the shard log it writes to)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from llmgw.agent.runtimes.base import open_shard_log
from llmgw.errors import ShardError


def test_open_shard_log_makes_its_directory_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "deeper" / "s1.log"
    with open_shard_log(path) as first:
        first.write(b"one\n")
        # Unbuffered: the bytes are in the file before it is closed.
        assert path.read_bytes() == b"one\n"
    with open_shard_log(path) as second:
        second.write(b"two\n")
    assert path.read_bytes() == b"one\ntwo\n"
    assert stat.S_IMODE(path.parent.stat().st_mode) & 0o077 == 0


def test_open_shard_log_says_what_to_check_when_it_cannot(tmp_path: Path) -> None:
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the log directory should be")
    with pytest.raises(ShardError) as info:
        open_shard_log(blocker / "s1.log")
    message = str(info.value)
    assert f"cannot open the shard log {blocker / 's1.log'}" in message
    assert "check the state directory's owner and free space" in message
