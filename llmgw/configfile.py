"""Reading and checking llmgw's configuration files (``agent.yaml``, ``server.yaml``,
``catalog.yaml``).

A YAML loader that refuses a key given twice and whose errors carry the file and line,
dotted overrides, sizes in binary units, and a :class:`Checker` whose every error names the
dotted key path and the file (``host:port`` values through llmgw.netaddr, durations through
llmgw.durations).
"""

from __future__ import annotations

import copy
import difflib
import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import yaml

from llmgw.durations import parse_duration
from llmgw.errors import ConfigError
from llmgw.netaddr import format_hostport, parse_hostport

_AMOUNT = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)")
_SIZE_UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3}
# Decimal units are refused as ambiguous, naming the binary one meant.
_DECIMAL = {short: f"{big}iB" for big in "KMGT" for short in (big.lower(), big.lower() + "b")}


# --- values --------------------------------------------------------------------------------


def type_name(value: object) -> str:
    """The YAML-ish name of a value's type, for "must be X, got Y" messages."""
    if value is None:
        return "null (an empty value)"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, Mapping):
        return "mapping"
    if isinstance(value, list | tuple):
        return "list"
    return type(value).__name__


def binary_amount(
    value: object, units: Mapping[str, int], *, base: str, names: str, shape: str
) -> int:
    """A whole number of ``base`` units, given as one or as a string like '8MiB' (``units``:
    lower-cased unit -> factor in ``base`` units; "" for a bare number); decimal units (MB,
    G) are refused as ambiguous, and so is an amount that is not a whole number of ``base``.

    Raises :class:`ConfigError` without key or file; ``names`` lists the units to use, ``shape``
    says what is expected."""
    amount: float
    if isinstance(value, int) and not isinstance(value, bool):
        amount = value
    elif isinstance(value, str) and (m := _AMOUNT.fullmatch(value.strip())):
        unit = m.group(2).lower()
        if unit in _DECIMAL and _DECIMAL[unit].lower() in units:
            raise ConfigError(
                f"{value!r}: {m.group(2)} is ambiguous; use binary units, e.g. "
                f"{m.group(1)}{_DECIMAL[unit]}"
            )
        if unit not in units:
            if unit:
                raise ConfigError(f"{value!r}: unknown unit {m.group(2)!r}; use {names}")
            raise ConfigError(f"must be {shape}; got {value!r}")
        amount = float(m.group(1)) * units[unit]
    else:
        raise ConfigError(f"must be {shape}; got {value!r}")
    if amount != int(amount):
        raise ConfigError(f"{value!r} is not a whole number of {base}")
    return int(amount)


def parse_size(value: object) -> int:
    """Bytes from a whole number of bytes or a string like '8MiB', '512KiB', '1GiB'.

    Raises :class:`ConfigError` without key or file (:meth:`Checker.size` adds them)."""
    return binary_amount(
        value,
        _SIZE_UNITS,
        base="bytes",
        names="KiB, MiB or GiB",
        shape="a size like 8MiB, 512KiB or 1GiB, or a whole number of bytes",
    )


def format_size(size: int) -> str:
    """``8388608`` -> ``8 MiB``; sizes that are not a whole number of KiB stay in bytes."""
    for unit, factor in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= factor and size % factor == 0:
            return f"{size // factor} {unit}"
    return f"{size} bytes"


def join_key(parent: str, name: str) -> str:
    """``tls`` + ``cert`` -> ``tls.cert``; the top level has the empty path."""
    return f"{parent}.{name}" if parent else name


def index_key(parent: str, index: int) -> str:
    """``fabrics`` + 1 -> ``fabrics[1]``."""
    return f"{parent}[{index}]"


