"""Writing files so that a crash never leaves half of one, and unpacking archives safely.

The one atomic write of llmgw: the data goes to a temporary file beside the target, created
with its final mode (so a private key is never readable by anyone else, not even for an
instant), fsynced, renamed over the target with ``os.replace``, and the directory fsynced so
that the rename survives a power cut. :func:`stage_file` is its first half, for callers that
commit several files together (``agent join``) or that must never replace a file
(:func:`create_file`).

The one safe unpack of tar and zip archives (:func:`unpack_archive`), shared by the agent's
engine installs and the root update helper. The helper runs as root on a bundle the agent's
user wrote, so nothing in an archive may reach outside the destination: no absolute paths,
no ``..``, no backslashes, no devices or fifos, no set-id, sticky or group/world-write bits,
no owners; links only when the :class:`ArchivePolicy` allows them, and then only ones that
resolve inside the destination (checked on the names first and again on disk, as earlier
members may be symlinks); every file created new (``O_EXCL | O_NOFOLLOW``), never written
through an existing path. Extraction is done by hand rather than with tarfile's filters,
which the frozen binary's CPython (3.11.2) lacks.

Failures are :class:`~llmgw.errors.FileError` (a write) and
:class:`~llmgw.errors.ArchiveError` (an archive, with a ``code`` and the member) that
callers translate into their own words.
"""

from __future__ import annotations

import contextlib
import lzma
import os
import re
import secrets
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Literal

from llmgw.errors import ArchiveError, FileError

__all__ = [
    "ArchiveKind",
    "ArchivePolicy",
    "Member",
    "atomic_write",
    "create_file",
    "fsync_dir",
    "list_archive",
    "make_dir",
    "path_problem",
    "stage_file",
    "unpack_archive",
    "write_private",
]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
# Mode bits an unpacked file never keeps: set-id, sticky, group and world write.
_BAD_MODE_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX | stat.S_IWGRP | stat.S_IWOTH
_MAX_LINK_TARGET = 4096
# What a damaged or foreign archive raises while it is read.
_READ_ERRORS = (
    tarfile.TarError,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    lzma.LZMAError,
    zlib.error,
    EOFError,
    RuntimeError,  # an encrypted zip member
    NotImplementedError,  # an unsupported zip compression
    UnicodeDecodeError,
)


# -- atomic writes ---------------------------------------------------------------------------


def fsync_dir(directory: Path | str | int) -> None:
    """Flush a directory's entries (a rename in it) to disk; ``directory`` is a path or an
    open descriptor. Never raises: some file systems cannot fsync a directory, and the data
    itself is already safe."""
    if isinstance(directory, int):
        with contextlib.suppress(OSError):
            os.fsync(directory)
        return
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def make_dir(directory: Path | str, *, mode: int = 0o700, tighten: bool = False) -> None:
    """Create ``directory`` (and its parents) with exactly ``mode`` when it is missing; with
    ``tighten`` also chmod an existing one to ``mode``. FileError if it cannot be done."""
    path = Path(directory)
    try:
        if not path.is_dir():
            path.mkdir(mode=mode, parents=True, exist_ok=True)
            os.chmod(path, mode)  # the umask may have removed bits; make it exact
        elif tighten and stat.S_IMODE(path.stat().st_mode) != mode:
            os.chmod(path, mode)
    except OSError as exc:
        raise FileError(
            f"cannot create directory {path}: {exc.strerror or exc}; create it (mode "
            f"{mode:04o}) or choose another directory",
            path=str(path),
        ) from exc


def _write_error(path: Path | str, exc: OSError, hint: str) -> FileError:
    return FileError(f"cannot write {path}: {exc.strerror or exc}; {hint}", path=str(path))


