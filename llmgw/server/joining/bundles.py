"""The agent bundles the control plane serves (DESIGN §7), and the one-line join command that
fetches one (DESIGN §4).

``GET /agent/bundles`` lists the newest bundle of each architecture found in the bundle
directory (server.yaml ``bundle_dir``, the operator's) and in the llmgw-agent-bundles
package's (``PACKAGED_BUNDLE_DIR``); ``GET /agent/bundles/linux-<arch>.tar.gz`` streams it.
Both are anonymous: a node checks what it downloads against the SHA-256 in its join command.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from llmgw.errors import NotFound
from llmgw.log import kv
from llmgw.versions import VERSION_PATTERN, version_key

__all__ = [
    "ADD_BUNDLES",
    "BUNDLES_PACKAGE",
    "RIDS",
    "Bundle",
    "BundleStore",
    "add_bundle_routes",
    "fetch_steps",
    "installer_step",
    "one_liner",
    "serve_bundles",
]

# Runtime identifiers, and the `uname -m` names of each.
RIDS: dict[str, tuple[str, ...]] = {
    "linux-x64": ("x86_64", "amd64"),
    "linux-arm64": ("aarch64", "arm64"),
}
_FILE = re.compile(
    rf"^llmgw-agent-(?P<version>{VERSION_PATTERN})-(?P<rid>linux-(?:x64|arm64))\.tar\.gz$"
)
_CHUNK = 1 << 20
_VERBS = ("install", "rekey", "package")

BUNDLES_PACKAGE = "llmgw-agent-bundles"
"""The package that installs the release's bundles into ``PACKAGED_BUNDLE_DIR`` (the
llmgw-server package recommends it)."""
ADD_BUNDLES = (
    f"install the {BUNDLES_PACKAGE} package (apt-get install {BUNDLES_PACKAGE}, or dnf), or "
    "copy llmgw-agent-*-linux-<arch>.tar.gz (make dist) into the bundle_dir of server.yaml"
)
"""How an operator gives a control plane bundles to serve: the end of every message that
says it has none."""

log = logging.getLogger("llmgw.server.bundles")


@dataclass(frozen=True)
class Bundle:
    """One bundle file: its architecture, version, where it is, its SHA-256 and size."""

    rid: str
    version: str
    path: Path
    sha256: str
    size: int

    @property
    def url_path(self) -> str:
        return f"/agent/bundles/{self.rid}.tar.gz"

    def as_json(self, base_url: str) -> dict[str, object]:
        return {
            "rid": self.rid,
            "url": base_url.rstrip("/") + self.url_path,
            "sha256": self.sha256,
            "size": self.size,
            "version": self.version,
        }


class BundleStore:
    """The bundles in the operator's directory and, after it, the package's (``packaged``).
    The newest version of each architecture wins; of one version in both, the operator's
    copy. A file's SHA-256 is computed once, and again only when its size, mtime or inode
    change (a new copy over the old one)."""

    def __init__(self, directory: Path, packaged: Path | None = None) -> None:
        self.directory = directory
        self.packaged = packaged
        self._hashes: dict[Path, tuple[tuple[int, int, int], str]] = {}

    def _candidates(self) -> dict[str, list[tuple[str, int, Path]]]:
        """rid -> (version, 1 for the operator's directory or 0 for the package's, path)."""
        found: dict[str, list[tuple[str, int, Path]]] = {}
        places = [(self.directory, 1)] + ([(self.packaged, 0)] if self.packaged else [])
        for directory, rank in places:
            try:
                entries = list(directory.iterdir())
            except (FileNotFoundError, NotADirectoryError):
                continue
            for path in entries:
                match = _FILE.match(path.name)
                if match and path.is_file():
                    found.setdefault(match["rid"], []).append((match["version"], rank, path))
        return found

    def _sha256(self, path: Path) -> tuple[str, int]:
        stat = path.stat()
        fingerprint = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
        cached = self._hashes.get(path)
        if cached is not None and cached[0] == fingerprint:
            return cached[1], stat.st_size
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        self._hashes[path] = (fingerprint, digest.hexdigest())
        return digest.hexdigest(), stat.st_size

    def scan(self) -> list[Bundle]:
        """The newest bundle of each architecture, by rid (blocking: it may hash files)."""
        bundles = []
        candidates = self._candidates()
        for rid in sorted(candidates):
            version, _rank, path = max(
                candidates[rid], key=lambda c: (version_key(c[0]), c[1], _mtime(c[2]))
            )
            try:
                sha256, size = self._sha256(path)
            except FileNotFoundError:
                continue  # removed while we looked
            bundles.append(Bundle(rid=rid, version=version, path=path, sha256=sha256, size=size))
        live = {b.path for b in bundles}
        for path in [p for p in self._hashes if p not in live]:
            del self._hashes[path]
        return bundles

    async def bundles(self) -> list[Bundle]:
        """:meth:`scan` off the event loop."""
        return await asyncio.to_thread(self.scan)

    def missing_message(self, rid: str) -> str:
        """What an anonymous client is told: not where the bundles are kept on this host."""
        arch = rid.removeprefix("linux-")
        make = "make dist" + (" ARCH=arm64" if arch == "arm64" else "")
        return (
            f"no {rid} bundle on this control plane; its operator installs the "
            f"{BUNDLES_PACKAGE} package, or copies llmgw-agent-*-{rid}.tar.gz ({make}) into "
            "the bundle_dir of server.yaml"
        )


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


def _base_url(request: web.Request) -> str:
    return f"{request.scheme}://{request.host}"


def add_bundle_routes(
    app: web.Application, directory: Path, packaged: Path | None = None
) -> BundleStore:
    """Mount ``GET /agent/bundles`` and ``GET /agent/bundles/{rid}.tar.gz`` (HEAD too) on
    ``app``, serving ``directory`` and then ``packaged``; returns the store (for
    :func:`one_liner`)."""
    store = BundleStore(directory, packaged)
    serve_bundles(app, store)
    return store


def serve_bundles(app: web.Application, store: BundleStore) -> None:
    """Mount the bundle routes on ``app`` for ``store`` (one store for every application
    the process serves in turn: its hashes are kept)."""

    async def listing(request: web.Request) -> web.Response:
        base = _base_url(request)
        return web.json_response([b.as_json(base) for b in await store.bundles()])

    async def download(request: web.Request) -> web.StreamResponse:
        rid = request.match_info["rid"]
        if rid not in RIDS:
            return _error(
                404,
                f"no such bundle {rid}.tar.gz; the control plane serves "
                f"{', '.join(f'{r}.tar.gz' for r in RIDS)}",
                "not_found",
            )
        bundle = next((b for b in await store.bundles() if b.rid == rid), None)
        if bundle is None:
            # The directory goes to the log, for the operator, never to the client.
            log.warning(
                "a bundle was asked for but there is none",
                extra=kv(
                    rid=rid,
                    bundle_dir=str(store.directory),
                    packaged=str(store.packaged or ""),
                    peer=request.remote or "",
                ),
            )
            return _error(404, store.missing_message(rid), "not_found")
        return web.FileResponse(
            bundle.path,
            chunk_size=256 * 1024,
            headers={
                "Content-Type": "application/gzip",
                "Content-Disposition": f'attachment; filename="{bundle.path.name}"',
                "X-Llmgw-Bundle-Version": bundle.version,
                "X-Llmgw-Bundle-Sha256": bundle.sha256,
                "Cache-Control": "no-cache",
            },
        )

    app.router.add_get("/agent/bundles", listing)
    app.router.add_get("/agent/bundles/{rid}.tar.gz", download)


def one_liner(
    base_url: str,
    bundles: Sequence[Bundle],
    *,
    node_id: str,
    enroll_url: str,
    ca_hash: str,
    token: str | None = None,
    verify_tls: bool = True,
    verb: str = "install",
    extra_args: Sequence[str] = (),
) -> str:
    """The command an operator pastes on a node (DESIGN §4): pick the bundle for
    ``uname -m``, download it from ``base_url``, check it against the SHA-256 embedded here
    (one per architecture), unpack it and run its ``install-agent.sh VERB`` (``install``;
    ``rekey`` for a node that is joined already; ``package``, which installs the signed
    package from ``--repo-url`` instead of the bundle's binary) with ``--node-id``,
    ``--enroll-url``, ``--ca-hash`` and then ``extra_args`` (``--repo-url``/``--repo-key``,
    ``--node-uid``, node facts), each quoted.

    The join token reaches the installer only through the environment, never an argv that
    ``ps`` shows: the command exports ``LLMGW_JOIN_TOKEN`` in a subshell (a builtin, no
    process) and runs ``sudo --preserve-env=LLMGW_JOIN_TOKEN`` (sudo >= 1.8.21), or no sudo
    when already root; ``sudo VAR=value cmd`` would put the token in sudo's own argv. Without
    ``token`` the command sets nothing and the installer asks for it. Everything runs in a
    subshell, so a failed step leaves the operator's shell, and its variables, as they were;
    the download goes to a temporary directory, removed at the end. The installer is run
    with ``sh``, not executed, so a noexec /tmp does not stop it. NotFound when there is no
    bundle at all.

    ``verify_tls=False`` (an https ``base_url`` whose certificate is from the cluster CA,
    which the node does not trust yet) downloads without checking the certificate: the
    bundle's integrity never came from TLS but from the SHA-256 in the command."""
    if verb not in _VERBS:
        raise ValueError(f"the one-liner runs install-agent.sh {' or '.join(_VERBS)}, not {verb!r}")
    steps = [
        "set -eu",
        *([f"export LLMGW_JOIN_TOKEN={shlex.quote(token)}"] if token else []),
        *fetch_steps(base_url, bundles, verify_tls=verify_tls),
        's=""; [ "$(id -u)" -eq 0 ] || s="sudo --preserve-env=LLMGW_JOIN_TOKEN"',
        "$s " + installer_step(verb, node_id, enroll_url, ca_hash, extra_args),
    ]
    return "(" + "; ".join(steps) + ")"


def installer_step(
    verb: str, node_id: str, enroll_url: str, ca_hash: str, extra_args: Sequence[str]
) -> str:
    """The unpacked bundle's ``install-agent.sh VERB`` with its options, each quoted (after
    :func:`fetch_steps`, in its directory)."""
    return f'sh ./llmgw-agent-*-"$r"/install-agent.sh {verb} ' + shlex.join(
        ["--node-id", node_id, "--enroll-url", enroll_url, "--ca-hash", ca_hash, *extra_args]
    )


def fetch_steps(base_url: str, bundles: Sequence[Bundle], *, verify_tls: bool) -> list[str]:
    """The shell steps that pick the bundle for ``uname -m``, download it from
    ``base_url`` into a temporary directory (removed at exit, by a trap of its own), check it
    against the SHA-256 embedded here and unpack it there: the one-liner's and the cloud-init
    user-data's (:mod:`llmgw.server.joining.cloudinit`). NotFound when there is no bundle at all."""
    if not bundles:
        raise NotFound(f"the control plane has no agent bundle to join nodes with; {ADD_BUNDLES}")
    q = shlex.quote
    cases = []
    for bundle in sorted(bundles, key=lambda b: b.rid):
        names = "|".join(RIDS[bundle.rid])
        cases.append(f"{names}) r={bundle.rid} h={bundle.sha256};;")
    known = ", ".join(sorted(b.rid for b in bundles))
    url = q(base_url.rstrip("/") + "/agent/bundles/") + '"$r.tar.gz"'
    return [
        f'case "$(uname -m)" in {" ".join(cases)} '
        f'*) echo "llmgw: no agent bundle for $(uname -m) (this control plane has {known})" >&2; '
        "exit 1;; esac",
        'd=$(mktemp -d); trap \'rm -rf "$d"\' EXIT; cd "$d"',
        "if command -v curl >/dev/null; then curl -fsSL"
        + ("" if verify_tls else " --insecure")
        + " -o agent.tar.gz "
        + url
        + "; else wget -q"
        + ("" if verify_tls else " --no-check-certificate")
        + " -O agent.tar.gz "
        + url
        + "; fi",
        'echo "$h  agent.tar.gz" | sha256sum -c -',
        "tar -xzf agent.tar.gz",
    ]