# --- files ---------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last,
    silently, which hides the typo an operator is looking for)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[object, object]:
    seen: set[object] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable; construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"found key {key!r} twice",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(path: Path, *, missing_hint: str) -> object:
    """Read and parse one YAML file; ``None`` for an empty one.

    Every failure is a :class:`ConfigError` naming the file: ``missing_hint`` follows
    "no such file; " when it does not exist; syntax errors give line and column.
    """
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"no such file; {missing_hint}", file=file) from None
    except PermissionError:
        raise ConfigError(
            "permission denied reading it; run as a user that may read it (root, or the "
            "group that owns it) or fix its mode",
            file=file,
        ) from None
    except IsADirectoryError:
        raise ConfigError("is a directory; give the path of a YAML file", file=file) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"is not UTF-8 text ({exc.reason})", file=file) from None
    except OSError as exc:
        raise ConfigError(f"cannot read it: {exc.strerror or exc}", file=file) from exc
    return parse_yaml(text, file=file)


def parse_yaml(text: str, *, file: str) -> object:
    """Parse YAML text; syntax errors become :class:`ConfigError` with line and column."""
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        what = "; ".join(part for part in (exc.context, exc.problem) if part) or "syntax error"
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(f"{where}invalid YAML: {what}", file=file) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"invalid YAML: {exc}", file=file) from exc


def apply_overrides(
    data: Mapping[str, object], overrides: Mapping[str, object] | None, *, file: str
) -> dict[str, object]:
    """A copy of ``data`` with ``overrides`` set over it; dotted keys (``tls.cert``) reach
    into nested mappings, creating them when absent."""
    result: dict[str, object] = copy.deepcopy(dict(data))
    for dotted, value in (overrides or {}).items():
        parts = dotted.split(".")
        if not all(parts):
            raise ConfigError(f"override key {dotted!r} has an empty part", key=dotted, file=file)
        target: dict[str, object] = result
        for depth, part in enumerate(parts[:-1]):
            child = target.get(part)
            if child is None:
                child = target[part] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(
                    f"cannot override {dotted!r}: {prefix} is a {type_name(child)}, not a mapping",
                    key=prefix,
                    file=file,
                )
            target = child
        target[parts[-1]] = copy.deepcopy(value)
    return result


# --- checking ------------------------------------------------------------------------------


def unknown_key_message(
    name: str, accepted: Collection[str], *, where: str = "", noun: str = "key"
) -> str:
    """ "unknown key 'sever'; did you mean 'server'? (accepted keys: ...)" """
    message = f"unknown {noun} {name!r}"
    close = difflib.get_close_matches(name, list(accepted), n=1)
    if close:
        message += f"; did you mean {close[0]!r}?"
    place = f" under {where}" if where else ""
    return f"{message} (accepted {noun}s{place}: {', '.join(sorted(accepted))})"


