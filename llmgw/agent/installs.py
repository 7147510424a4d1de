"""Engine installs on the control plane's order (DESIGN §5).

The agent downloads the publisher's build for its architecture, checks its SHA-256, unpacks
it safely under ``<state_dir>/engines/<engine>/<version>/``, runs it, and only then offers it
(through the ``llmgw-engine.json`` manifest that discovery reads). A refused install raises
:class:`EngineError` and leaves nothing behind.

The URL comes from the control plane, so the download is no probe of the node's network:
only ``https://`` (verified against the system trust store and the cluster CA) or the
``http://``/``file://`` places listed in ``install_sources`` are fetched, redirects only to
listed ``https://`` places (llmgw.contracts.sources), and until the SHA-256 matched, what the
control plane hears is "download failed", "refused" or "checksum mismatch", never a status,
size, digest or error of whatever answered: those go to the agent's own log. Unpacking is
llmgw.fsutil's safe unpack (the one the root update helper uses too).

A little over 600 lines, as one concept: an install from order to manifest (download,
checks, unpack, trial run, commit), each step refusing with the fix for its own failure.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import hmac
import json
import logging
import os
import platform
import shutil
import ssl
import stat
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any, ParamSpec, TypeVar
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from llmgw.agent.discovery import ENGINE_MANIFEST, check_engine_binary
from llmgw.contracts.install_order import SHA256, VERSION, canonical_arch, display_url, url_problem
from llmgw.contracts.sources import SourcePrefix, allowed, split_url
from llmgw.engines.registry import get_engine, installable_engines
from llmgw.errors import ArchiveError, EngineError
from llmgw.fsutil import ArchiveKind, ArchivePolicy, path_problem, unpack_archive
from llmgw.log import kv
from llmgw.proto import control_pb2 as pb

__all__ = [
    "ENGINES",
    "MAX_DOWNLOAD_BYTES",
    "MAX_UNPACKED_BYTES",
    "download_ssl_context",
    "install_engine",
    "remove_leftovers",
]

log = logging.getLogger("llmgw.agent.installs")

ENGINES = installable_engines()
MAX_DOWNLOAD_BYTES = 20 * 1024**3
# What an archive may unpack to: a cap on decompression bombs, generous for a Python venv.
MAX_UNPACKED_BYTES = 64 * 1024**3
ARCHIVE_KINDS = ".tar.gz, .tgz, .tar.xz, .tar or .zip"

_CHUNK = 1 << 20
MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_TMP_PREFIX = ".tmp-"
_TAR_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tar")


# Where distributions keep the system trust store, for a frozen binary whose OpenSSL was
# built with another distribution's default path.
_SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Alpine
    "/etc/pki/tls/certs/ca-bundle.crt",  # RHEL, Fedora, Rocky
    "/etc/ssl/ca-bundle.pem",  # SUSE
    "/etc/ssl/cert.pem",
)

_P = ParamSpec("_P")
_T = TypeVar("_T")


async def install_engine(
    order: pb.InstallEngine,
    *,
    state_dir: Path,
    arch: str | None = None,
    timeout: float = 3600.0,
    max_bytes: int = MAX_DOWNLOAD_BYTES,
    max_unpacked_bytes: int = MAX_UNPACKED_BYTES,
    sources: tuple[SourcePrefix, ...] = (),
    ssl_context: ssl.SSLContext | None = None,
) -> pb.EngineInfo:
    """Carry out an ``InstallEngine`` order and return the installed engine (``ok=True``).

    ``arch`` is this machine's architecture (default ``platform.machine()``); ``timeout``
    bounds the download. ``sources`` are agent.yaml's ``install_sources``; ``ssl_context``
    verifies https:// servers (default: the system trust store; the agent adds the cluster
    CA). Re-sending an order for a version already installed from the same SHA-256 checks
    that install again and returns it without downloading. Every refusal is an
    :class:`EngineError` saying what was wrong and what to do.
    """
    machine = canonical_arch(arch or platform.machine())
    engine, version, url, want = _validate(order, machine, sources)
    shown = display_url(url)
    root = _engines_root(Path(state_dir))
    final = root / engine / version

    manifest = await _in_thread(_read_manifest, final)
    if manifest is not None:
        _refuse_other_build(manifest, final, engine, version, want)
        return await _installed_info(final, manifest, engine, version)

    tmp = _temporary_folder(root)
    try:
        archive = tmp / "download"
        got = await _download(
            url,
            shown,
            archive,
            timeout=timeout,
            max_bytes=max_bytes,
            sources=sources,
            ssl_context=ssl_context,
        )
        _check_digest(got, want, shown, archive)
        staging = tmp / "root"
        kind = _archive_kind(urlsplit(url).path, archive, shown)
        await _in_thread(_unpack, kind, archive, staging, shown, max_unpacked_bytes)
        archive.unlink()
        binary = await _in_thread(_locate, staging, engine, shown, machine)
        info = await _in_thread(check_engine_binary, engine, [str(staging / binary)])
        if not info.ok:
            raise EngineError(
                f"{engine} {version} from {shown} does not run on this node, so it was not "
                f"installed (the download was deleted): {info.problem.strip()}; install what "
                "it is missing on the node, or order a build made for it"
            )
        manifest = {
            "engine": engine,
            "version": version,
            "binary": binary.as_posix(),
            "sha256": want,
            "installed_at": datetime.now(UTC).isoformat(),
            "url": shown,
        }
        manifest = await _put_in_place(staging, final, manifest)
        log.info("installed %s %s from %s into %s", engine, version, shown, final)
        return pb.EngineInfo(
            name=engine,
            path=str(final / manifest["binary"]),
            version=info.version or version,
            ok=True,
        )
    finally:
        await _in_thread(_remove_tree, tmp)


def _temporary_folder(root: Path) -> Path:
    """A fresh folder for one install's download and unpacking, under the engines' root (so
    that the finished install is renamed into place, on the same file system)."""
    try:
        return Path(tempfile.mkdtemp(prefix=_TMP_PREFIX, dir=root))
    except OSError as exc:
        raise EngineError(
            f"cannot make a temporary folder in {root}: {exc.strerror}; check that the state "
            "directory belongs to the agent's user and has free space"
        ) from exc


def _check_digest(got: str, want: str, shown: str, archive: Path) -> None:
    """Refuse a download that is not the build the order names; what it was goes to the
    agent's log only (the control plane hears 'checksum mismatch')."""
    if not hmac.compare_digest(got, want):
        log.warning(
            "engine download does not match the order's SHA-256",
            extra=kv(url=shown, got=got, want=want, size=archive.stat().st_size),
        )
        raise EngineError(
            f"checksum mismatch for {shown}: the download is not the build the order's "
            "SHA-256 names; it was deleted; check the SHA-256 the publisher gives for "
            "this build and send the order again"
        )


