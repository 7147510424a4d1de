"""setup_logging under systemd: the journal handler (python-systemd) with LLMGW_* fields and
syslog priorities, and a plain-text fallback that says python-systemd is missing instead of
silently dropping the fields. python-systemd is a stand-in here (tests/fixtures/python-systemd);
the dry run checks the real one in the frozen binary (journalctl -o json)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.log import JournalHandler, LogfmtFormatter, kv, setup_logging

STANDIN = Path(__file__).resolve().parents[1] / "fixtures" / "python-systemd"


@pytest.fixture(autouse=True)
def root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture
def under_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    monkeypatch.delenv("LLMGW_LOG_STDERR", raising=False)


@pytest.fixture
def journal(monkeypatch: pytest.MonkeyPatch, under_systemd: None) -> list[dict[str, str]]:
    monkeypatch.syspath_prepend(str(STANDIN))
    for name in ("systemd", "systemd.journal"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from systemd import journal as standin

    assert Path(standin.__file__).parent.parent == STANDIN
    standin.SENT.clear()
    return standin.SENT


def test_under_systemd_records_go_to_the_journal_with_fields(
    journal: list[dict[str, str]],
) -> None:
    setup_logging("debug")
    [handler] = logging.getLogger().handlers
    assert isinstance(handler, JournalHandler)
    log = logging.getLogger("llmgw.agent")
    log.info("connected", extra=kv(server="cp-1:7443", epoch=3))
    log.error("shard failed")
    log.debug("detail")
    log.critical("gone")
    log.warning("odd")
    assert journal[0] == {
        "MESSAGE": "connected server=cp-1:7443 epoch=3",
        "PRIORITY": "6",
        "LOGGER": "llmgw.agent",
        "SYSLOG_IDENTIFIER": "llmgw",
        "LLMGW_SERVER": "cp-1:7443",
        "LLMGW_EPOCH": "3",
    }
    assert [entry["PRIORITY"] for entry in journal] == ["6", "3", "7", "2", "4"]
    assert "LLMGW_SERVER" not in journal[1]


def test_without_python_systemd_it_says_so_once_and_writes_logfmt(
    under_systemd: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "systemd", None)  # import systemd raises ImportError
    setup_logging("info")
    [handler] = logging.getLogger().handlers
    assert isinstance(handler, logging.StreamHandler)
    assert isinstance(handler.formatter, LogfmtFormatter)
    logging.getLogger("llmgw.agent").info("connected", extra=kv(server="cp-1:7443"))
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert "level=warning logger=llmgw.log" in lines[0]
    assert "python-systemd is missing" in lines[0]
    assert "install python3-systemd" in lines[0]
    assert "msg=connected server=cp-1:7443" in lines[1]


def test_outside_systemd_nothing_is_said(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    monkeypatch.setitem(sys.modules, "systemd", None)
    setup_logging("info")
    logging.getLogger("llmgw.agent").info("hello")
    err = capsys.readouterr().err
    assert "python-systemd" not in err and "msg=hello" in err


def test_llmgw_log_stderr_chooses_stderr_even_with_python_systemd(
    journal: list[dict[str, str]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("LLMGW_LOG_STDERR", "1")
    setup_logging("info")
    logging.getLogger("llmgw.agent").info("hello")
    assert journal == []
    err = capsys.readouterr().err
    assert "msg=hello" in err and "python-systemd" not in err
