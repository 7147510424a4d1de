"""Files in a directory another user may write, handled by the root helper through descriptors
and never through a symlink planted there.

The agent owns the spool, and may have left anything in it: a symlink where status.json
goes, a FIFO where a file is expected. The helper opens such a directory once
(:data:`OPEN_DIR`) and works relative to that descriptor, so that renaming or replacing the
directory's path changes nothing; files are opened with ``O_NOFOLLOW`` (:data:`OPEN_FILE`),
written with ``llmgw.fsutil.atomic_write(..., dir_fd=...)`` (a new file, renamed over a
symlink rather than through it) and removed with :func:`remove_entry`.
"""

from __future__ import annotations

import os
import shutil
import stat

__all__ = ["OPEN_DIR", "OPEN_FILE", "remove_entry"]

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""A directory, never through a symlink."""
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""A file to read, never through a symlink, and never blocking on a FIFO."""


def remove_entry(dir_fd: int, name: str) -> None:
    """Remove ``name`` under ``dir_fd`` whatever it is, never following a symlink in it."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)
