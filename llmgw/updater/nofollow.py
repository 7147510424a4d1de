"""Files in a directory another user may write, handled by the root helper through descriptors
and never through a symlink planted there.

The agent owns the spool, and may have left anything in it: a symlink where status.json
goes, a FIFO where a file is expected. The helper opens such a directory once (:data:`OPEN_DIR`)
and works relative to that descriptor, so that renaming or replacing the directory's path
changes nothing; files are opened with ``O_NOFOLLOW`` and created with ``O_EXCL``.
(``llmgw.fsutil`` writes by path, which re-resolves every component: right for directories
only root can write, not for these.)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat

__all__ = ["OPEN_DIR", "OPEN_FILE", "remove_entry", "write_at"]

OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""A directory, never through a symlink."""
OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""A file to read, never through a symlink, and never blocking on a FIFO."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_at(dir_fd: int, name: str, data: bytes, *, mode: int, owner_of_dir: bool = False) -> None:
    """``name`` under ``dir_fd``, atomically: a new file (``O_EXCL``, so never a symlink's
    target) with ``mode``, written and synced, renamed over ``name`` (which replaces a
    symlink rather than following it), and the directory synced. ``owner_of_dir`` (as root):
    owned like the directory, so its owner can read and remove it. OSError, nothing left
    behind, when it cannot be written."""
    tmp = f".{name}.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(tmp, _CREATE, mode, dir_fd=dir_fd)
        try:
            os.fchmod(fd, mode)
            if owner_of_dir and os.geteuid() == 0:
                owner = os.fstat(dir_fd)
                os.fchown(fd, owner.st_uid, owner.st_gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


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
