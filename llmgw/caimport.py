"""The import of a cluster CA export into a control-plane instance's state directory
(``llmgw server --import-ca``, :mod:`llmgw.cli.server`): the PKI directory's CA files and the
admin token written, each only when what is there does not contradict the export, checked
before anything is written.

It runs as root on a directory the control plane's user owns, who may have put anything in
it: everything below the state directory is opened by descriptor and never through a
symlink (a ``STATE/pki`` linked to ``/etc`` would otherwise get a chmod and the CA key), and
every file is written new and renamed into place (:func:`llmgw.fsutil.atomic_write`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from llmgw import pki
from llmgw.caexport import CAExport
from llmgw.errors import CAExportError, FileError, PKIError
from llmgw.fsutil import atomic_write, make_dir

__all__ = ["Installed", "install"]

# This instance's own certificates: an export never carries them, and a directory that
# takes an export has no CA, so any of them there is no certificate of this instance.
_OWN_FILES = ("server.crt", "server.key", "client.crt", "client.key")


@dataclass(frozen=True)
class Installed:
    """What :func:`install` wrote: the CA material (False: this instance had that CA
    already) and the admin token (False: its file held that token already)."""

    ca: bool
    token: bool


def _owner(state_dir: Path) -> tuple[int, int] | None:
    """Whom written files are given to: when root writes them, the owner of the state
    directory (the control plane's user, who must read its CA key); else nobody else."""
    if os.geteuid() != 0:
        return None
    try:
        st = state_dir.stat()
    except OSError:
        return None
    return None if st.st_uid == 0 else (st.st_uid, st.st_gid)


def _make_dir(directory: Path, owner: tuple[int, int] | None) -> None:
    """``directory`` (the state directory, or the admin token's), made 0700 (and given to
    ``owner``) when missing."""
    existed = directory.is_dir()
    make_dir(directory, mode=0o700)
    if owner is not None and not existed:
        try:
            os.chown(directory, *owner)
        except OSError as exc:
            raise FileError(
                f"cannot give {directory} to uid {owner[0]}: {exc.strerror or exc}",
                path=str(directory),
            ) from exc


# The state directory belongs to the control plane's user, who may have put anything in it:
# run as root, the import opens what lies below it by descriptor and never through a symlink,
# so that a STATE/pki linked elsewhere gets neither a chmod nor the CA key.
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _not_followed(path: Path) -> CAExportError:
    return CAExportError(
        f"{path} is a symlink or not what it should be (a directory for the PKI, a file for "
        f"the rest); the import does not follow links there. Nothing was imported; move "
        f"{path} aside, then import again"
    )


def _open_dir(path: Path) -> int | None:
    """The directory ``path`` itself (the state directory, or the admin token's: placed by
    whoever configured the control plane), opened; None when it does not exist."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FileError(
            f"cannot open {path}: {exc.strerror or exc}; nothing was imported", path=str(path)
        ) from exc


def _open_below(parent_fd: int, path: Path) -> int | None:
    """The directory ``path`` (named in ``parent_fd``), never through a symlink; None when
    it does not exist."""
    try:
        return os.open(path.name, _OPEN_DIR, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _not_followed(path) from None
        raise FileError(
            f"cannot open {path}: {exc.strerror or exc}; nothing was imported", path=str(path)
        ) from exc


def _present_ca(pki_fd: int, pki_dir: Path) -> str | None:
    """The hash of the CA the PKI directory (open as ``pki_fd``) holds, None when it holds
    none; its ca.crt and ca.key are read only when neither is a symlink."""
    present = False
    for name in (pki.CA_CERT, pki.CA_KEY):
        try:
            st = os.stat(name, dir_fd=pki_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise _not_followed(pki_dir / name)
        present = True
    if not present:
        return None
    pinned = f"/proc/self/fd/{pki_fd}"  # this very directory, whatever its path names now
    try:
        return pki.load_ca(Path(pinned)).ca_hash()
    except PKIError as exc:
        raise CAExportError(
            f"{pki_dir} holds a CA that cannot be used "
            f"({str(exc).replace(pinned, str(pki_dir))}); nothing was imported. Move "
            f"{pki_dir} aside, then import again"
        ) from exc


def _present_token(dir_fd: int | None, path: Path) -> str | None:
    """The admin token ``path`` (named in ``dir_fd``) holds, read never through a symlink;
    None when there is none."""
    if dir_fd is None:
        return None
    try:
        fd = os.open(path.name, _OPEN_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _not_followed(path) from None
        raise FileError(
            f"cannot read the admin token {path}: {exc.strerror or exc}; nothing was imported. "
            "Make it readable, or move it aside",
            path=str(path),
        ) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_followed(path)
        token = os.read(fd, 4096).decode().strip()
    except UnicodeDecodeError as exc:
        raise FileError(
            f"cannot read the admin token {path}: it is not text; nothing was imported. Move "
            "it aside",
            path=str(path),
        ) from exc
    finally:
        os.close(fd)
    return token or None


def install(export: CAExport, *, pki_dir: Path, token_file: Path) -> Installed:
    """Make ``pki_dir`` hold the export's CA material (ca.crt 0644, ca.key 0600, the
    rotation's files) and ``token_file`` its admin token (0600), checking both before
    either is written: CAExportError (nothing written) when the directory holds another CA
    or the file another token, or when either is a symlink. What is there already is left
    alone, so that importing the same export again changes nothing. Run as root, the files
    go to the state directory's owner; below the state directory nothing is followed."""
    pki_dir, token_file = Path(pki_dir), Path(token_file)
    with contextlib.ExitStack() as fds:

        def opened(fd: int | None) -> int | None:
            if fd is not None:
                fds.callback(os.close, fd)
            return fd

        state_fd = opened(_open_dir(pki_dir.parent))
        pki_fd = None if state_fd is None else opened(_open_below(state_fd, pki_dir))
        have = None if pki_fd is None else _present_ca(pki_fd, pki_dir)
        if have is not None and have != export.ca_hash:
            raise CAExportError(
                f"this instance already has CA {have} (in {pki_dir}); the export is "
                f"{export.ca_hash}, of another cluster or of a CA rotated since. Nothing was "
                f"imported; move {pki_dir} aside if this instance should join that cluster "
                "(it makes its own certificates at start), then import again"
            )
        token_dir_fd = opened(_open_dir(token_file.parent))
        token = _present_token(token_dir_fd, token_file)
        if token is not None and token != export.admin_token:
            raise CAExportError(
                f"{token_file} holds another admin token than the export's; nothing was "
                f"imported. Move {token_file} aside if this instance should join the export's "
                "cluster (llmgw ctl then needs that cluster's token here too), then import again"
            )
        owner = _owner(pki_dir.parent)
        if have is None:
            if state_fd is None:
                _make_dir(pki_dir.parent, owner)
                state_fd = opened(_open_dir(pki_dir.parent))
                assert state_fd is not None
            if pki_fd is None:
                pki_fd = opened(_make_below(state_fd, pki_dir, owner))
            assert pki_fd is not None
            _write_pki(export, pki_fd, pki_dir, owner)
        if token is None:
            if token_dir_fd is None:
                _make_dir(token_file.parent, owner)
                token_dir_fd = opened(_open_dir(token_file.parent))
                assert token_dir_fd is not None
            data = (export.admin_token + "\n").encode()
            atomic_write(token_file.name, data, mode=0o600, owner=owner, dir_fd=token_dir_fd)
    return Installed(ca=have is None, token=token is None)


def _make_below(state_fd: int, pki_dir: Path, owner: tuple[int, int] | None) -> int:
    """The PKI directory made in the state directory (0700, given to ``owner``), opened."""
    try:
        os.mkdir(pki_dir.name, 0o700, dir_fd=state_fd)
    except FileExistsError:
        pass  # made since we looked: opened below, never through a symlink
    except OSError as exc:
        raise FileError(
            f"cannot create directory {pki_dir}: {exc.strerror or exc}", path=str(pki_dir)
        ) from exc
    fd = _open_below(state_fd, pki_dir)
    if fd is None:
        raise FileError(f"{pki_dir} vanished as it was made; import again", path=str(pki_dir))
    if owner is not None:
        try:
            os.fchown(fd, *owner)
        except OSError as exc:
            os.close(fd)
            raise FileError(
                f"cannot give {pki_dir} to uid {owner[0]}: {exc.strerror or exc}",
                path=str(pki_dir),
            ) from exc
    return fd


def _write_pki(export: CAExport, pki_fd: int, pki_dir: Path, owner: tuple[int, int] | None) -> None:
    """The export's files written into the PKI directory open as ``pki_fd``, made 0700 as
    :mod:`llmgw.pki` keeps it; each file new and renamed into place (over a symlink, never
    through one)."""
    try:
        os.fchmod(pki_fd, 0o700)
    except OSError as exc:
        raise FileError(
            f"cannot make {pki_dir} private (0700): {exc.strerror or exc}", path=str(pki_dir)
        ) from exc
    # Files of no CA (the directory has none): a rotation's, or certificates that are not
    # this instance's. The CA's key goes last but one and its certificate last: a crash
    # before then leaves no CA, or one that load_ca reports.
    stale = (pki.PREVIOUS_CA_CERT, pki.PREVIOUS_CA_KEY, pki.CROSS_CERT, pki.ROTATION_FILE)
    for name in (*stale, pki.TRUST_BUNDLE, *_OWN_FILES):
        try:
            os.unlink(name, dir_fd=pki_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise FileError(
                f"cannot remove {pki_dir / name}: {exc.strerror or exc}; remove it by hand, "
                "then import again",
                path=str(pki_dir / name),
            ) from exc

    def put(name: str, data: bytes, mode: int = 0o644) -> None:
        atomic_write(name, data, mode=mode, owner=owner, dir_fd=pki_fd)

    if export.rotation is not None:
        put(pki.ROTATION_FILE, pki.rotation_json(export.rotation), 0o600)
    trust = [export.ca_cert]
    if export.previous_ca_cert is not None:
        trust.append(export.previous_ca_cert)
        put(pki.PREVIOUS_CA_CERT, pki.cert_pem(export.previous_ca_cert))
    if export.cross_cert is not None:
        put(pki.CROSS_CERT, pki.cert_pem(export.cross_cert))
    put(pki.TRUST_BUNDLE, pki.bundle_pem(trust))
    put(pki.CA_KEY, pki.key_pem(export.ca_key), 0o600)
    put(pki.CA_CERT, pki.cert_pem(export.ca_cert))