def stage_file(
    path: Path | str,
    data: bytes,
    *,
    mode: int = 0o644,
    fsync: bool = True,
    dir_fd: int | None = None,
    owner: tuple[int, int] | None = None,
) -> str:
    """Write ``data`` to a new temporary file beside ``path`` and return the temporary's path
    (its bare name when ``dir_fd`` is given: ``path`` is then a name in that directory).

    The file is created with ``mode`` exactly (whatever the umask) and, with ``owner``
    (uid, gid), chowned before any data lands; never through a symlink. The caller renames
    it into place or unlinks it; FileError (nothing left behind) if it cannot be written."""
    name = os.fspath(path)
    head, tail = os.path.split(name)
    tmp = os.path.join(head, f".{tail}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, _CREATE, mode, dir_fd=dir_fd)
    except OSError as exc:
        where = head or "the directory"
        raise _write_error(name, exc, f"check that {where} exists and is writable") from exc
    try:
        try:
            os.fchmod(fd, mode)  # the umask can only have removed bits; make it exact
            if owner is not None:
                os.fchown(fd, *owner)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        if isinstance(exc, OSError):
            where = head or "the directory"
            raise _write_error(
                name, exc, f"check the free space and permissions of {where}"
            ) from exc
        raise
    return tmp


def atomic_write(
    path: Path | str,
    data: bytes,
    *,
    mode: int = 0o644,
    fsync: bool = True,
    dir_fd: int | None = None,
    owner: tuple[int, int] | None = None,
) -> None:
    """Replace ``path`` with ``data`` atomically: readers see the old file or the new one,
    never a part; the new file has ``mode`` (and ``owner``) from the moment it exists. With
    ``fsync`` the data and the rename are on disk when this returns. ``dir_fd``: ``path`` is
    a name in that open directory (the root helper's way of never following a symlink
    another user left in a path). FileError if it cannot be written; nothing is left behind."""
    tmp = stage_file(path, data, mode=mode, fsync=fsync, dir_fd=dir_fd, owner=owner)
    try:
        if dir_fd is None:
            os.replace(tmp, path)
        else:
            os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        parent = os.path.dirname(os.fspath(path)) or "the directory"
        raise _write_error(path, exc, f"check the permissions of {parent}") from exc
    if fsync:
        fsync_dir(dir_fd if dir_fd is not None else (os.path.dirname(os.fspath(path)) or "."))


def write_private(path: Path | str, data: bytes) -> None:
    """:func:`atomic_write` with mode 0600: a key, a token, a password."""
    atomic_write(path, data, mode=0o600)


def create_file(path: Path | str, data: bytes, *, mode: int = 0o644) -> bool:
    """Create ``path`` holding ``data`` (complete, fsynced, with ``mode``) unless it exists:
    an existing file, even one that appeared meanwhile, is never replaced. True when created,
    False when ``path`` was there already; FileError if it cannot be written."""
    tmp = stage_file(path, data, mode=mode)
    try:
        os.link(tmp, path)  # fails when the target exists, where a rename would replace it
    except FileExistsError:
        return False
    except OSError as exc:
        parent = os.path.dirname(os.fspath(path)) or "the directory"
        raise _write_error(path, exc, f"check the permissions of {parent}") from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(os.path.dirname(os.fspath(path)) or ".")
    return True


# -- archives --------------------------------------------------------------------------------

ArchiveKind = Literal["tar", "tar.gz", "zip"]
"""``tar``: a tar file, plain or compressed (gzip, xz, bzip2); ``tar.gz``: gzip only; ``zip``."""

MemberKind = Literal["file", "dir", "symlink", "hardlink"]


@dataclass(frozen=True)
class ArchivePolicy:
    """What an archive may hold, beyond the rules every archive obeys (module docstring).

    ``max_bytes``: the most its files may unpack to (a cap on decompression bombs);
    ``max_members``: the most entries, or None; ``links``: symlinks and hard links (that stay
    inside the destination) allowed, else only files and directories; ``single_top``: every
    member under one top folder; ``replace``: a later member may take the place of an earlier
    file or link (as ``tar -r`` appends), else a name held twice is refused (a folder may be
    named again); ``place``: how messages name the destination."""

    max_bytes: int
    max_members: int | None = None
    links: bool = True
    single_top: bool = False
    replace: bool = True
    place: str = "destination folder"


@dataclass(frozen=True)
class Member:
    """One checked entry of an archive, as it will be unpacked."""

    name: str
    kind: MemberKind
    size: int
    mode: int
    mtime: float | None = None
    link: str | None = None


def _unsafe(name: str, reason: str) -> ArchiveError:
    return ArchiveError(f"member {name!r} {reason}", code="unsafe", member=name, reason=reason)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def path_problem(name: str) -> str | None:
    """Why ``name`` (an archive member, a path in a manifest) cannot be used as a relative
    path below a folder, judged on the name alone; None when it can."""
    if not name:
        return "has an empty name"
    if name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        return "has an absolute path"
    if "\\" in name:
        return "has a backslash in its name (a Windows path?)"
    if "\0" in name:
        return "has a NUL character in its name"
    parts = name.split("/")
    if ".." in parts:
        return "has a '..' component"
    if "" in parts[:-1]:
        return "has an empty path component"
    return None


class _Checker:
    """The checks of one archive's members, in archive order."""

    def __init__(self, root: str, policy: ArchivePolicy) -> None:
        self.root = root
        self.policy = policy
        self.total = 0
        self.count = 0
        self.top: str | None = None
        self.files: set[str] = set()
        self.seen: dict[str, MemberKind] = {}
        self.place = policy.place
        self.allowed = "a file, directory or link" if policy.links else "a file or directory"

    def special(self, name: str, what: str) -> ArchiveError:
        return _unsafe(name, f"{what}, not {self.allowed}")

    def check_name(self, name: str, *, is_dir: bool) -> None:
        """The checks of a member's place, made before its kind is looked at."""
        self.count += 1
        limit = self.policy.max_members
        if limit is not None and self.count > limit:
            raise ArchiveError(
                f"it has more than {limit} members", code="too_many", reason=f"over {limit}"
            )
        problem = path_problem(name)
        if problem:
            raise _unsafe(name, problem)
        if self.policy.single_top:
            top = name.split("/")[0]
            self.top = self.top or top
            if top != self.top:
                raise _unsafe(name, f"is outside the top folder {self.top}/")
        target = os.path.normpath(os.path.join(self.root, name))
        if not _inside(target, self.root):
            raise _unsafe(name, f"would land outside the {self.place}")
        if target == self.root and not is_dir:
            raise _unsafe(name, f"would replace the {self.place} itself")

    def check(self, member: Member) -> None:
        """The checks of a member of an allowed kind: its link, its size."""
        target = os.path.normpath(os.path.join(self.root, member.name))
        earlier = self.seen.get(target)
        if not self.policy.replace and earlier and not (earlier == member.kind == "dir"):
            raise _unsafe(member.name, "is in the archive twice")
        self.seen[target] = member.kind
        if member.kind in ("symlink", "hardlink"):
            self._check_link(member)
        if member.kind == "file":
            self.total += member.size
            self.files.add(target)
            if self.total > self.policy.max_bytes:
                raise ArchiveError(
                    f"it unpacks to more than {self.policy.max_bytes} bytes",
                    code="too_big",
                    reason=f"over {self.policy.max_bytes} bytes",
                )

    def _check_link(self, member: Member) -> None:
        hard = member.kind == "hardlink"
        what = "a hard link" if hard else "a symlink"
        link = member.link or ""
        if not self.policy.links:
            raise _unsafe(
                member.name,
                f"is a link ({what} to {link!r}), and this archive may hold only files and "
                "directories",
            )
        # A symlink resolves from its own folder; a tar hard link names a path in the archive.
        base = self.root if hard else os.path.dirname(os.path.join(self.root, member.name))
        outside = f"is {what} to {link!r}, outside the {self.place}"
        if not link or os.path.isabs(link) or "\0" in link:
            raise _unsafe(member.name, outside)
        resolved = os.path.normpath(os.path.join(base, link))
        if not _inside(resolved, self.root):
            raise _unsafe(member.name, outside)
        if hard and resolved not in self.files:
            raise _unsafe(
                member.name,
                f"is a hard link to {link!r}, which is no file before it in the archive",
            )


def _tar_member(info: tarfile.TarInfo, checker: _Checker) -> Member:
    kind: MemberKind
    if info.isreg():
        kind = "file"
    elif info.isdir():
        kind = "dir"
    elif info.issym():
        kind = "symlink"
    elif info.islnk():
        kind = "hardlink"
    elif info.ischr() or info.isblk():
        raise checker.special(info.name, "is a device file")
    elif info.isfifo():
        raise checker.special(info.name, "is a fifo")
    else:
        raise checker.special(info.name, f"is a special file (tar type {info.type!r})")
    link = info.linkname if kind in ("symlink", "hardlink") else None
    size = info.size if kind == "file" else 0
    return Member(info.name, kind, size, info.mode, float(info.mtime), link)


def _zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, checker: _Checker) -> Member:
    mode = info.external_attr >> 16
    fmt = stat.S_IFDIR if info.is_dir() else (stat.S_IFMT(mode) or stat.S_IFREG)
    link = None
    mtime = None
    with contextlib.suppress(ValueError, OverflowError):
        mtime = datetime(*info.date_time).timestamp()
    if fmt == stat.S_IFDIR:
        return Member(info.filename, "dir", 0, mode & 0o7777 or 0o755, mtime)
    if fmt == stat.S_IFLNK:
        if info.file_size > _MAX_LINK_TARGET:
            raise _unsafe(info.filename, "is a symlink with an oversized target")
        link = zf.read(info).decode()
        return Member(info.filename, "symlink", 0, 0o777, mtime, link)
    if fmt != stat.S_IFREG:
        what = "is a fifo" if fmt == stat.S_IFIFO else "is a device or special file"
        raise checker.special(info.filename, what)
    return Member(info.filename, "file", info.file_size, mode & 0o7777 or 0o644, mtime)