@dataclass(frozen=True)
class Checker:
    """Type checks for one file's parsed data; each failure is a :class:`ConfigError` naming
    the dotted key path and the file. Relative paths resolve against ``base_dir``."""

    file: str
    base_dir: Path

    def fail(self, key: str, message: str) -> NoReturn:
        raise ConfigError(message, key=key or None, file=self.file)

    def mapping(self, value: object, key: str, *, accepted: Collection[str]) -> dict[str, object]:
        """A mapping with string keys, all of them in ``accepted``."""
        if not isinstance(value, Mapping):
            self.fail(key, f"must be a mapping, got {type_name(value)}")
        result: dict[str, object] = {}
        for name, item in value.items():
            if not isinstance(name, str):
                self.fail(key, f"keys must be strings, got {type_name(name)} {name!r}")
            if name not in accepted:
                self.fail(join_key(key, name), unknown_key_message(name, accepted, where=key))
            result[name] = item
        return result

    def string(self, value: object, key: str) -> str:
        """A non-empty string."""
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {type_name(value)}")
        if not value.strip():
            self.fail(key, "must not be empty")
        return value

    def boolean(self, value: object, key: str) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {type_name(value)}")
        return value

    def number(
        self,
        value: object,
        key: str,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> float:
        """A finite int or float within ``[minimum, maximum]``."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(key, f"must be a number, got {type_name(value)}")
        number = float(value)
        if not math.isfinite(number):
            self.fail(key, f"must be a finite number, got {value!r}")
        self._in_range(number, value, key, minimum, maximum, "")
        return number

    def _in_range(
        self,
        number: float,
        value: object,
        key: str,
        minimum: float | None,
        maximum: float | None,
        unit: str,
    ) -> None:
        if minimum is not None and maximum is not None:
            if not minimum <= number <= maximum:
                self.fail(key, f"must be from {minimum:g} to {maximum:g}{unit}, got {value!r}")
        elif minimum is not None and number < minimum:
            self.fail(key, f"must be at least {minimum:g}{unit}, got {value!r}")
        elif maximum is not None and number > maximum:
            self.fail(key, f"must be at most {maximum:g}{unit}, got {value!r}")

    def duration(
        self,
        value: object,
        key: str,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> float:
        """Seconds within ``[minimum, maximum]``, in the one duration syntax
        (llmgw.durations): ``90``, ``500ms``, ``30s``, ``5m``, ``2h``, ``30d``."""
        try:
            seconds = parse_duration(value)
        except ConfigError as exc:
            self.fail(key, exc.message)
        self._in_range(seconds, value, key, minimum, maximum, " seconds")
        return seconds

    def size(self, value: object, key: str, *, minimum: int = 1, maximum: int | None = None) -> int:
        """Bytes (see :func:`parse_size`) within ``[minimum, maximum]``."""
        try:
            size = parse_size(value)
        except ConfigError as exc:
            self.fail(key, exc.message)
        if size < minimum:
            self.fail(key, f"must be at least {format_size(minimum)}, got {value!r}")
        if maximum is not None and size > maximum:
            self.fail(key, f"must be at most {format_size(maximum)}, got {value!r}")
        return size

    def items(self, value: object, key: str, *, non_empty: bool = False) -> list[object]:
        """A list (the items still to be checked by the caller)."""
        if not isinstance(value, list | tuple):
            self.fail(key, f"must be a list, got {type_name(value)}")
        if non_empty and not value:
            self.fail(key, "must not be an empty list")
        return list(value)

    def strings(self, value: object, key: str, *, non_empty: bool = False) -> tuple[str, ...]:
        """A list of non-empty strings."""
        if not isinstance(value, list | tuple):
            self.fail(key, f"must be a list of strings, got {type_name(value)}")
        if non_empty and not value:
            self.fail(key, "must not be an empty list")
        for index, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(
                    index_key(key, index), f"must be a list of strings, got {type_name(item)}"
                )
            if not item.strip():
                self.fail(index_key(key, index), "must not be an empty string")
        return tuple(value)

    def path(self, value: object, key: str) -> Path:
        """A path, made absolute against ``base_dir`` when relative."""
        if not isinstance(value, str | os.PathLike):
            self.fail(key, f"must be a path (a string), got {type_name(value)}")
        text = os.fspath(value)
        if not isinstance(text, str) or not text.strip():
            self.fail(key, "must not be an empty path")
        if "\0" in text:
            self.fail(key, "must not contain a NUL character")
        path = Path(text)
        return path if path.is_absolute() else self.base_dir / path

    def command(self, value: object, key: str) -> str:
        """A program: a bare name (looked up in PATH when run) or a path, made absolute
        against ``base_dir`` when it is relative and has a '/'."""
        if isinstance(value, str | os.PathLike) and "/" not in os.fspath(value):
            return self.string(os.fspath(value), key)
        return str(self.path(value, key))

    def hostport(self, value: object, key: str, *, default_port: int | None = None) -> str:
        """``host:port`` normalized (a bare host gets ``default_port``)."""
        host, port = self.hostport_pair(value, key, default_port=default_port)
        return format_hostport(host, port)

    def hostport_pair(
        self,
        value: object,
        key: str,
        *,
        default_port: int | None = None,
        allow_zero: bool = False,
    ) -> tuple[str, int]:
        if not isinstance(value, str):
            self.fail(key, f"must be a string host:port, got {type_name(value)}")
        try:
            return parse_hostport(value, default_port=default_port, allow_zero=allow_zero)
        except ConfigError as exc:
            self.fail(key, exc.message)


__all__ = [
    "Checker",
    "apply_overrides",
    "format_size",
    "index_key",
    "join_key",
    "load_yaml",
    "parse_size",
    "parse_yaml",
    "type_name",
    "unknown_key_message",
]
