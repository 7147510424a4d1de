"""Applying a spooled update order (``llmgw agent update-apply``, as ROOT; see
:mod:`llmgw.updater` for what it trusts), started by ``llmgw-agent-update.path`` when the
agent has renamed a finished download to ``<spool>/request``.

The request is moved out of the agent's reach (into the helper's state directory, made
root's) before anything in it is read; its files are read through descriptors opened with
``O_NOFOLLOW`` and the bundle is copied before it is checked. The order is applied only when
it verifies against the trusted CA, names this node, has not expired, carries a counter
above the last accepted one, is for this machine's architecture, matches the bundle's
SHA-256, version and architecture, and does not downgrade the installed agent; the counter
is spent before the bundle's ``install-agent.sh upgrade`` runs. An order made across a CA
rotation moves the trust to the new CA it names (:func:`llmgw.contracts.update_order.
trust_move`, written by :func:`llmgw.updater.trust.install_trust`) when it is accepted. Every verdict but "nothing
to do" goes to ``<spool>/status.json``, which the agent reports to the control plane.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmgw.contracts.update_order import (
    BUNDLE_FILE,
    DEFAULT_SPOOL,
    MAX_BUNDLE,
    MAX_SMALL,
    ORDER_FILE,
    REQUEST,
    REQUEST_FILES,
    SIGNATURE_FILE,
    STATUS,
    machine_arch,
    parse_order,
    trust_move,
    verify_order,
)
from llmgw.errors import FileError, UpdateError
from llmgw.fsutil import atomic_write
from llmgw.updater.bundle import check_bundle, installed_version, run_installer, unpack
from llmgw.updater.nofollow import (
    OPEN_DIR,
    NotPlain,
    open_plain,
    read_plain,
    remove_entry,
)
from llmgw.updater.trust import DEFAULT_TRUST, TRUST_CA, TRUST_NODE_ID, install_trust
from llmgw.versions import version_key

__all__ = [
    "DEFAULT_INSTALLED_BINARY",
    "DEFAULT_STATE",
    "ApplyResult",
    "apply_request",
    "read_counter",
]

DEFAULT_STATE = Path("/var/lib/llmgw-update")
DEFAULT_INSTALLED_BINARY = Path("/usr/local/lib/llmgw-agent/llmgw")
COUNTER_FILE = "counter"

_CHUNK = 1 << 20


@dataclass(frozen=True)
class ApplyResult:
    """The helper's verdict: what it wrote to status.json, and its exit code."""

    state: str
    message: str
    counter: int = 0
    version: str = ""

    @property
    def exit_code(self) -> int:
        return 0 if self.state in ("done", "idle") else 1


def _say(message: str) -> None:
    print(f"llmgw-agent-update: {message}", flush=True)


def apply_request(
    *,
    spool: Path = DEFAULT_SPOOL,
    trust: Path = DEFAULT_TRUST,
    state: Path = DEFAULT_STATE,
    installed_binary: Path = DEFAULT_INSTALLED_BINARY,
    now: Callable[[], float] = time.time,
    machine: str | None = None,
) -> ApplyResult:
    """Take ``spool/request`` out of the agent's reach, check it, and apply it (as root).

    Every verdict but "nothing to do" is written to ``spool/status.json``. Raises
    UpdateError only when the helper itself cannot work (its state directory, a spool that
    is not a directory); a bad request is a refused ApplyResult."""
    try:
        spool_fd = os.open(spool, OPEN_DIR)
    except FileNotFoundError:
        _say(f"no spool at {spool}; nothing to do")
        return ApplyResult("idle", "no request")
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UpdateError(
                f"the update spool {spool} is not a directory (a symlink?); it is ignored. "
                "Remove it: the agent makes it again",
                state="refused",
            ) from None
        raise UpdateError(f"cannot open the update spool {spool}: {exc.strerror}") from exc
    try:
        with _locked_state(state) as work_fd:
            name = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now())) + f"-{secrets.token_hex(4)}"
            try:
                os.rename(REQUEST, name, src_dir_fd=spool_fd, dst_dir_fd=work_fd)
            except FileNotFoundError:
                _say(f"no request in {spool}; nothing to do")
                return ApplyResult("idle", "no request")
            except OSError as exc:
                if exc.errno == errno.EXDEV:
                    raise UpdateError(
                        f"{spool} and {state} are on different file systems; the request "
                        "cannot be moved out of the agent's reach. Keep both under /var/lib",
                        state="failed",
                    ) from exc
                raise UpdateError(
                    f"cannot move {spool / REQUEST} to {state / 'work'}: {exc.strerror}"
                ) from exc
            _say(f"took {spool / REQUEST} as {state / 'work' / name}")
            try:
                result = _apply(
                    work_fd,
                    name,
                    work=state / "work" / name,
                    trust=trust,
                    state=state,
                    installed_binary=installed_binary,
                    now=now,
                    machine=machine,
                    progress=lambda r: _write_status(spool_fd, r),
                )
            finally:
                try:
                    remove_entry(work_fd, name)
                except OSError as exc:
                    _say(
                        f"cannot remove {state / 'work' / name}: {exc.strerror}; remove it by hand"
                    )
            _write_status(spool_fd, result)
            _say(f"{result.state}: {result.message}")
            return result
    finally:
        os.close(spool_fd)