@contextlib.contextmanager
def _opened(archive: Path, kind: ArchiveKind) -> Iterator[tarfile.TarFile | zipfile.ZipFile]:
    if kind == "zip":
        with zipfile.ZipFile(archive) as zf:
            yield zf
    else:
        with tarfile.open(archive, "r:gz" if kind == "tar.gz" else "r:*") as tf:
            yield tf


def _members(
    handle: tarfile.TarFile | zipfile.ZipFile, checker: _Checker
) -> list[tuple[Member, tarfile.TarInfo | zipfile.ZipInfo]]:
    result: list[tuple[Member, tarfile.TarInfo | zipfile.ZipInfo]] = []
    if isinstance(handle, zipfile.ZipFile):
        for zinfo in handle.infolist():
            is_dir = zinfo.is_dir() or stat.S_ISDIR(zinfo.external_attr >> 16)
            checker.check_name(zinfo.filename, is_dir=is_dir)
            member = _zip_member(handle, zinfo, checker)
            checker.check(member)
            result.append((member, zinfo))
    else:
        for tinfo in handle:  # one at a time: a bomb of headers stops at max_members
            checker.check_name(tinfo.name, is_dir=tinfo.isdir())
            member = _tar_member(tinfo, checker)
            checker.check(member)
            result.append((member, tinfo))
    return result


