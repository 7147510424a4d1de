"""logfmt lines from LogfmtFormatter."""

from __future__ import annotations

import logging
import re
import sys

import pytest

from llmgw.log import LogfmtFormatter, kv

# One logfmt pair: a bare value, or a quoted one with \\, \" and \n escapes.
PAIR = re.compile(r'([^\s=]+)=("(?:[^"\\\n]|\\[\\"n])*"|[^\s"=]+)')


def parse_logfmt(line: str) -> dict[str, str]:
    """A strict logfmt parser: the whole line must be space-separated pairs."""
    assert "\n" not in line, f"a log line must be one line: {line!r}"
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(line):
        m = PAIR.match(line, pos)
        assert m, f"not logfmt at {line[pos:]!r}"
        key, raw = m.groups()
        if raw.startswith('"'):
            value = re.sub(
                r"\\(.)", lambda e: {"n": "\n", '"': '"', "\\": "\\"}[e.group(1)], raw[1:-1]
            )
        else:
            value = raw
        fields[key] = value
        pos = m.end()
        if pos < len(line):
            assert line[pos] == " ", f"expected a space at {line[pos:]!r}"
            pos += 1
    return fields


def record(
    msg: str,
    *args: object,
    level: int = logging.INFO,
    exc_info: object = None,
    **extra: object,
) -> logging.LogRecord:
    logger = logging.getLogger("llmgw.test")
    return logger.makeRecord(
        logger.name,
        level,
        __file__,
        1,
        msg,
        args,
        exc_info,
        extra=extra or None,  # type: ignore[arg-type]
    )


def fmt(rec: logging.LogRecord) -> str:
    return LogfmtFormatter().format(rec)


def test_standard_fields() -> None:
    line = fmt(record("connected", level=logging.WARNING))
    fields = parse_logfmt(line)
    assert list(fields)[:4] == ["ts", "level", "logger", "msg"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", fields["ts"])
    assert fields["level"] == "warning"
    assert fields["logger"] == "llmgw.test"
    assert fields["msg"] == "connected"
    assert "msg=connected" in line


def test_message_args_are_applied() -> None:
    fields = parse_logfmt(fmt(record("%d shards on %s", 3, "n1")))
    assert fields["msg"] == "3 shards on n1"


def test_fields_rendered_key_value_in_order() -> None:
    line = fmt(record("x", **kv(node="n1", port=9443, ok=True, ratio=0.5, none=None)))
    assert line.endswith(" node=n1 port=9443 ok=True ratio=0.5 none=None")
    assert parse_logfmt(line)["port"] == "9443"


@pytest.mark.parametrize(
    "value",
    [
        "two words",
        'say "hi"',
        "line one\nline two",
        'all of " \\ \n at once',
        "a=b",
        "tab\there",
        "",
        "C:\\path with space",
    ],
)
def test_awkward_values_are_quoted_and_escaped(value: str) -> None:
    line = fmt(record(value, **kv(field=value)))
    fields = parse_logfmt(line)
    assert fields["msg"] == value
    assert fields["field"] == value
    assert 'field="' in line


def test_plain_values_stay_bare() -> None:
    line = fmt(record("ok", **kv(path="/var/lib/llmgw", n=1)))
    assert " path=/var/lib/llmgw " in line + " "
    assert " n=1" in line


def test_exception_is_included() -> None:
    try:
        raise ValueError('bad "thing"\nsecond line')
    except ValueError:
        exc_info = sys.exc_info()
    line = fmt(record("it failed", exc_info=exc_info, **kv(shard="s1")))
    fields = parse_logfmt(line)
    assert fields["shard"] == "s1"
    exc = fields["exc"]
    assert exc.startswith("Traceback (most recent call last):")
    assert 'ValueError: bad "thing"\nsecond line' in exc
    assert list(fields)[-1] == "exc"


def test_non_dict_fields_are_ignored() -> None:
    fields = parse_logfmt(fmt(record("x", fields="not a dict")))
    assert set(fields) == {"ts", "level", "logger", "msg"}


def test_works_through_a_handler(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("llmgw.test.handler")
    with caplog.at_level(logging.INFO, logger=logger.name):
        logger.info("shard ready", extra=kv(shard="s 1"))
    (rec,) = caplog.records
    fields = parse_logfmt(LogfmtFormatter().format(rec))
    assert fields["msg"] == "shard ready" and fields["shard"] == "s 1"


def test_carriage_return_is_escaped() -> None:
    line = fmt(record("x", **kv(user="alice\rlevel=error msg=forged")))
    assert "\r" not in line
