"""The agent's operation log: epoch fencing and the applied-op record, persisted across restarts."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from llmgw.agent import oplog as oplog_mod
from llmgw.agent.oplog import Decision, OperationLog
from llmgw.errors import ConfigError, StaleEpoch


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "oplog.json"


def test_fresh_log_accepts_anything(path: Path) -> None:
    log = OperationLog(path)
    assert log.max_epoch == 0
    assert log.check(0, "op-1") == Decision(apply=True, duplicate=False)
    assert not log.applied("op-1")
    assert not path.exists()  # nothing written until something is recorded


def test_lower_epoch_is_stale(path: Path) -> None:
    log = OperationLog(path)
    log.record(5, "op-1")
    with pytest.raises(StaleEpoch) as info:
        log.check(4, "op-2")
    assert "op-2" in str(info.value)
    assert "4" in str(info.value) and "5" in str(info.value)
    assert not info.value.retryable


def test_equal_and_higher_epochs_apply(path: Path) -> None:
    log = OperationLog(path)
    log.record(5, "op-1")
    assert log.check(5, "op-2") == Decision(apply=True, duplicate=False)
    assert log.check(6, "op-3") == Decision(apply=True, duplicate=False)
    # check() alone does not raise the fence; record() does.
    assert log.max_epoch == 5
    log.record(6, "op-3")
    assert log.max_epoch == 6
    with pytest.raises(StaleEpoch):
        log.check(5, "op-4")


def test_duplicate_op_is_not_applied_again(path: Path) -> None:
    log = OperationLog(path)
    log.record(1, "op-1")
    assert log.applied("op-1")
    assert log.check(1, "op-1") == Decision(apply=False, duplicate=True)
    # A resend from a later leader is still a duplicate.
    assert log.check(2, "op-1") == Decision(apply=False, duplicate=True)


def test_stale_wins_over_duplicate(path: Path) -> None:
    log = OperationLog(path)
    log.record(1, "op-1")
    log.record(3, "op-2")
    with pytest.raises(StaleEpoch):
        log.check(1, "op-1")


def test_record_persists_across_restart(path: Path) -> None:
    log = OperationLog(path)
    log.record(3, "op-a")
    log.record(7, "op-b")
    log.record(7, "op-c")

    restarted = OperationLog(path)
    assert restarted.max_epoch == 7
    for op in ("op-a", "op-b", "op-c"):
        assert restarted.applied(op)
        assert restarted.check(7, op) == Decision(apply=False, duplicate=True)
    assert not restarted.applied("op-d")
    with pytest.raises(StaleEpoch):
        restarted.check(6, "op-d")


def test_observe_epoch_raises_fence_and_persists(path: Path) -> None:
    log = OperationLog(path)
    log.observe_epoch(4)
    assert log.max_epoch == 4
    assert OperationLog(path).max_epoch == 4
    log.observe_epoch(4)  # equal: fine, unchanged
    assert log.max_epoch == 4
    log.observe_epoch(9)
    assert OperationLog(path).max_epoch == 9
    with pytest.raises(StaleEpoch):
        log.check(8, "op-1")


def test_observe_epoch_refuses_lower(path: Path) -> None:
    log = OperationLog(path)
    log.observe_epoch(10)
    with pytest.raises(StaleEpoch) as info:
        log.observe_epoch(9)
    assert "9" in str(info.value) and "10" in str(info.value)
    assert log.max_epoch == 10
    assert OperationLog(path).max_epoch == 10


@pytest.mark.parametrize(
    "content",
    [
        "not json at all",
        "{}",
        '{"max_epoch": "x", "applied": []}',
        '{"max_epoch": 1}',
        '{"max_epoch": 1, "applied": 5}',
        "[]",
        "",
    ],
)
def test_corrupt_file_is_config_error_naming_it(path: Path, content: str) -> None:
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with pytest.raises(ConfigError) as info:
        OperationLog(path)
    assert str(path) in str(info.value)
    assert info.value.file == str(path)
    assert "corrupt" in str(info.value)


def test_unreadable_path_is_config_error(path: Path) -> None:
    path.mkdir(parents=True)  # a directory where the file should be
    with pytest.raises(ConfigError) as info:
        OperationLog(path)
    assert str(path) in str(info.value)


def test_file_mode_is_0600_and_content_is_json(path: Path) -> None:
    log = OperationLog(path)
    log.record(2, "op-1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"max_epoch": 2, "applied": ["op-1"]}
    assert not path.with_name(path.name + ".tmp").exists()
    log.observe_epoch(3)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_applied_bound_keeps_newest(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oplog_mod, "MAX_APPLIED", 5)
    log = OperationLog(path)
    for i in range(8):
        log.record(1, f"op-{i}")
    kept = [f"op-{i}" for i in range(3, 8)]
    for i in range(3):
        assert not log.applied(f"op-{i}")
        assert log.check(1, f"op-{i}").apply
    for op in kept:
        assert log.applied(op)
    assert json.loads(path.read_text())["applied"] == kept
    restarted = OperationLog(path)
    assert [op for op in kept if restarted.applied(op)] == kept
    assert not restarted.applied("op-2")


def test_default_bound_is_large() -> None:
    assert oplog_mod.MAX_APPLIED >= 1000
