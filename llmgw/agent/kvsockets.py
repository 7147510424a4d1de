"""Where an engine publishes its KV cache events: a unix socket in a directory of its shard's
own, inside the agent's state directory, that only the agent's user may enter.

The layout is ``STATE/kv/<16 hex digits of the shard id's SHA-256>/kv.sock``, both
directories 0700 and the agent's. The engine is given ``ipc://`` that path
(:func:`kv_endpoint`); vLLM's publisher (and SGLang's, and the sim's) binds an ``ipc://``
endpoint, so the engine creates the socket and the agent dials it. Another local user can
neither connect to it (to read every tenant's token ids), nor bind it (to forge or clear a
shard's blocks), nor take it over after an agent restart: the path is no port anyone may
bind, and the directory lets no one else in. The shard's directory, :func:`kv_socket_dir`, is
the only part of the agent's state an engine needs: a sandboxed engine is given it
read-write, at the same path, and so sees its own socket and no other shard's.

A unix socket's path is at most :data:`MAX_SOCKET_PATH` bytes (``sun_path`` is 108 with its
NUL). The shard's part of the path has a fixed length, so whether it fits depends on the
state directory alone (at most :data:`MAX_STATE_DIR` bytes); a longer one is refused with
that fix rather than shortened into a place another user might reach.

Failures are :class:`~llmgw.errors.ShardError`: a fresh shard is not started, an adopted one
is restarted (:mod:`llmgw.agent.shards`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Iterable
from pathlib import Path

from llmgw.errors import FileError, ShardError
from llmgw.fsutil import make_dir

__all__ = [
    "KV_DIR",
    "MAX_SOCKET_PATH",
    "MAX_STATE_DIR",
    "SOCKET_NAME",
    "check_socket_dir",
    "check_state_dir",
    "kv_endpoint",
    "kv_socket_dir",
    "kv_socket_path",
    "prepare_socket_dir",
    "prune_socket_dirs",
    "remove_socket_dir",
]

KV_DIR = "kv"
SOCKET_NAME = "kv.sock"
MAX_SOCKET_PATH = 107
"""The longest path of a unix socket, in bytes (libzmq refuses a longer one)."""
_NAME_LEN = 16
MAX_STATE_DIR = MAX_SOCKET_PATH - len(f"/{KV_DIR}/{'0' * _NAME_LEN}/{SOCKET_NAME}")
"""The longest state directory whose shards' sockets fit (79 bytes)."""


def kv_socket_dir(state_dir: Path, shard_id: str) -> Path:
    """The directory of one shard's KV event socket: the one path of the agent's state an
    engine may see (a sandbox binds it read-write at the same path). A shard id may hold
    any character of a model name (``/`` and ``:`` too), so the name is a digest of it."""
    name = hashlib.sha256(shard_id.encode("utf-8")).hexdigest()[:_NAME_LEN]
    return state_dir / KV_DIR / name


def kv_socket_path(state_dir: Path, shard_id: str) -> Path:
    return kv_socket_dir(state_dir, shard_id) / SOCKET_NAME


def kv_endpoint(state_dir: Path, shard_id: str) -> str:
    """The ``ipc://`` endpoint the shard's engine binds and the agent dials."""
    return f"ipc://{kv_socket_path(state_dir, shard_id)}"


def prepare_socket_dir(state_dir: Path, shard_id: str) -> str:
    """Make the shard's socket directory ready for a new engine (0700, the agent's, no socket
    left by an earlier one); its endpoint. ShardError says what is wrong and the fix."""
    check_state_dir(state_dir)
    try:
        make_dir(state_dir)
    except FileError as exc:
        raise ShardError(exc.message) from exc
    for directory in (state_dir / KV_DIR, kv_socket_dir(state_dir, shard_id)):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ShardError(
                f"cannot create {directory} for the engine's KV cache events socket: "
                f"{exc.strerror}; check the state directory's owner and free space"
            ) from exc
        _check_private(directory, tighten=True)
    try:
        os.unlink(kv_socket_path(state_dir, shard_id))
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ShardError(
            f"cannot remove {kv_socket_path(state_dir, shard_id)} left by an earlier engine: "
            f"{exc.strerror}; remove it by hand"
        ) from exc
    return kv_endpoint(state_dir, shard_id)


