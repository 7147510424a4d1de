"""Durations: the one syntax every llmgw setting and option that takes a time accepts.

A number is seconds (``90``, ``0.5``); a string is a number with an optional unit, ``ms``,
``s``, ``m``, ``h`` or ``d``: ``"500ms"``, ``"30s"``, ``"5m"``, ``"2h"``, ``"30d"``, ``"90"``.
The same in ``server.yaml``, ``catalog.yaml`` and ``llmgw ctl`` options.
"""

from __future__ import annotations

import math
import re

from llmgw.errors import ConfigError

__all__ = ["UNITS", "format_duration", "parse_duration"]

UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_FORMS = "seconds, or a duration like 500ms, 30s, 5m, 2h or 30d"
_DURATION = re.compile(r"([0-9]+(?:\.[0-9]+)?|\.[0-9]+)(ms|s|m|h|d)?")


def parse_duration(value: object) -> float:
    """Seconds (0 or more, finite) from a number of seconds or a string like '500ms', '30s',
    '5m', '2h', '30d'. Raises :class:`ConfigError` without key or file, naming the accepted
    forms; callers that know the key (a config checker, a CLI option) add it."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
        seconds = float(m.group(1)) * UNITS[m.group(2) or "s"]
    else:
        raise ConfigError(f"must be {_FORMS}; got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ConfigError(f"must be a duration of 0 s or more ({_FORMS}); got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact spelling :func:`parse_duration` reads back: ``86400`` -> ``1d``,
    ``5400`` -> ``90m``, ``0.25`` -> ``250ms``; what no unit divides stays in seconds."""
    if seconds < 0 or not math.isfinite(seconds):
        raise ValueError(f"not a duration: {seconds!r}")
    if seconds == 0:
        return "0s"
    for unit in ("d", "h", "m", "s"):
        count = seconds / UNITS[unit]
        if count >= 1 and count == int(count):
            return f"{int(count)}{unit}"
    millis = round(seconds * 1000, 6)
    if millis == int(millis):
        return f"{int(millis)}ms"
    return f"{seconds:g}s"
