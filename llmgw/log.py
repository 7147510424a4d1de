"""Structured logging for every llmgw process: logfmt lines on stderr, or the journal under systemd.

Call sites pass fields through ``extra={"fields": {...}}`` or the :func:`kv` helper so the
lines stay machine-readable: ``ts=… level=info logger=llmgw.agent msg="connected" server=…``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

__all__ = ["JournalHandler", "LogfmtFormatter", "kv", "setup_logging"]


def kv(**fields: Any) -> dict[str, Any]:
    """Wrap fields for ``logger.info(msg, extra=kv(a=1))``."""
    return {"fields": fields}


def _quote(value: object) -> str:
    text = str(value)
    if text == "" or any(c in text for c in ' "=\n\r\t'):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"')
        return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r") + '"'
    return text


class LogfmtFormatter(logging.Formatter):
    """Render a record as one logfmt line."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        parts = [
            f"ts={ts}.{int(record.msecs):03d}Z",
            f"level={record.levelname.lower()}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            parts.extend(f"{k}={_quote(v)}" for k, v in fields.items())
        if record.exc_info:
            parts.append(f"exc={_quote(self.formatException(record.exc_info))}")
        return " ".join(parts)


class JournalHandler(logging.Handler):
    """Send records to the systemd journal with their fields as journal fields."""

    def __init__(self) -> None:
        super().__init__()
        from systemd import journal  # optional dependency (python-systemd)

        self._send = journal.send

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = getattr(record, "fields", None) or {}
            extra = {f"LLMGW_{k.upper()}": str(v) for k, v in fields.items()}
            message = record.getMessage()
            if fields:
                message += " " + " ".join(f"{k}={_quote(v)}" for k, v in fields.items())
            priority = {50: 2, 40: 3, 30: 4, 20: 6, 10: 7}.get(record.levelno, 6)
            self._send(
                message,
                PRIORITY=str(priority),
                LOGGER=record.name,
                SYSLOG_IDENTIFIER="llmgw",
                **extra,
            )
        except Exception:
            self.handleError(record)


def setup_logging(level: str | int = "info") -> None:
    """Configure the root logger once per process; the journal when under systemd."""
    root = logging.getLogger()
    if isinstance(level, str):
        level = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    root.setLevel(level)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    chosen: logging.Handler | None = None
    without_journal = ""
    if os.environ.get("JOURNAL_STREAM") and os.environ.get("LLMGW_LOG_STDERR") != "1":
        try:
            chosen = JournalHandler()
        except ImportError as exc:
            without_journal = str(exc)
    if chosen is None:
        chosen = logging.StreamHandler(sys.stderr)
        chosen.setFormatter(LogfmtFormatter())
    root.addHandler(chosen)
    if without_journal:
        # Under systemd without python-systemd: say so once instead of silently losing the
        # journal fields (the frozen binaries and the packages carry it).
        logging.getLogger("llmgw.log").warning(
            "python-systemd is missing, so logs go to stderr as logfmt lines and the journal "
            "gets no LLMGW_* fields or priorities; install python3-systemd, or use the "
            "frozen llmgw, which carries it",
            extra=kv(error=without_journal),
        )
    # aiohttp's access log is noise at info level on a gateway.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