@contextlib.contextmanager
def _locked_state(state: Path) -> Iterator[int]:
    """``state/work`` (0700), opened, with ``state/lock`` held: one helper at a time."""
    try:
        state.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(state, 0o700)
        (state / "work").mkdir(mode=0o700, exist_ok=True)
        work_fd = os.open(state / "work", OPEN_DIR)
    except OSError as exc:
        raise UpdateError(
            f"cannot prepare the helper's state directory {state}: {exc.strerror}; it must be "
            "root's (run the helper as root, from llmgw-agent-update.service)",
            state="failed",
        ) from exc
    lock_fd = os.open(state / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        yield work_fd
    finally:
        os.close(lock_fd)
        os.close(work_fd)


def _apply(
    work_fd: int,
    name: str,
    *,
    work: Path,
    trust: Path,
    state: Path,
    installed_binary: Path,
    now: Callable[[], float],
    machine: str | None,
    progress: Callable[[ApplyResult], None],
) -> ApplyResult:
    counter, version = 0, ""
    try:
        try:
            req_fd = os.open(name, OPEN_DIR, dir_fd=work_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UpdateError(
                    "the request is not a directory (a symlink or a file); the agent must "
                    "rename a directory to 'request'"
                ) from None
            raise
        try:
            # Out of the agent's reach from now on: it can no longer add or rename entries.
            if os.geteuid() == 0:
                os.fchown(req_fd, 0, 0)
            os.fchmod(req_fd, 0o700)
            names = set(os.listdir(req_fd))
            if names != REQUEST_FILES:
                raise UpdateError(
                    f"the request holds {sorted(names)}, not exactly {sorted(REQUEST_FILES)}"
                )
            order_bytes = _read_small(req_fd, ORDER_FILE)
            signature = _read_small(req_fd, SIGNATURE_FILE)
            with contextlib.suppress(UpdateError):
                unverified = parse_order(order_bytes)
                counter, version = int(unverified["counter"]), str(unverified["version"])
            order, move = _check_order(order_bytes, signature, trust, state, now, machine)
            # A copy the agent cannot change while we check and unpack it.
            digest = _copy_bundle(req_fd, BUNDLE_FILE, "verified.tar.gz")
            if digest != order["sha256"]:
                raise UpdateError(
                    f"the bundle's SHA-256 is {digest}, not the {order['sha256']} the order names"
                )
            bundle = work / "verified.tar.gz"
            top, info = check_bundle(bundle)
            if info.get("version") != version:
                raise UpdateError(
                    f"the bundle is version {info.get('version') or '(none)'}, the order "
                    f"says {version}"
                )
            if info.get("architecture") != f"linux-{order['arch']}":
                raise UpdateError(
                    f"the bundle is for {info.get('architecture') or '(none)'}, the order "
                    f"says linux-{order['arch']}"
                )
            installed = installed_version(installed_binary)
            if version_key(version) < version_key(installed):
                raise UpdateError(
                    f"version {version} is older than the installed {installed}; a downgrade "
                    "is refused (reinstall by hand to go back)"
                )
            # Accepted. Across a CA rotation the trust moves first, to the new CA the order
            # names (it verified under the CA trusted until now); then the counter is spent
            # before anything else happens, so this order cannot be replayed even if the
            # upgrade fails halfway.
            if move is not None:
                _move_trust(work, trust, *move)
            _write_counter(state, counter)
            progress(
                ApplyResult("applying", f"upgrading {installed} -> {version}", counter, version)
            )
            _say(f"accepted order {counter}: {installed} -> {version}")
            unpacked = work / "unpacked"
            unpacked.mkdir(mode=0o700)
            unpack(bundle, unpacked)
            _say(f"running {unpacked / top / 'install-agent.sh'} upgrade")
            code, tail = run_installer(unpacked / top)
        finally:
            os.close(req_fd)
    except UpdateError as exc:  # refused (a bad request), or failed
        return ApplyResult(exc.state, exc.message, counter, version)
    except FileError as exc:  # the counter could not be written: nothing was installed
        return ApplyResult("failed", exc.message, counter, version)
    except OSError as exc:
        return ApplyResult(
            "failed", f"{exc.strerror or exc} ({exc.filename or 'the request'})", counter, version
        )
    except Exception as exc:  # a root helper reports every failure rather than dying silently
        return ApplyResult("failed", f"the update helper failed: {exc!r}", counter, version)
    if code == 0:
        return ApplyResult("done", f"upgraded to {version}", counter, version)
    return ApplyResult(
        "rolled-back",
        f"install-agent.sh upgrade exited with {code}; the installer rolled back. "
        + (" | ".join(tail) if tail else "(no output on stderr)"),
        counter,
        version,
    )


def _move_trust(work: Path, trust: Path, pin: str, ca_pem: bytes) -> None:
    """Trust the CA ``ca_pem`` from now on, through the one function that writes the trust
    (its pin checked again there); the certificate is written to the helper's own work
    directory first, never read back from the agent's spool."""
    candidate = work / "new-ca.pem"
    atomic_write(candidate, ca_pem, mode=0o600)
    install_trust(candidate, trust, pin)
    _say(f"the update helper now trusts CA {pin} (the cluster CA was rotated)")


def _check_order(
    order_bytes: bytes,
    signature: bytes,
    trust: Path,
    state: Path,
    now: Callable[[], float],
    machine: str | None,
) -> tuple[dict[str, Any], tuple[str, bytes] | None]:
    try:
        ca_pem = (trust / TRUST_CA).read_bytes()
        own_id = (trust / TRUST_NODE_ID).read_text().strip()
    except OSError as exc:
        raise UpdateError(
            f"cannot read the trusted CA and node id in {trust}: {exc.strerror} "
            f"({exc.filename}); the installer writes them: reinstall the agent",
            state="failed",
        ) from exc
    order = verify_order(ca_pem, order_bytes, signature, now=now())
    if order["node_id"] != own_id:
        raise UpdateError(f"the order is for node {order['node_id']}, and this is node {own_id}")
    if order["expires"] <= now():
        raise UpdateError(
            f"the order expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(order['expires']))}; "
            "order the update again"
        )
    last = read_counter(state)
    if order["counter"] <= last:
        raise UpdateError(
            f"the order's counter {order['counter']} is not above the last accepted one "
            f"({last}): a replayed or out-of-date order"
        )
    arch = machine_arch(machine)
    if arch is not None and order["arch"] != arch:
        raise UpdateError(
            f"the order is for linux-{order['arch']}, and this machine is linux-{arch}"
        )
    return order, trust_move(order, ca_pem)


def read_counter(state: Path) -> int:
    """The last counter the helper accepted (0 before the first)."""
    try:
        text = (state / COUNTER_FILE).read_text().strip()
    except FileNotFoundError:
        return 0
    if not text.isdigit():
        raise UpdateError(
            f"{state / COUNTER_FILE} holds {text[:40]!r}, not a number; restore it (the last "
            "accepted counter) or remove it to accept any order the CA signed",
            state="failed",
        )
    return int(text)


def _write_counter(state: Path, counter: int) -> None:
    atomic_write(state / COUNTER_FILE, f"{counter}\n".encode(), mode=0o600)


def _read_small(dir_fd: int, name: str) -> bytes:
    try:
        return read_plain(name, limit=MAX_SMALL, dir_fd=dir_fd)
    except NotPlain as exc:
        if exc.reason.endswith(f"more than {MAX_SMALL}"):
            size = exc.reason.split(" ", 1)[0]
            raise UpdateError(f"{name} is {size} bytes; an order is a few hundred") from None
        raise UpdateError(f"{name} in the request is {exc.reason}") from None


def _open_plain(dir_fd: int, name: str) -> int:
    """A regular file of the request, never through a symlink, never a FIFO or device."""
    try:
        return open_plain(name, dir_fd=dir_fd)
    except NotPlain as exc:
        raise UpdateError(f"{name} in the request is {exc.reason}") from None


def _copy_bundle(dir_fd: int, name: str, copy: str) -> str:
    src = _open_plain(dir_fd, name)
    digest = hashlib.sha256()
    try:
        dst = os.open(
            copy,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=dir_fd,
        )
        try:
            size = 0
            while chunk := os.read(src, _CHUNK):
                size += len(chunk)
                if size > MAX_BUNDLE:
                    raise UpdateError(f"{name} is bigger than {MAX_BUNDLE} bytes")
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(dst, view) :]
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    return digest.hexdigest()


def _write_status(spool_fd: int, result: ApplyResult) -> None:
    """status.json in the spool, atomically, world-readable and owned like the spool, so the
    agent can read and remove it; written through the spool's descriptor and never through
    a symlink the agent left there."""
    data = {
        "counter": result.counter,
        "version": result.version,
        "state": result.state,
        "message": result.message,
        "time": int(time.time()),
    }
    owner = None
    if os.geteuid() == 0:
        spool = os.fstat(spool_fd)
        owner = (spool.st_uid, spool.st_gid)
    try:
        atomic_write(
            STATUS,
            (json.dumps(data, sort_keys=True) + "\n").encode(),
            mode=0o644,
            dir_fd=spool_fd,
            owner=owner,
        )
    except (FileError, OSError) as exc:
        _say(f"cannot write {STATUS} in the spool ({exc}); the agent will not see it")