def check_socket_dir(state_dir: Path, shard_id: str, endpoint: str, *, bound: bool) -> None:
    """Whether an adopted engine's ``endpoint`` can be dialled again as private as it was
    made: this agent's endpoint for the shard, in directories still 0700 and the agent's,
    and (``bound``: an engine that was ready, so its publisher is up) a socket there.
    ShardError says why not."""
    expected = kv_endpoint(state_dir, shard_id)
    if endpoint != expected:
        raise ShardError(
            f"its endpoint {endpoint} is not this agent's private socket {expected} (was the "
            "state directory moved?)"
        )
    check_state_dir(state_dir)
    for directory in (state_dir / KV_DIR, kv_socket_dir(state_dir, shard_id)):
        _check_private(directory, tighten=False)
    if not bound:
        return  # a starting engine binds it once its scheduler is up
    path = kv_socket_path(state_dir, shard_id)
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ShardError(f"its engine's socket {path} is gone ({exc.strerror})") from exc
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.geteuid():
        raise ShardError(f"{path} is not a socket of the agent's user")


def remove_socket_dir(state_dir: Path, shard_id: str) -> None:
    """Remove the shard's socket directory (its engine has gone); nothing when it is not there."""
    shutil.rmtree(kv_socket_dir(state_dir, shard_id), ignore_errors=True)


def prune_socket_dirs(state_dir: Path, keep: Iterable[str]) -> list[Path]:
    """Remove the socket directories of every shard not in ``keep`` (engines gone while no
    agent ran); the directories removed."""
    kept = {kv_socket_dir(state_dir, shard_id).name for shard_id in keep}
    try:
        entries = list(os.scandir(state_dir / KV_DIR))
    except OSError:
        return []
    removed = []
    for entry in entries:
        if entry.name not in kept and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def check_state_dir(state_dir: Path) -> None:
    """Whether the sockets of ``state_dir``'s shards fit a unix socket's path (the length
    depends on the state directory alone); ShardError with the fix when they do not."""
    path = kv_socket_path(state_dir, "")
    size = len(os.fsencode(str(path)))
    if size > MAX_SOCKET_PATH:
        raise ShardError(
            f"the socket for an engine's KV cache events would be {path}, {size} bytes: a "
            f"unix socket's path is at most {MAX_SOCKET_PATH}; give the agent a state_dir of "
            f"at most {MAX_STATE_DIR} bytes (agent.yaml state_dir, now "
            f"{len(os.fsencode(str(state_dir)))})"
        )


def _check_private(directory: Path, *, tighten: bool) -> None:
    """``directory`` is a real directory of the agent's user that no one else may enter;
    ``tighten`` makes one that is the agent's 0700 when it is not."""
    try:
        info = os.lstat(directory)
    except OSError as exc:
        raise ShardError(f"{directory} is gone ({exc.strerror})") from exc
    if not stat.S_ISDIR(info.st_mode):
        raise ShardError(f"{directory} is not a directory (a link or a file); remove it")
    if info.st_uid != os.geteuid():
        raise ShardError(
            f"{directory} belongs to uid {info.st_uid}, not the agent's ({os.geteuid()}); "
            "remove it so that the agent makes its own"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode == 0o700:
        return
    if not tighten:
        raise ShardError(f"{directory} is mode {mode:04o}, no longer 0700: others may have used it")
    try:
        os.chmod(directory, 0o700)
    except OSError as exc:
        raise ShardError(f"cannot make {directory} private (0700): {exc.strerror}") from exc
