"""What a sim engine can open of the paths it was asked to probe (``--probe-path``): a way
to see, from inside an engine's sandbox, what the sandbox shows (tests, and an operator
checking a profile's ``sandbox`` key on a node).

Each path is opened for reading (a folder: listed) once, at start, and the outcome logged:
``probe PATH: readable`` or ``probe PATH: cannot open: <the OSError>``. With
``--probe-required`` the first path that cannot be opened ends the engine with that error,
in Python's own words, as an engine that needed the file would.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from llmgw.errors import EngineError

__all__ = ["probe_paths"]

log = logging.getLogger("llmgw.sim.probe")


def probe_paths(paths: Iterable[str], *, required: bool = False) -> dict[str, str]:
    """Each path -> ``readable`` or ``cannot open: ...``, each logged; EngineError with the
    OSError's text for the first one that cannot be opened when ``required``."""
    seen: dict[str, str] = {}
    for path in paths:
        try:
            if os.path.isdir(path):
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(1)
        except OSError as exc:
            seen[path] = f"cannot open: {exc}"
            log.info("probe %s: %s", path, seen[path])
            if required:
                raise EngineError(f"sim: a --probe-path it needs cannot be opened: {exc}") from exc
            continue
        seen[path] = "readable"
        log.info("probe %s: readable", path)
    return seen
