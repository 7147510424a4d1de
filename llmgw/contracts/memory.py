"""Memory sizes in a profile: ``gpu_memory`` (per GPU) and ``host_memory`` (the node memory
a replica needs), both in MiB, parsed by one rule (:func:`parse_memory_mib`); and the
words a size is shown in."""

from __future__ import annotations

from llmgw.configfile import binary_amount
from llmgw.errors import ConfigError

__all__ = ["mib_text", "parse_memory_mib"]

_MEMORY_UNITS = {"mib": 1, "gib": 1024, "tib": 1024 * 1024}


def parse_memory_mib(value: object) -> int:
    """MiB from a number of MiB or a string like '40GiB', '40960MiB', '1.5TiB'.

    Raises :class:`ConfigError` without key or file; the catalog adds them."""
    mib = binary_amount(
        value,
        _MEMORY_UNITS,
        base="MiB",
        names="MiB, GiB or TiB",
        shape="memory like 40GiB or 40960MiB, or a whole number of MiB",
    )
    if mib < 1:
        raise ConfigError(f"must be at least 1 MiB, got {value!r}")
    return mib


def mib_text(mib: int) -> str:
    """``16 GiB`` for a whole number of GiB, else ``1500 MiB``."""
    return f"{mib // 1024} GiB" if mib % 1024 == 0 else f"{mib} MiB"
