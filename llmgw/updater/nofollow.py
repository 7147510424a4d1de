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

import errno
import os
import shutil
import stat

__all__ = ["OPEN_DIR", "OPEN_FILE", "NotPlain", "open_plain", "read_plain", "remove_entry"]

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


class NotPlain(Exception):
    """A file the helper will not read: ``reason`` says why, as a phrase that completes
    "NAME is …" ("a symlink", "not a regular file", "2048 bytes, more than 1024")."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def open_plain(name: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A descriptor of the regular file ``name`` (under ``dir_fd``), opened for reading never
    through a symlink and never blocking on a FIFO. :class:`NotPlain` for a symlink or anything
    but a regular file; other OSErrors (a missing file) are the caller's to judge."""
    try:
        fd = os.open(name, OPEN_FILE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotPlain("a symlink") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotPlain("not a regular file")
    return fd


def read_plain(name: str | os.PathLike[str], *, limit: int, dir_fd: int | None = None) -> bytes:
    """The whole of the regular file ``name`` when it holds at most ``limit`` bytes
    (:func:`open_plain`'s refusals, and :class:`NotPlain` for a larger file)."""
    fd = open_plain(name, dir_fd=dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise NotPlain(f"{size} bytes, more than {limit}")
        return os.read(fd, limit)
    finally:
        os.close(fd)