def _read_error(archive: Path, exc: BaseException) -> ArchiveError:
    return ArchiveError(
        f"{archive.name} cannot be read as an archive ({exc})",
        code="unreadable",
        reason=str(exc) or type(exc).__name__,
    )


def list_archive(archive: Path, *, kind: ArchiveKind, policy: ArchivePolicy) -> list[Member]:
    """Every member of ``archive``, checked against the rules and ``policy`` without
    unpacking anything; ArchiveError (``unsafe``, ``too_big``, ``too_many``, ``unreadable``)
    at the first member refused."""
    checker = _Checker(os.sep + "dest", policy)
    try:
        with _opened(archive, kind) as handle:
            return [member for member, _ in _members(handle, checker)]
    except ArchiveError:
        raise
    except (*_READ_ERRORS, OSError) as exc:
        raise _read_error(archive, exc) from exc


def unpack_archive(
    archive: Path, dest: Path, *, kind: ArchiveKind, policy: ArchivePolicy
) -> list[Member]:
    """Unpack ``archive`` into the existing directory ``dest`` and return its members.

    Every member is checked (as :func:`list_archive`) before anything is written, and again
    on disk as it is unpacked. Files get their archive mode less set-id, sticky and
    group/world-write bits, plus owner read/write; no owner is ever set. ArchiveError: codes
    as :func:`list_archive`, and ``write_failed`` when the destination cannot take it (what
    was unpacked so far stays: the caller removes ``dest``)."""
    root = os.path.realpath(dest)
    checker = _Checker(root, policy)
    try:
        with _opened(archive, kind) as handle:
            members = _members(handle, checker)
            dirs: list[tuple[str, Member]] = []
            for member, info in members:
                path = _unpack_one(handle, member, info, root, policy)
                if path is not None:
                    dirs.append((path, member))
            # Folders last, deepest first: a read-only one must not stop what goes inside it.
            for path, member in sorted(dirs, key=lambda d: d[0], reverse=True):
                # A later member may have re-pointed a symlink in the folder's path since it
                # was made: resolve it again, and never set a mode outside the destination.
                real = os.path.realpath(path)
                if not _inside(real, root):
                    raise _unsafe(
                        member.name,
                        f"would land outside the {policy.place} through a symlink in it",
                    )
                os.chmod(real, (member.mode & 0o777 & ~_BAD_MODE_BITS) | stat.S_IRWXU)
                if member.mtime is not None:
                    with contextlib.suppress(OSError, OverflowError, ValueError):
                        os.utime(real, (member.mtime, member.mtime), follow_symlinks=False)
    except ArchiveError:
        raise
    except _READ_ERRORS as exc:
        raise _read_error(archive, exc) from exc
    except OSError as exc:
        raise ArchiveError(
            f"cannot unpack {archive.name} into {dest}: {exc.strerror or exc}",
            code="write_failed",
            reason=str(exc.strerror or exc),
        ) from exc
    return [member for member, _ in members]


