"""A profile's ``sandbox`` key, shared by the catalog, the control plane's order and the
agent: ``sandbox: false`` runs a process engine unconfined (the agent logs a warning), and
``sandbox: {extra_ro: [PATH, ...], extra_rw: [PATH, ...]}`` lets its sandbox see more of the
node, read-only or read-write, at the same paths. Absent: sandboxed with nothing extra
(README "Engine sandbox"; the agent's side is :mod:`llmgw.agent.sandbox`).

What is checked here holds on every node: absolute, normalised paths, never ``/`` nor
``/etc/llmgw``. What depends on the node (its state directory, its key's folder) the agent
refuses when the shard starts.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from llmgw.configfile import Checker, index_key, join_key, type_name
from llmgw.proto import control_pb2 as pb

__all__ = ["MAX_EXTRA_PATHS", "SANDBOX_KEYS", "SandboxPolicy", "parse_sandbox"]

SANDBOX_KEYS = ("extra_ro", "extra_rw")
MAX_EXTRA_PATHS = 64
_NEVER_SHOWN = ("/etc/llmgw",)


@dataclass(frozen=True)
class SandboxPolicy:
    """What a profile says of its engine's sandbox: on or off, and the extra paths."""

    enabled: bool = True
    extra_ro: tuple[str, ...] = ()
    extra_rw: tuple[str, ...] = ()

    @property
    def is_default(self) -> bool:
        return self.enabled and not self.extra_ro and not self.extra_rw

    def to_value(self) -> bool | dict[str, list[str]]:
        """In the catalog's own form: parsing it again gives this policy."""
        if not self.enabled:
            return False
        return {"extra_ro": list(self.extra_ro), "extra_rw": list(self.extra_rw)}

    def to_order(self) -> pb.Sandbox:
        return pb.Sandbox(
            disabled=not self.enabled, extra_ro=list(self.extra_ro), extra_rw=list(self.extra_rw)
        )

    @classmethod
    def from_order(cls, order: pb.Sandbox) -> SandboxPolicy:
        """An order's; one of a control plane before sandboxes says nothing: sandboxed."""
        return cls(
            enabled=not order.disabled,
            extra_ro=tuple(order.extra_ro),
            extra_rw=tuple(order.extra_rw),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "extra_ro": list(self.extra_ro),
            "extra_rw": list(self.extra_rw),
        }

    @classmethod
    def from_json(cls, obj: object) -> SandboxPolicy:
        """What :meth:`to_json` wrote; ValueError otherwise."""
        if not isinstance(obj, dict):
            raise ValueError(f"'sandbox' is a {type(obj).__name__}, not an object")
        enabled = obj.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ValueError("'sandbox.enabled' is not a boolean")
        paths: dict[str, tuple[str, ...]] = {}
        for key in SANDBOX_KEYS:
            items = obj.get(key, [])
            if not isinstance(items, list) or not all(isinstance(p, str) for p in items):
                raise ValueError(f"'sandbox.{key}' is not a list of strings")
            paths[key] = tuple(items)
        return cls(enabled=enabled, extra_ro=paths["extra_ro"], extra_rw=paths["extra_rw"])


def parse_sandbox(check: Checker, value: object, key: str) -> SandboxPolicy:
    """A profile's ``sandbox``: true, false, or {extra_ro: [...], extra_rw: [...]}; errors
    name ``key`` and the file ``check`` reads."""
    if isinstance(value, bool):
        return SandboxPolicy(enabled=value)
    if not isinstance(value, Mapping):
        check.fail(
            key,
            "must be false (the engine runs unconfined) or {extra_ro: [PATH, ...], extra_rw: "
            f"[PATH, ...]}} (what its sandbox also sees); got {type_name(value)}",
        )
    raw = check.mapping(value, key, accepted=SANDBOX_KEYS)
    paths: dict[str, tuple[str, ...]] = {}
    for name in SANDBOX_KEYS:
        paths[name] = _paths(check, raw.get(name), join_key(key, name))
    both = sorted(set(paths["extra_ro"]) & set(paths["extra_rw"]))
    if both:
        check.fail(
            join_key(key, "extra_ro"),
            f"{', '.join(both)} is in extra_rw too; give each path once (extra_rw is "
            "read-write, which includes reading)",
        )
    return SandboxPolicy(extra_ro=paths["extra_ro"], extra_rw=paths["extra_rw"])


def _paths(check: Checker, value: object, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = check.items(value, key)
    if len(items) > MAX_EXTRA_PATHS:
        check.fail(key, f"lists {len(items)} paths; at most {MAX_EXTRA_PATHS}")
    out: list[str] = []
    for index, item in enumerate(items):
        ikey = index_key(key, index)
        if not isinstance(item, str):
            check.fail(ikey, f"must be an absolute path on the node, got {type_name(item)}")
        if not item.startswith("/") or "\0" in item:
            check.fail(ikey, f"{item!r} must be an absolute path on the node, e.g. /opt/data")
        path = item.rstrip("/") or "/"
        if posixpath.normpath(item) != path or "/../" in f"{item}/":
            check.fail(ikey, f"{item!r} is not a plain path: give it without '..', '.' or '//'")
        if path == "/" or any(_nested(path, never) for never in _NEVER_SHOWN):
            check.fail(
                ikey,
                f"{item} would show an engine the node's whole filesystem or llmgw's "
                "configuration (/etc/llmgw); name the folders the engine needs",
            )
        out.append(path)
    return tuple(dict.fromkeys(out))


def _nested(a: str, b: str) -> bool:
    """One of the two paths is the other or lies inside it."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")