async def _put_in_place(staging: Path, final: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Write ``manifest`` into the staged install and move it to ``final``; the manifest in
    place after (the one of an install of the same build that finished first)."""
    await _in_thread(_write_manifest, staging, manifest)
    if await _in_thread(_commit, staging, final):
        return manifest
    # Another install of this version finished while we downloaded.
    engine, version = manifest["engine"], manifest["version"]
    existing = await _in_thread(_read_manifest, final)
    if existing is None:
        raise EngineError(
            f"could not move {engine} {version} into {final}: it vanished while "
            "being replaced; send the order again"
        )
    _refuse_other_build(existing, final, engine, version, manifest["sha256"])
    return existing


def download_ssl_context(cluster_ca: Path | None) -> ssl.SSLContext:
    """How https:// publishers are verified: the system trust store (found also where the
    binary's OpenSSL looks elsewhere) and the cluster CA."""
    ctx = ssl.create_default_context()
    if not ctx.cert_store_stats().get("x509_ca"):
        for bundle in _SYSTEM_BUNDLES:
            if os.path.isfile(bundle):
                ctx.load_verify_locations(cafile=bundle)
                break
    if cluster_ca is not None:
        ctx.load_verify_locations(cafile=str(cluster_ca))
    return ctx


def remove_leftovers(state_dir: Path) -> list[Path]:
    """Delete the temporary folders that an install interrupted by a crash left behind.

    Call it at start-up, before any install runs; returns what it removed."""
    root = Path(state_dir) / "engines"
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(_TMP_PREFIX):
            _remove_tree(entry)
            removed.append(entry)
    return removed


# -- the order --------------------------------------------------------------------------


def _validate(
    order: pb.InstallEngine, machine: str, sources: tuple[SourcePrefix, ...]
) -> tuple[str, str, str, str]:
    engine, version, url = order.engine, order.version, order.url.strip()
    sha256 = order.sha256.strip().lower()
    if engine not in ENGINES:
        raise EngineError(
            f"cannot install engine {engine!r}: installable engines are {', '.join(ENGINES)}; "
            "fix the order's engine"
        )
    if not VERSION.fullmatch(version):
        raise EngineError(
            f"cannot install {engine} version {version!r}: a version is 1-64 letters, digits, "
            "'.', '_', '+' and '-', starting with a letter or digit; fix the order's version"
        )
    problem = url_problem(url)
    if problem is not None:
        raise EngineError(
            f"cannot install {engine} {version} from {display_url(url)!r}: {problem}; fix the "
            "order's url"
        )
    scheme = split_url(url)[0]
    if scheme != "https" and not allowed(url, sources, schemes=(scheme,)):
        raise EngineError(
            f"cannot install {engine} {version} from {display_url(url)}: {scheme}:// URLs are "
            "fetched only from places listed in install_sources in agent.yaml (e.g. "
            f"'install_sources: [{_suggested_prefix(url)}]'); list it there and restart the "
            "agent, or order an https:// URL"
        )
    if not SHA256.fullmatch(sha256):
        raise EngineError(
            f"cannot install {engine} {version}: sha256 {order.sha256!r} is not 64 hex "
            "digits; give the SHA-256 the publisher lists for the build"
        )
    if order.arch and canonical_arch(order.arch) != machine:
        raise EngineError(
            f"cannot install {engine} {version}: the order is for {order.arch} but this node "
            f"is {machine}; send the build for {machine}"
        )
    return engine, version, url, sha256


def _suggested_prefix(url: str) -> str:
    """The folder of ``url``: what an operator would list to allow it."""
    shown = display_url(url).split("?", 1)[0]
    return shown.rsplit("/", 1)[0] + "/"


def _engines_root(state_dir: Path) -> Path:
    root = state_dir / "engines"
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        root.mkdir(exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
    except OSError as exc:
        raise EngineError(
            f"cannot prepare {root} for engine installs: {exc.strerror}; check that the state "
            "directory belongs to the agent's user"
        ) from exc
    return root


# -- installed versions ------------------------------------------------------------------


def _read_manifest(final: Path) -> dict[str, Any] | None:
    if not os.path.lexists(final):
        return None
    path = final / ENGINE_MANIFEST
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        sha256, binary = data["sha256"], data["binary"]
        if not isinstance(sha256, str) or not isinstance(binary, str):
            raise TypeError("sha256 and binary must be strings")
        if path_problem(binary):
            raise ValueError(f"binary {binary!r} is not a path inside the folder")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise EngineError(
            f"{final} exists but its install manifest {ENGINE_MANIFEST} is missing or unreadable "
            f"({reason}); remove {final} and send the order again"
        ) from exc
    return data


def _refuse_other_build(
    manifest: dict[str, Any], final: Path, engine: str, version: str, want: str
) -> None:
    have = str(manifest["sha256"]).lower()
    if not hmac.compare_digest(have, want):
        raise EngineError(
            f"{engine} {version} is already installed in {final} from a build with SHA-256 "
            f"{have}, but the order says {want}; publish the new build under a new version, "
            f"or remove {final} and send the order again"
        )


async def _installed_info(
    final: Path, manifest: dict[str, Any], engine: str, version: str
) -> pb.EngineInfo:
    binary = final / manifest["binary"]
    info = await _in_thread(check_engine_binary, engine, [str(binary)])
    if not info.ok:
        raise EngineError(
            f"{engine} {version} is installed in {final} but no longer runs: "
            f"{info.problem.strip()}; install what it is missing on the node, or remove "
            f"{final} and send the order again"
        )
    return pb.EngineInfo(name=engine, path=str(binary), version=info.version or version, ok=True)


# -- download ----------------------------------------------------------------------------


def _failed(shown: str, why: str) -> EngineError:
    """What the control plane hears of a failed download: the URL it sent, nothing of what
    answered (that goes to the node's log)."""
    log.warning("engine download failed", extra=kv(url=shown, reason=why))
    return EngineError(
        f"download of {shown} failed; the agent's log on the node says why (journalctl -u "
        "llmgw-agent); check the order's URL and that the node can reach it, then send the "
        "order again"
    )


def _redirect_refused(shown: str, target: str) -> EngineError:
    log.warning(
        "engine download refused: it redirects to a place not listed in install_sources",
        extra=kv(url=shown, location=target),
    )
    return EngineError(
        f"download of {shown} refused: it redirects, and redirects are followed only to "
        "https:// places listed in install_sources in agent.yaml; list the place the agent's "
        "log names there and restart the agent, or order the final URL"
    )


async def _download(
    url: str,
    shown: str,
    dest: Path,
    *,
    timeout: float,
    max_bytes: int,
    sources: tuple[SourcePrefix, ...],
    ssl_context: ssl.SSLContext | None,
) -> str:
    """Fetch ``url`` into ``dest`` and return its SHA-256 (hex)."""
    if urlsplit(url).scheme.lower() == "file":
        return await _in_thread(_copy_file, url, shown, dest, max_bytes, sources)
    digest = hashlib.sha256()
    size = 0
    loop = asyncio.get_running_loop()
    client_timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=min(60.0, timeout), sock_read=min(300.0, timeout)
    )
    verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
    current = url
    try:
        async with (
            asyncio.timeout(timeout),
            aiohttp.ClientSession(timeout=client_timeout, auto_decompress=False) as session,
        ):
            for hop in range(MAX_REDIRECTS + 1):
                async with session.get(current, allow_redirects=False, ssl=verify) as resp:
                    if resp.status in _REDIRECTS:
                        target = _redirect_target(current, resp.headers.get("Location", ""))
                        if hop == MAX_REDIRECTS or not allowed(target, sources, schemes=("https",)):
                            raise _redirect_refused(shown, display_url(target))
                        current = target
                        continue
                    if resp.status != 200:
                        raise _failed(shown, f"HTTP {resp.status} {resp.reason or ''}".rstrip())
                    if resp.content_length is not None and resp.content_length > max_bytes:
                        raise _failed(shown, f"over the limit of {max_bytes} bytes")
                    # One writer thread; leaving the `with` waits for a write in flight, so
                    # the cleanup after a cancellation never races it.
                    with open(dest, "xb") as out, ThreadPoolExecutor(1) as writer:
                        async for chunk in resp.content.iter_chunked(_CHUNK):
                            size += len(chunk)
                            if size > max_bytes:
                                raise _failed(shown, f"over the limit of {max_bytes} bytes")
                            await loop.run_in_executor(writer, _write_chunk, out, digest, chunk)
                    return digest.hexdigest()
    except EngineError:
        raise
    except aiohttp.ClientError as exc:
        raise _failed(shown, str(exc) or type(exc).__name__) from exc
    except TimeoutError as exc:
        raise _failed(shown, f"did not finish within {timeout:g} s") from exc
    except OSError as exc:
        raise EngineError(
            f"cannot write the download of {shown} under {dest.parent.parent}: "
            f"{exc.strerror}; free space in the state directory and send the order again"
        ) from exc
    raise AssertionError("unreachable: the redirect loop returns or raises")


def _redirect_target(current: str, location: str) -> str:
    try:
        return str(URL(current).join(URL(location)))
    except (ValueError, TypeError):
        return location


def _copy_file(
    url: str, shown: str, dest: Path, max_bytes: int, sources: tuple[SourcePrefix, ...]
) -> str:
    """Copy a listed file:// source into ``dest``; its SHA-256. A symlink that leads out of
    the listed places is refused."""
    real = os.path.realpath(split_url(url)[3])
    if not allowed(Path(real).as_uri(), sources, schemes=("file",)):
        log.warning(
            "engine download refused: the file leads out of install_sources",
            extra=kv(url=shown, resolved=real),
        )
        raise EngineError(
            f"download of {shown} refused: it resolves (through a symlink) to a file outside "
            "the file:// places listed in install_sources in agent.yaml; list the file's own "
            "folder there or order its real path"
        )
    digest = hashlib.sha256()
    size = 0
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise _failed(shown, exc.strerror or str(exc)) from exc
    with os.fdopen(fd, "rb") as src:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise _failed(shown, "not a regular file")
        try:
            with open(dest, "xb") as out:
                while chunk := src.read(_CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise _failed(shown, f"over the limit of {max_bytes} bytes")
                    _write_chunk(out, digest, chunk)
        except OSError as exc:
            raise _failed(shown, exc.strerror or str(exc)) from exc
    return digest.hexdigest()


def _write_chunk(out: IO[bytes], digest: Any, chunk: bytes) -> None:
    out.write(chunk)
    digest.update(chunk)


# -- unpacking ---------------------------------------------------------------------------


def _archive_kind(url_path: str, archive: Path, shown: str) -> ArchiveKind:
    lower = url_path.lower()
    if lower.endswith(".zip"):
        return "zip"
    if lower.endswith(_TAR_SUFFIXES):
        return "tar"
    # No telling suffix (a redirecting URL, say): go by the content.
    if zipfile.is_zipfile(archive):
        return "zip"
    if tarfile.is_tarfile(archive):
        return "tar"
    raise EngineError(
        f"the download from {shown} is not an archive llmgw can unpack ({ARCHIVE_KINDS}); "
        "the download was deleted; order the publisher's packaged build"
    )


def _unpack(kind: ArchiveKind, archive: Path, dest: Path, shown: str, max_unpacked: int) -> None:
    dest.mkdir(mode=0o700)
    policy = ArchivePolicy(max_bytes=max_unpacked, links=True, place="install folder")
    try:
        unpack_archive(archive, dest, kind=kind, policy=policy)
    except ArchiveError as exc:
        if exc.code == "unsafe":
            raise EngineError(
                f"the archive from {shown} is unsafe and was deleted: member {exc.member!r} "
                f"{exc.reason}; ask the publisher for a build without it"
            ) from exc
        if exc.code == "too_big":
            raise EngineError(
                f"the archive from {shown} unpacks to more than the limit of {max_unpacked} "
                "bytes; the download was deleted; check that the order's URL is the engine build"
            ) from exc
        raise EngineError(
            f"cannot unpack the download from {shown}: {exc.reason}; the archive is damaged or "
            f"not a {ARCHIVE_KINDS}; the download was deleted; ask the publisher for a good build"
        ) from exc


def _locate(staging: Path, engine: str, shown: str, machine: str) -> PurePosixPath:
    spec = get_engine(engine)
    tail, expected = spec.archive_program, spec.archive_holds
    found: list[PurePosixPath] = []
    for dirpath, _dirnames, filenames in os.walk(staging):
        for name in filenames:
            rel = PurePosixPath(os.path.relpath(os.path.join(dirpath, name), staging))
            if rel.parts[-len(tail) :] == tail:
                found.append(rel)
    if not found:
        raise EngineError(
            f"the archive from {shown} holds no {engine} engine: expected {expected}; the "
            f"download was deleted; check that the order's URL is the {engine} build for "
            f"{machine}"
        )
    best = min(found, key=lambda p: (len(p.parts), len(str(p)), str(p)))
    path = staging / best
    if not path.is_file():
        raise EngineError(
            f"{best} in the archive from {shown} is not a file (a dangling symlink?); the "
            "download was deleted; ask the publisher for a complete build"
        )
    if not os.access(path, os.X_OK):
        raise EngineError(
            f"{best} in the archive from {shown} is not executable; the download was "
            "deleted; ask the publisher for a build that keeps its executable bits"
        )
    return best


# -- committing --------------------------------------------------------------------------


def _write_manifest(staging: Path, manifest: dict[str, Any]) -> None:
    path = staging / ENGINE_MANIFEST
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as out:
        json.dump(manifest, out, indent=2, sort_keys=True)
        out.write("\n")
        out.flush()
        os.fsync(out.fileno())


def _commit(staging: Path, final: Path) -> bool:
    """Move the checked install into place in one rename (the manifest already inside it).

    Returns False when the version appeared meanwhile (another install of it finished)."""
    parent = final.parent
    created = not parent.exists()
    try:
        parent.mkdir(exist_ok=True, mode=0o700)
        os.rename(staging, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            return False
        if created:
            try:
                parent.rmdir()
            except OSError:
                pass
        raise EngineError(
            f"cannot move the install into {final}: {exc.strerror}; check that the state "
            "directory belongs to the agent's user and send the order again"
        ) from exc
    fd = os.open(parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _remove_tree(path: Path) -> None:
    """Delete ``path`` even where the archive made folders read-only; never raises."""
    try:
        if not os.path.lexists(path):
            return
        os.chmod(path, 0o700)
        for dirpath, dirnames, _filenames in os.walk(path):
            for name in dirnames:
                child = os.path.join(dirpath, name)
                if not os.path.islink(child):
                    os.chmod(child, 0o700)
        shutil.rmtree(path)
    except OSError as exc:
        log.warning("could not remove %s: %s; delete it by hand", path, exc)


async def _in_thread(func: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run blocking work in a thread; when cancelled, still wait for it to stop, so that
    the cleanup that follows never races a thread that is still writing."""
    future = asyncio.ensure_future(asyncio.to_thread(func, *args, **kwargs))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await asyncio.wait({future})
        raise
