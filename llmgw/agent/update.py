"""Signed self-updates on a node (DESIGN §5, §7): the order format, the agent's spooling of
a downloaded bundle, and the root helper that checks and applies it.

The control plane signs an order (canonical JSON: node_id, version, counter, sha256, url,
arch, expires) with the cluster CA's key. The agent, never root, downloads the bundle,
checks its SHA-256 and renames a finished directory to ``SPOOL/request``.
``llmgw-agent-update.path`` then starts ``llmgw agent update-apply`` as root, which moves
the request out of the agent's reach first, verifies everything against what only root can
write (the CA and node id saved at install time, the last accepted counter), and runs the
bundle's ``install-agent.sh upgrade``. Its verdict goes to ``SPOOL/status.json``, which the
agent reports to the control plane.

The helper treats everything in the spool as hostile: no path in it is followed through a
symlink, files are read through descriptors opened with ``O_NOFOLLOW`` and copied before
they are checked, and the bundle is unpacked only if every member is a plain file or
directory inside its one top folder.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import secrets
import shutil
import ssl
import stat
import subprocess
import sys
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from llmgw.errors import CertificateError, ConfigError, UpdateError
from llmgw.netaddr import validate_node_id
from llmgw.pki import control_plane_problem, fingerprint, load_cert

__all__ = [
    "ARCHES",
    "DEFAULT_INSTALLED_BINARY",
    "DEFAULT_SPOOL",
    "DEFAULT_STATE",
    "DEFAULT_TRUST",
    "FINAL_STATES",
    "REQUEST",
    "STATUS",
    "ApplyResult",
    "Spooler",
    "apply_request",
    "canonical_order",
    "check_order_fields",
    "install_trust",
    "machine_arch",
    "read_status",
    "verify_order",
    "version_key",
]

log = logging.getLogger("llmgw.agent.update")

DEFAULT_SPOOL = Path("/var/lib/llmgw-agent/update")
DEFAULT_TRUST = Path("/etc/llmgw/update")
DEFAULT_STATE = Path("/var/lib/llmgw-update")
DEFAULT_INSTALLED_BINARY = Path("/usr/local/lib/llmgw-agent/llmgw")
# Where the llmgw-agent .deb/.rpm puts the program: such a node is upgraded by its package
# manager, not by a bundle's installer.
PACKAGE_BINARY = Path("/usr/lib/llmgw/llmgw")

REQUEST = "request"
STATUS = "status.json"
ORDER_FILE = "order.json"
SIGNATURE_FILE = "order.sig"
BUNDLE_FILE = "bundle.tar.gz"
REQUEST_FILES = frozenset({ORDER_FILE, SIGNATURE_FILE, BUNDLE_FILE})
TRUST_CA = "ca.pem"
TRUST_NODE_ID = "node-id"
# The pin (sha256:<hex> of the CA's public key) the trusted CA was checked against: the
# operator's --ca-hash of the first install, rewritten only by a root-run install or rekey
# that passes a pin of its own.
TRUST_PIN = "ca-hash"
COUNTER_FILE = "counter"
HEALTH_ENV = "LLMGW_AGENT_HEALTH_TIMEOUT"
SETTLE_ENV = "LLMGW_AGENT_SETTLE_SECONDS"

ARCHES: dict[str, tuple[str, ...]] = {"x64": ("x86_64", "amd64"), "arm64": ("aarch64", "arm64")}
ORDER_KEYS = frozenset({"node_id", "version", "counter", "sha256", "url", "arch", "expires"})
FINAL_STATES = frozenset({"done", "failed", "refused", "rolled-back", "busy", "expired"})

_VERSION = re.compile(r"[0-9][0-9A-Za-z.+~-]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PIN = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_SMALL = 64 * 1024
_MAX_BUNDLE = 4 << 30
_MAX_UNPACKED = 8 << 30
_MAX_MEMBERS = 10_000
_CHUNK = 1 << 20


# -- the order ---------------------------------------------------------------------------------


def canonical_order(order: dict[str, Any]) -> bytes:
    """The exact bytes that are signed: sorted keys, no spaces, UTF-8."""
    return json.dumps(order, sort_keys=True, separators=(",", ":")).encode()


def version_key(version: str) -> tuple[tuple[int, int, str], ...]:
    """Versions compared part by part as numbers ("0.10.0" > "0.9.1"); a part with letters
    is a pre-release, below its release ("0.2.0rc1" < "0.2.0")."""
    parts = re.findall(r"\d+|[A-Za-z]+", version)
    key = [(2, int(p), "") if p.isdigit() else (0, 0, p.lower()) for p in parts]
    key.append((1, 0, ""))
    return tuple(key)


def machine_arch(machine: str | None = None) -> str | None:
    """The bundle architecture (x64, arm64) of ``uname -m``, or None."""
    name = (machine or platform.machine()).lower()
    return next((arch for arch, names in ARCHES.items() if name in names), None)


def check_order_fields(order: object) -> dict[str, Any]:
    """The order if it has exactly the fields of an update order with sane values;
    UpdateError naming the field otherwise."""
    if not isinstance(order, dict):
        raise UpdateError("the update order is not a JSON object; the control plane sent garbage")
    keys = set(order)
    if keys != ORDER_KEYS:
        missing, extra = sorted(ORDER_KEYS - keys), sorted(keys - ORDER_KEYS)
        raise UpdateError(
            f"the update order has the wrong fields (missing {missing or 'none'}, unknown "
            f"{extra or 'none'}); the control plane and this agent disagree on the format: "
            "upgrade them to the same release by hand"
        )

    def bad(field: str, why: str) -> UpdateError:
        return UpdateError(f"the update order's {field} {why}; it is refused")

    if not isinstance(order["node_id"], str):
        raise bad("node_id", "is not a string")
    try:
        validate_node_id(order["node_id"])
    except ConfigError as exc:
        raise bad("node_id", f"is not a node id ({exc})") from None
    if not isinstance(order["version"], str) or not _VERSION.fullmatch(order["version"]):
        raise bad("version", "is not a version such as 0.2.0")
    for field in ("counter", "expires"):
        value = order[field]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise bad(field, "is not a positive whole number")
    if not isinstance(order["sha256"], str) or not _SHA256.fullmatch(order["sha256"]):
        raise bad("sha256", "is not 64 lowercase hex characters")
    if not isinstance(order["url"], str) or not order["url"].startswith(("https://", "http://")):
        raise bad("url", "is not an http(s) URL")
    if order["arch"] not in ARCHES:
        raise bad("arch", f"is not one of {', '.join(ARCHES)}")
    return order


def parse_order(order_bytes: bytes) -> dict[str, Any]:
    """The fields of an order, unverified (the agent reads only where to download from)."""
    try:
        order = json.loads(order_bytes)
    except (ValueError, UnicodeDecodeError):
        raise UpdateError("the update order is not JSON; the control plane sent garbage") from None
    return check_order_fields(order)


def verify_order(ca_cert_pem: bytes, order_bytes: bytes, signature: bytes) -> dict[str, Any]:
    """The order, if ``signature`` is the cluster CA's ECDSA-SHA256 signature of exactly
    ``order_bytes`` (the canonical form) and its fields are sane; UpdateError otherwise.
    Expiry, node id and counter are the caller's to check."""
    try:
        ca = x509.load_pem_x509_certificate(ca_cert_pem)
    except ValueError as exc:
        raise UpdateError(
            f"the trusted CA certificate is unreadable ({exc}); reinstall the agent so that "
            "the installer writes it again",
            state="failed",
        ) from None
    public = ca.public_key()
    if not isinstance(public, ec.EllipticCurvePublicKey):
        raise UpdateError(
            "the trusted CA certificate has no EC key; it is not an llmgw cluster CA",
            state="failed",
        )
    try:
        public.verify(signature, order_bytes, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise UpdateError(
            "the update order's signature does not verify against the cluster CA: it was "
            "changed after signing or signed by another key; nothing was installed"
        ) from None
    order = parse_order(order_bytes)
    if canonical_order(order) != order_bytes:
        raise UpdateError("the update order is signed but not in canonical form; it is refused")
    return order


# -- the agent: download and spool ----------------------------------------------------------------


def read_status(spool: Path) -> dict[str, Any] | None:
    """What the root helper last wrote to ``spool/status.json``, or None."""
    try:
        fd = os.open(spool / STATUS, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = json.loads(os.read(fd, _MAX_SMALL))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or not isinstance(data.get("state"), str):
        return None
    return data


@dataclass
class Spooler:
    """The agent's side: turn an UpdateOrder into a spooled request and report its progress.

    ``report(op_id, counter, version, state, message)`` sends an UpdateStatus (or does
    nothing while there is no stream)."""

    node_id: str
    spool: Path
    report: Callable[[str, int, str, str, str], object]
    ssl_context: Callable[[], ssl.SSLContext]
    download_timeout: float = 1800.0
    poll_interval: float = 2.0
    # The cluster CA: an https server whose certificate it issued must be the control plane
    # (a node's certificate may name the same host), checked in the handshake. Others (an
    # operator's or ACME certificate) are left to the context's trust; the order's SHA-256
    # vouches for the bytes either way.
    cluster_ca: Path | None = None

    def __post_init__(self) -> None:
        self._op_ids: dict[int, str] = {}
        self._last_sent: tuple[Any, ...] | None = None

    async def handle(self, op_id: str, order_bytes: bytes, signature: bytes) -> None:
        """Spool one order; UpdateError (reported first) when it cannot be."""
        counter, version = 0, ""
        try:
            order = parse_order(order_bytes)
            counter, version = int(order["counter"]), str(order["version"])
            self._op_ids[counter] = op_id
            if order["node_id"] != self.node_id:
                raise UpdateError(
                    f"the update order is for node {order['node_id']}, and this is "
                    f"{self.node_id}; nothing was downloaded"
                )
            if _request_pending(self.spool):
                self.report(
                    op_id,
                    counter,
                    version,
                    "busy",
                    f"{self.spool / REQUEST} is still waiting for the update helper; is "
                    "llmgw-agent-update.path active? (systemctl status llmgw-agent-update.path)",
                )
                return
            self.report(op_id, counter, version, "downloading", order["url"])
            await self._spool(order, order_bytes, signature)
        except UpdateError as exc:
            self.report(op_id, counter, version, exc.state, exc.message)
            raise
        self.report(op_id, counter, version, "spooled", f"{self.spool / REQUEST}")

    async def _spool(self, order: dict[str, Any], order_bytes: bytes, signature: bytes) -> None:
        try:
            self.spool.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            raise UpdateError(
                f"cannot create the update spool {self.spool}: {exc.strerror}; the agent's "
                "state directory must be writable by its user",
                state="failed",
            ) from exc
        incoming = self.spool / f"incoming.{secrets.token_hex(8)}"
        incoming.mkdir(mode=0o755)
        try:
            digest = await self._download(order["url"], incoming / BUNDLE_FILE)
            if digest != order["sha256"]:
                raise UpdateError(
                    f"the bundle downloaded from {order['url']} has SHA-256 {digest}, not the "
                    f"{order['sha256']} the order names; the control plane's bundle changed "
                    "since it signed the order: order the update again",
                    state="failed",
                )
            await asyncio.to_thread(_commit_request, incoming, self.spool, order_bytes, signature)
        except OSError as exc:
            raise UpdateError(
                f"cannot write the update request in {self.spool}: {exc.strerror}; free space "
                "in the agent's state directory and order the update again",
                state="failed",
            ) from exc
        finally:
            shutil.rmtree(incoming, ignore_errors=True)

    async def _download(self, url: str, dest: Path) -> str:
        import aiohttp

        digest = hashlib.sha256()
        size = 0
        timeout = aiohttp.ClientTimeout(total=self.download_timeout, sock_connect=30)
        ssl_arg: ssl.SSLContext | bool = False
        if url.startswith("https:"):
            ssl_arg = self.ssl_context()
            if self.cluster_ca is not None:
                ssl_arg.sslobject_class = _control_plane_only(self.cluster_ca)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as session,
                session.get(url, ssl=ssl_arg) as resp,
            ):
                if resp.status != 200:
                    raise UpdateError(
                        f"downloading the bundle from {url} failed: HTTP {resp.status}; check "
                        "the control plane's bundle directory and order the update again",
                        state="failed",
                    )
                with open(dest, "xb") as out:
                    async for chunk in resp.content.iter_chunked(_CHUNK):
                        size += len(chunk)
                        if size > _MAX_BUNDLE:
                            raise UpdateError(
                                f"the bundle from {url} is bigger than {_MAX_BUNDLE} bytes; "
                                "it is not an agent bundle",
                                state="failed",
                            )
                        out.write(chunk)
                        digest.update(chunk)
                    out.flush()
                    os.fsync(out.fileno())
        except aiohttp.ClientConnectorCertificateError as exc:
            if not isinstance(exc.certificate_error, NotControlPlane):
                raise UpdateError(
                    f"downloading the bundle from {url} failed: {exc}; check that this node "
                    "reaches the control plane's HTTP port",
                    state="failed",
                ) from exc
            log.warning(
                "refused a bundle download from a server that is not the control plane",
                extra={"fields": {"url": url, "reason": str(exc.certificate_error)}},
            )
            raise UpdateError(
                f"downloading the bundle from {url} was refused before it was asked for: the "
                f"server is not the control plane ({exc.certificate_error}); check the control "
                "plane's advertised address and order the update again",
                state="failed",
            ) from exc
        except aiohttp.ClientError as exc:
            raise UpdateError(
                f"downloading the bundle from {url} failed: {exc or type(exc).__name__}; "
                "check that this node reaches the control plane's HTTP port",
                state="failed",
            ) from exc
        except TimeoutError as exc:
            raise UpdateError(
                f"downloading the bundle from {url} took longer than "
                f"{self.download_timeout:g} s; order the update again",
                state="failed",
            ) from exc
        return digest.hexdigest()

    def connected(self) -> None:
        """A new stream: report the helper's last verdict again (the control plane may have
        missed it while this agent was being replaced)."""
        self._last_sent = None
        self.poll()

    def poll(self) -> None:
        """Report ``status.json`` if it changed since the last report."""
        status = read_status(self.spool)
        if status is None:
            return
        try:
            counter = int(status.get("counter") or 0)
        except (TypeError, ValueError):
            counter = 0
        version = str(status.get("version") or "")
        key = (counter, status["state"], str(status.get("message") or ""), status.get("time"))
        if key == self._last_sent:
            return
        sent = self.report(self._op_ids.get(counter, ""), counter, version, status["state"], key[2])
        if sent is not False:
            self._last_sent = key

    async def run(self) -> None:
        """Watch ``status.json`` for the helper's progress until cancelled."""
        while True:
            await asyncio.sleep(self.poll_interval)
            self.poll()


class NotControlPlane(ssl.SSLCertVerificationError):
    """The TLS peer holds a certificate from the cluster CA that is not the control plane's."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem

    def __str__(self) -> str:
        return self.problem


def _control_plane_only(ca_path: Path) -> type[ssl.SSLObject]:
    """An SSLObject class that ends the handshake, before a byte of the request is sent, with a
    peer certified by the cluster CA but not as the control plane (ssl cannot check an EKU)."""

    class ControlPlaneOnly(ssl.SSLObject):
        def do_handshake(self) -> None:
            super().do_handshake()
            problem = _cluster_peer_problem(self.getpeercert(binary_form=True), ca_path)
            if problem is not None:
                raise NotControlPlane(problem)

    return ControlPlaneOnly


def _cluster_peer_problem(der: bytes | None, ca_path: Path) -> str | None:
    """Why an https peer is unacceptable: None for a certificate the cluster CA did not issue
    (the TLS context's trust judged it) or one that carries the control plane's identity."""
    if der is None:
        return "it presented no certificate"
    try:
        ca = load_cert(ca_path)
    except CertificateError as exc:
        return str(exc)
    try:
        cert = x509.load_der_x509_certificate(der)
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return None
    return control_plane_problem(cert)


def _request_pending(spool: Path) -> bool:
    return os.path.lexists(spool / REQUEST)


def _commit_request(incoming: Path, spool: Path, order_bytes: bytes, signature: bytes) -> None:
    """Order and signature next to the bundle, everything on disk, then one rename makes it
    the request the path unit sees."""
    for name, data in ((ORDER_FILE, order_bytes), (SIGNATURE_FILE, signature)):
        _write_synced(incoming / name, data)
    _fsync_path(incoming)
    if _request_pending(spool):
        raise UpdateError(
            f"another request appeared in {spool} while downloading; order the update again "
            "once it is applied",
            state="busy",
        )
    os.rename(incoming, spool / REQUEST)
    _fsync_path(spool)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the root helper --------------------------------------------------------------------------------


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


class _Refused(Exception):
    def __init__(self, message: str, state: str = "refused") -> None:
        super().__init__(message)
        self.message = message
        self.state = state


_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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
        spool_fd = os.open(spool, _OPEN_DIR)
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
                    _remove_entry(work_fd, name)
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
        work_fd = os.open(state / "work", _OPEN_DIR)
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
            req_fd = os.open(name, _OPEN_DIR, dir_fd=work_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _Refused(
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
                raise _Refused(
                    f"the request holds {sorted(names)}, not exactly {sorted(REQUEST_FILES)}"
                )
            order_bytes = _read_small(req_fd, ORDER_FILE)
            signature = _read_small(req_fd, SIGNATURE_FILE)
            with contextlib.suppress(UpdateError):
                unverified = parse_order(order_bytes)
                counter, version = int(unverified["counter"]), str(unverified["version"])
            order = _check_order(order_bytes, signature, trust, state, now, machine)
            # A copy the agent cannot change while we check and unpack it.
            digest = _copy_bundle(req_fd, BUNDLE_FILE, "verified.tar.gz")
            if digest != order["sha256"]:
                raise _Refused(
                    f"the bundle's SHA-256 is {digest}, not the {order['sha256']} the order names"
                )
            bundle = work / "verified.tar.gz"
            top, info = _check_bundle(bundle)
            if info.get("version") != version:
                raise _Refused(
                    f"the bundle is version {info.get('version') or '(none)'}, the order "
                    f"says {version}"
                )
            if info.get("architecture") != f"linux-{order['arch']}":
                raise _Refused(
                    f"the bundle is for {info.get('architecture') or '(none)'}, the order "
                    f"says linux-{order['arch']}"
                )
            installed = installed_version(installed_binary)
            if version_key(version) < version_key(installed):
                raise _Refused(
                    f"version {version} is older than the installed {installed}; a downgrade "
                    "is refused (reinstall by hand to go back)"
                )
            # Accepted: the counter is spent before anything else happens, so this order
            # cannot be replayed even if the upgrade fails halfway.
            _write_counter(state, counter)
            progress(
                ApplyResult("applying", f"upgrading {installed} -> {version}", counter, version)
            )
            _say(f"accepted order {counter}: {installed} -> {version}")
            unpacked = work / "unpacked"
            unpacked.mkdir(mode=0o700)
            _unpack(bundle, unpacked)
            code, tail = _run_installer(unpacked / top)
        finally:
            os.close(req_fd)
    except _Refused as exc:
        return ApplyResult(exc.state, exc.message, counter, version)
    except UpdateError as exc:
        return ApplyResult(exc.state, exc.message, counter, version)
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


def _check_order(
    order_bytes: bytes,
    signature: bytes,
    trust: Path,
    state: Path,
    now: Callable[[], float],
    machine: str | None,
) -> dict[str, Any]:
    try:
        ca_pem = (trust / TRUST_CA).read_bytes()
        own_id = (trust / TRUST_NODE_ID).read_text().strip()
    except OSError as exc:
        raise UpdateError(
            f"cannot read the trusted CA and node id in {trust}: {exc.strerror} "
            f"({exc.filename}); the installer writes them: reinstall the agent",
            state="failed",
        ) from exc
    order = verify_order(ca_pem, order_bytes, signature)
    if order["node_id"] != own_id:
        raise _Refused(f"the order is for node {order['node_id']}, and this is node {own_id}")
    if order["expires"] <= now():
        raise _Refused(
            f"the order expired at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(order['expires']))}; "
            "order the update again"
        )
    last = read_counter(state)
    if order["counter"] <= last:
        raise _Refused(
            f"the order's counter {order['counter']} is not above the last accepted one "
            f"({last}): a replayed or out-of-date order"
        )
    arch = machine_arch(machine)
    if arch is not None and order["arch"] != arch:
        raise _Refused(f"the order is for linux-{order['arch']}, and this machine is linux-{arch}")
    return order


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
    tmp = state / f".{COUNTER_FILE}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, f"{counter}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, state / COUNTER_FILE)
    _fsync_path(state)


def _read_small(dir_fd: int, name: str) -> bytes:
    fd = _open_plain(dir_fd, name)
    try:
        size = os.fstat(fd).st_size
        if size > _MAX_SMALL:
            raise _Refused(f"{name} is {size} bytes; an order is a few hundred")
        return os.read(fd, _MAX_SMALL)
    finally:
        os.close(fd)


def _open_plain(dir_fd: int, name: str) -> int:
    """A regular file of the request, never through a symlink, never a FIFO or device."""
    try:
        fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _Refused(f"{name} in the request is a symlink") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _Refused(f"{name} in the request is not a regular file")
    return fd


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
                if size > _MAX_BUNDLE:
                    raise _Refused(f"{name} is bigger than {_MAX_BUNDLE} bytes")
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


def _member_problem(member: tarfile.TarInfo, top: str | None) -> str | None:
    name = member.name
    parts = name.split("/")
    if name.startswith("/") or "\\" in name:
        return "an absolute path"
    if any(p in ("..", "") for p in parts[:-1]) or parts[-1] == "..":
        return "a '..' or empty path component"
    if not (member.isfile() or member.isdir()):
        kind = "a link" if member.issym() or member.islnk() else "not a file or directory"
        return kind
    if top is not None and parts[0] != top:
        return f"outside the top folder {top}/"
    return None


def _check_bundle(bundle: Path) -> tuple[str, dict[str, str]]:
    """The bundle's top folder and its BUILD-INFO; refused unless every member is a plain
    file or directory under one top folder and install-agent.sh, llmgw, BUILD-INFO exist."""
    try:
        with tarfile.open(bundle, "r:gz") as tar:
            members: list[tarfile.TarInfo] = []
            total = 0
            top: str | None = None
            for member in tar:
                if len(members) >= _MAX_MEMBERS:
                    raise _Refused(f"the bundle has more than {_MAX_MEMBERS} members")
                member_top = member.name.split("/")[0]
                top = top or member_top
                problem = _member_problem(member, top)
                if problem:
                    raise _Refused(f"the bundle's member {member.name[:200]!r} is {problem}")
                total += member.size
                if total > _MAX_UNPACKED:
                    raise _Refused(f"the bundle unpacks to more than {_MAX_UNPACKED} bytes")
                members.append(member)
            if top is None or not re.fullmatch(r"llmgw-agent-[0-9][0-9A-Za-z.+~-]*-linux-\w+", top):
                raise _Refused(
                    f"the bundle's top folder is {top!r}, not llmgw-agent-<version>-linux-<arch>"
                )
            files = {m.name: m for m in members if m.isfile()}
            for needed in ("install-agent.sh", "llmgw", "BUILD-INFO"):
                if f"{top}/{needed}" not in files:
                    raise _Refused(f"the bundle has no {top}/{needed}")
            info_file = tar.extractfile(files[f"{top}/BUILD-INFO"])
            assert info_file is not None
            info_text = info_file.read(_MAX_SMALL).decode("utf-8", "replace")
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise _Refused(f"the bundle is not a readable .tar.gz ({exc})") from None
    info = {}
    for line in info_text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info[key.strip()] = value.strip()
    return top, info


def _unpack(bundle: Path, dest: Path) -> None:
    """Unpack what :func:`_check_bundle` accepted: directories and regular files only, no
    owner, no special bits, every path checked again and every file created new (O_EXCL,
    O_NOFOLLOW) under ``dest``. Done by hand rather than with tarfile's extraction filters,
    which the frozen binary's CPython (3.11.2) does not have."""
    try:
        with tarfile.open(bundle, "r:gz") as tar:
            for member in tar:
                if _member_problem(member, None):
                    raise UpdateError(
                        f"the bundle's member {member.name[:200]!r} changed under us",
                        state="failed",
                    )
                target = dest.joinpath(*member.name.split("/"))
                mode = member.mode & 0o755
                if member.isdir():
                    target.mkdir(mode=0o755, parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
                source = tar.extractfile(member)
                if source is None:
                    raise UpdateError(
                        f"the bundle's member {member.name[:200]!r} has no data", state="failed"
                    )
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(target, flags, 0o600)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(source, out, 1 << 20)
                    os.fchmod(out.fileno(), mode)
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise UpdateError(f"unpacking the bundle failed ({exc})", state="failed") from None
    except OSError as exc:
        raise UpdateError(f"unpacking the bundle failed: {exc}", state="failed") from None


def installed_version(binary: Path) -> str:
    """The version the installed agent binary reports (``llmgw --version``)."""
    if not binary.exists() and PACKAGE_BINARY.exists():
        raise UpdateError(
            f"this node's agent came from the llmgw-agent package ({PACKAGE_BINARY}), not from "
            "a bundle: signed updates replace bundle installs only. Upgrade it with its "
            "package manager (apt-get install llmgw-agent, or dnf upgrade llmgw-agent)",
            state="refused",
        )
    try:
        # As root, with an environment of its own: nothing of the caller's (TMPDIR and the
        # like) chooses where a one-file build unpacks; its bootloader then takes a fresh
        # root-owned directory under /var/tmp or /tmp (packaging/pyinstaller-runtime-dir.patch).
        out = subprocess.run(
            [str(binary), "--version"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpdateError(
            f"cannot run the installed agent {binary} --version ({exc}); the installed version "
            "is unknown, so a downgrade cannot be ruled out. Reinstall the agent by hand",
            state="refused",
        ) from None
    match = re.search(r"llmgw\s+([0-9][0-9A-Za-z.+~-]*)", out.stdout)
    if out.returncode != 0 or not match:
        raise UpdateError(
            f"the installed agent {binary} --version said {out.stdout.strip()[:100]!r} "
            f"(exit {out.returncode}); the installed version is unknown, so a downgrade "
            "cannot be ruled out. Reinstall the agent by hand",
            state="refused",
        )
    return match.group(1)


def _run_installer(top: Path) -> tuple[int, list[str]]:
    """Run ``top/install-agent.sh upgrade``; its stdout goes to ours (the journal), its
    stderr too, and the last lines of stderr are kept for the status."""
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
    }
    for name in (HEALTH_ENV, SETTLE_ENV):
        if os.environ.get(name):
            env[name] = os.environ[name]
    tail: collections.deque[str] = collections.deque(maxlen=5)
    _say(f"running {top / 'install-agent.sh'} upgrade")
    proc = subprocess.Popen(
        ["/bin/sh", str(top / "install-agent.sh"), "upgrade"],
        cwd=top,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=sys.stdout.fileno() if _has_fileno(sys.stdout) else None,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode("utf-8", "replace").rstrip()
        print(line, file=sys.stderr, flush=True)
        if line.strip():
            tail.append(line.strip()[:300])
    return proc.wait(), list(tail)


def _has_fileno(stream: IO[str]) -> bool:
    try:
        stream.fileno()
    except (OSError, ValueError, AttributeError):
        return False
    return True


def _remove_entry(dir_fd: int, name: str) -> None:
    """Remove ``name`` under ``dir_fd`` whatever it is, never following a symlink in it."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


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
    tmp = f".status.{secrets.token_hex(6)}.tmp"
    try:
        fd = os.open(
            tmp,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
            dir_fd=spool_fd,
        )
        try:
            os.fchmod(fd, 0o644)
            if os.geteuid() == 0:
                owner = os.fstat(spool_fd)
                os.fchown(fd, owner.st_uid, owner.st_gid)
            os.write(fd, (json.dumps(data, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, STATUS, src_dir_fd=spool_fd, dst_dir_fd=spool_fd)
        os.fsync(spool_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=spool_fd)
        _say(f"cannot write {STATUS} in the spool: {exc.strerror}; the agent will not see it")


# -- the helper's trust ------------------------------------------------------------------------


def install_trust(ca_file: Path, trust: Path = DEFAULT_TRUST, pin: str | None = None) -> bool:
    """Make ``trust/ca.pem`` (what the root helper checks orders against) the CA in
    ``ca_file``, but only when that CA's public key hashes to the pin: ``pin`` (the
    operator's --ca-hash), else the one recorded in ``trust/ca-hash`` at the first install,
    else that of the ca.pem already trusted. With none of them nothing is written. True when
    ca.pem (or the recorded pin) changed, False when it was so already; UpdateError, the trust
    left as it was, when the CA does not match or cannot be read.

    The installer passes a root-owned copy that it had the agent user read from the agent's
    state directory (so a symlink planted there reaches only what the agent may read); here
    ``ca_file`` and everything under ``trust`` are opened without following a symlink.

    CA rotation (the node life-cycle issue) keeps to this rule: a new CA reaches the helper
    either by this root-run verb with the new CA's pin (an install or rekey with --ca-hash
    records it), or by an order signed by the CA trusted now that names the new CA's pin,
    which the helper would then pass here as ``pin``; never by the agent alone."""
    cert_pem = _read_trust_input(ca_file)
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise UpdateError(
            f"{ca_file} is not a PEM certificate ({exc}); the update helper keeps its trust. "
            "Run the install again with --ca-hash from 'llmgw ctl join-command'",
            state="refused",
        ) from None
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        is_ca = constraints.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        raise UpdateError(
            f"{ca_file} is not a CA certificate; the update helper keeps its trust",
            state="refused",
        )
    got = fingerprint(cert.public_key())
    try:
        trust_fd = os.open(trust, _OPEN_DIR)
    except OSError as exc:
        raise UpdateError(
            f"cannot open {trust} (a directory of root's, never a symlink): "
            f"{exc.strerror}; run the installer as root",
            state="failed",
        ) from None
    try:
        recorded = _read_trust_file(trust_fd, TRUST_PIN).decode("ascii", "replace").strip()
        trusted = _read_trust_file(trust_fd, TRUST_CA)
        wanted = pin.strip().lower() if pin else ""
        source = "the --ca-hash given"
        if not wanted and recorded:
            wanted, source = recorded, f"the pin recorded in {trust / TRUST_PIN}"
        if not wanted and trusted:
            try:
                wanted = fingerprint(x509.load_pem_x509_certificate(trusted).public_key())
            except ValueError:
                wanted = ""
            source = f"the CA trusted now ({trust / TRUST_CA})"
        if not wanted:
            raise UpdateError(
                f"no pin to check {ca_file} against: the update helper gets no trusted CA. "
                "Run the install again with --ca-hash from 'llmgw ctl join-command'",
                state="refused",
            )
        if not _PIN.fullmatch(wanted):
            raise UpdateError(
                f"the pin {wanted[:80]!r} ({source}) is not sha256:<64 hex digits>; give "
                "--ca-hash from 'llmgw ctl join-command'",
                state="refused",
            )
        if got != wanted:
            raise UpdateError(
                f"the CA in {ca_file} has the hash {got}, not {wanted} ({source}); the update "
                "helper keeps the CA it trusts. If the cluster CA really changed, rekey the "
                "node with the new --ca-hash ('llmgw ctl join-command --rekey NODE')",
                state="refused",
            )
        changed = False
        if trusted != cert_pem:
            _write_trust_file(trust_fd, TRUST_CA, cert_pem)
            changed = True
        if recorded != wanted:
            _write_trust_file(trust_fd, TRUST_PIN, (wanted + "\n").encode())
            changed = True
        return changed
    finally:
        os.close(trust_fd)


def _read_trust_input(path: Path) -> bytes:
    try:
        fd = os.open(path, _OPEN_FILE)
    except OSError as exc:
        why = "it is a symlink" if exc.errno == errno.ELOOP else exc.strerror
        raise UpdateError(
            f"cannot read the CA {path} ({why}); the update helper keeps its trust",
            state="refused",
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_SMALL:
            raise UpdateError(
                f"{path} is not a regular file of at most {_MAX_SMALL} bytes; the update "
                "helper keeps its trust",
                state="refused",
            )
        return os.read(fd, _MAX_SMALL)
    finally:
        os.close(fd)


def _read_trust_file(dir_fd: int, name: str) -> bytes:
    """A file of the trust directory; b"" when missing. Never through a symlink."""
    try:
        fd = os.open(name, _OPEN_FILE, dir_fd=dir_fd)
    except FileNotFoundError:
        return b""
    except OSError as exc:
        raise UpdateError(
            f"cannot read {name} in the update trust directory: "
            f"{'a symlink' if exc.errno == errno.ELOOP else exc.strerror}; remove it and run "
            "the installer again",
            state="failed",
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, _MAX_SMALL)
    finally:
        os.close(fd)


def _write_trust_file(dir_fd: int, name: str, data: bytes) -> None:
    """``name`` in the trust directory, atomically, 0644 and root's (readable by the helper
    and anyone; writable by root alone)."""
    tmp = f".{name}.{secrets.token_hex(6)}.new"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=dir_fd,
    )
    try:
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        os.fsync(dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