def _on_disk(member: Member, root: str, path: str, place: str) -> None:
    """Re-check against what is already unpacked: symlinks unpacked earlier are followed."""
    if path == root:
        return  # the destination itself (``.``): a folder, checked on its name
    parent = os.path.realpath(os.path.dirname(path))
    if not _inside(parent, root) or not _inside(os.path.realpath(path), root):
        raise _unsafe(member.name, f"would land outside the {place} through a symlink in it")
    if member.link is not None:
        hard = member.kind == "hardlink"
        base = root if hard else parent
        if not _inside(os.path.realpath(os.path.join(base, member.link)), root):
            what = "a hard link" if hard else "a symlink"
            raise _unsafe(member.name, f"is {what} to {member.link!r}, outside the {place}")


def _unpack_one(
    handle: tarfile.TarFile | zipfile.ZipFile,
    member: Member,
    info: tarfile.TarInfo | zipfile.ZipInfo,
    root: str,
    policy: ArchivePolicy,
) -> str | None:
    """Unpack one member; returns the path of a folder (its mode is set at the end)."""
    path = os.path.normpath(os.path.join(root, member.name))
    _on_disk(member, root, path, policy.place)
    if member.kind == "dir":
        if path != root:
            os.makedirs(path, mode=0o700, exist_ok=True)
            return path
        return None
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            raise _unsafe(member.name, "would replace a folder unpacked before it")
        os.unlink(path)  # a later entry replaces an earlier one, never writes through it
    if member.kind == "symlink":
        os.symlink(member.link or "", path)
        return None
    if member.kind == "hardlink":
        source = os.path.normpath(os.path.join(root, member.link or ""))
        if not stat.S_ISREG(os.lstat(source).st_mode):
            raise _unsafe(member.name, f"is a hard link to {member.link!r}, which is not a file")
        os.link(source, path, follow_symlinks=False)
        return None
    source_file = _open_member(handle, info)
    fd = os.open(path, _CREATE, 0o600)
    with os.fdopen(fd, "wb") as out, source_file:
        written = 0
        while chunk := source_file.read(_CHUNK):
            written += len(chunk)
            if written > member.size:
                raise _unsafe(member.name, "holds more data than its header says")
            out.write(chunk)
        out.flush()
        os.fchmod(fd, (member.mode & 0o777 & ~_BAD_MODE_BITS) | stat.S_IRUSR | stat.S_IWUSR)
        if member.mtime is not None:
            with contextlib.suppress(OSError, OverflowError, ValueError):
                os.utime(fd, (member.mtime, member.mtime))
    return None


def _open_member(
    handle: tarfile.TarFile | zipfile.ZipFile, info: tarfile.TarInfo | zipfile.ZipInfo
) -> IO[bytes]:
    if isinstance(handle, zipfile.ZipFile):
        assert isinstance(info, zipfile.ZipInfo)
        return handle.open(info)
    assert isinstance(info, tarfile.TarInfo)
    source = handle.extractfile(info)
    if source is None:
        raise _unsafe(info.name, "has no data")
    return source
