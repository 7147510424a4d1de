"""The state directory's lock (``STATE/leader.lock``): held by the SQLite control plane for
its process's life (it leads, :mod:`llmgw.server.ha`), and by ``llmgw server migrate`` while
it copies the database (no control plane may write it meanwhile).

It lives with the store because both the store's copy and the leadership take it: the store
must not import upwards into HA.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["LOCK_FILE", "try_lock"]

LOCK_FILE = "leader.lock"


def try_lock(state_dir: Path) -> int | None:
    """The locked file descriptor when this process now holds the lock, else None (another
    holds it). The lock is never opened through a symbolic link (``OSError`` ELOOP): root
    runs this too (``server migrate``), in a directory the control plane's user owns."""
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
