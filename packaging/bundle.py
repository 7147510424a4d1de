"""Build the agent bundle ``llmgw-agent-<version>-linux-<arch>.tar.gz`` (DESIGN §7) from a
frozen one-file llmgw, and ``SHA256SUMS`` over what dist/ holds.

The bundle has one top folder, ``llmgw-agent-<version>-linux-<arch>/``, holding ``llmgw``,
the installer (everything in installer/: ``install-agent.sh`` and what it needs), the agent's
systemd units from systemd/ under ``systemd/``, ``agent.example.yaml``, ``README.md``,
``BUILD-INFO``, and what scripts/dist.sh generates for it (``--docs``): ``LICENSES`` (the
copyright file of everything the binary carries), the manual pages under ``man/man1/`` and
the shell completions under ``completions/``. It is reproducible: sorted names, every mtime SOURCE_DATE_EPOCH (the
commit's time by default), owner root:root, gzip without a name or a timestamp; two builds
from the same binary and sources are byte-identical.

usage: bundle.py build --binary PATH --arch x64|arm64 [--version V] [--revision R]
                       [--glibc-floor 2.31] [--out dist] [--allow-missing-installer]
                       [--docs DIR]
       bundle.py sums DIR
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from elfinfo import ElfError, glibc_floor, needs_of_path, version_key

__all__ = ["BundleError", "Member", "build_bundle", "bundle_name", "write_sums"]

ROOT = Path(__file__).resolve().parent.parent
ARCHES = ("x64", "arm64")
# The server's unit is not a node's business; the Docker proxy's is (install-agent.sh --docker).
AGENT_UNITS = ("llmgw-agent*", "llmgw-docker-proxy.service")
SUMS = "SHA256SUMS"


class BundleError(Exception):
    """The bundle cannot be built; the message says what to do."""


@dataclass(frozen=True)
class Member:
    """One file of the bundle: its path under the top folder, its bytes and its mode."""

    path: str
    data: bytes
    mode: int


def bundle_name(version: str, arch: str) -> str:
    return f"llmgw-agent-{version}-linux-{arch}"


def read_version(root: Path = ROOT) -> str:
    text = (root / "llmgw" / "__init__.py").read_text(encoding="utf-8")
    match = re.search(r'^__version__ = "([^"]+)"$', text, re.MULTILINE)
    if not match:
        raise BundleError(f'no __version__ = "X.Y.Z" line in {root / "llmgw" / "__init__.py"}')
    return match.group(1)


def source_date_epoch(root: Path = ROOT) -> int:
    """SOURCE_DATE_EPOCH, else the time of the last commit, else now (not reproducible)."""
    if os.environ.get("SOURCE_DATE_EPOCH", "").strip():
        return int(os.environ["SOURCE_DATE_EPOCH"])
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "log", "-1", "--format=%ct"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return int(out)
    except (OSError, subprocess.CalledProcessError, ValueError):
        return int(time.time())


def git_revision(root: Path = ROOT) -> str:
    try:
        revision = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return revision + ("-dirty" if dirty else "")


def _file_mode(path: Path) -> int:
    return 0o755 if os.access(path, os.X_OK) or path.suffix == ".sh" else 0o644


def collect_members(
    binary: Path,
    *,
    root: Path = ROOT,
    allow_missing_installer: bool = False,
    docs: Path | None = None,
) -> tuple[list[Member], list[str]]:
    """The bundle's files (BUILD-INFO aside) and the warnings about what was left out.
    ``docs`` is a directory of generated files that go in as they lie there: LICENSES,
    man/man1/*.1.gz, completions/*."""
    warnings: list[str] = []
    members = [Member("llmgw", binary.read_bytes(), 0o755)]

    installer_dir = root / "installer"
    installer = installer_dir / "install-agent.sh"
    if installer.is_file():
        for path in sorted(p for p in installer_dir.rglob("*") if p.is_file()):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(installer_dir).as_posix()
            members.append(Member(rel, path.read_bytes(), _file_mode(path)))
    elif allow_missing_installer:
        warnings.append(f"{installer} does not exist: the bundle has no installer")
    else:
        raise BundleError(
            f"{installer} does not exist, and a bundle without it cannot install an agent; "
            "write the installer first, or pass --allow-missing-installer (make dist "
            "ALLOW_MISSING_INSTALLER=1) for a bundle that only carries the binary"
        )

    units = sorted(
        {p for pattern in AGENT_UNITS for p in (root / "systemd").glob(pattern) if p.is_file()}
    )
    if not any(p.name == "llmgw-agent.service" for p in units):
        message = f"{root / 'systemd' / 'llmgw-agent.service'} does not exist"
        if not allow_missing_installer:
            raise BundleError(
                f"{message}; the installer needs it. Write it, or pass --allow-missing-installer"
            )
        warnings.append(f"{message}: the bundle has no agent unit")
    members += [Member(f"systemd/{p.name}", p.read_bytes(), 0o644) for p in units]

    if docs is not None:
        if not (docs / "LICENSES").is_file():
            raise BundleError(
                f"{docs} has no LICENSES (packaging/licenses.py copyright writes it); the "
                "bundle must say what it carries"
            )
        for path in sorted(p for p in docs.rglob("*") if p.is_file()):
            members.append(Member(path.relative_to(docs).as_posix(), path.read_bytes(), 0o644))
    for source, name in (
        (root / "packaging" / "agent.example.yaml", "agent.example.yaml"),
        (root / "README.md", "README.md"),
    ):
        if not source.is_file():
            raise BundleError(f"{source} does not exist; it belongs in every bundle")
        members.append(Member(name, source.read_bytes(), 0o644))
    return members, warnings


def build_info(
    *,
    version: str,
    revision: str,
    arch: str,
    epoch: int,
    floor: str | None,
    binary: bytes,
) -> bytes:
    built = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))
    lines = [
        "name: llmgw-agent",
        f"version: {version}",
        f"revision: {revision}",
        f"architecture: linux-{arch}",
        f"build_time: {built}",
        f"source_date_epoch: {epoch}",
        f"glibc_floor: {floor or 'none (static)'}",
        f"binary_sha256: {hashlib.sha256(binary).hexdigest()}",
    ]
    return ("\n".join(lines) + "\n").encode()


def write_tar_gz(out: Path, top: str, members: list[Member], epoch: int) -> None:
    """A reproducible .tar.gz of ``members`` under ``top/``, written atomically."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        dirs = {top} | {
            f"{top}/{'/'.join(m.path.split('/')[:i])}"
            for m in members
            for i in range(1, m.path.count("/") + 1)
        }
        entries: list[tuple[str, Member | None]] = [(d, None) for d in dirs]
        entries += [(f"{top}/{m.path}", m) for m in members]
        for name, member in sorted(entries, key=lambda e: e[0]):
            info = tarfile.TarInfo(name)
            info.mtime = epoch
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if member is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            else:
                info.size = len(member.data)
                info.mode = member.mode
                tar.addfile(info, io.BytesIO(member.data))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", delete=False) as tmp:
        try:
            with gzip.GzipFile(filename="", mode="wb", fileobj=tmp, mtime=0, compresslevel=9) as gz:
                gz.write(raw.getvalue())
            tmp.flush()
            os.fchmod(tmp.fileno(), 0o644)
            os.replace(tmp.name, out)
        except BaseException:
            os.unlink(tmp.name)
            raise


def build_bundle(
    binary: Path,
    *,
    arch: str,
    out_dir: Path,
    version: str | None = None,
    revision: str | None = None,
    epoch: int | None = None,
    glibc_max: str | None = None,
    allow_missing_installer: bool = False,
    root: Path = ROOT,
    docs: Path | None = None,
) -> tuple[Path, list[str]]:
    """Write the bundle for ``binary`` into ``out_dir``; returns its path and the warnings."""
    if arch not in ARCHES:
        raise BundleError(f"architecture {arch!r} is not one of {', '.join(ARCHES)}")
    if not binary.is_file():
        raise BundleError(f"{binary} does not exist; build it first (make dist)")
    version = version or read_version(root)
    revision = revision or git_revision(root)
    epoch = source_date_epoch(root) if epoch is None else epoch
    try:
        floor = glibc_floor(needs_of_path(binary))
    except ElfError as exc:
        raise BundleError(f"cannot read {binary}: {exc}") from exc
    if glibc_max and floor and version_key(floor) > version_key(glibc_max):
        raise BundleError(
            f"{binary} needs glibc {floor}, above the floor of {glibc_max}; it would not run "
            f"on the oldest supported system (python packaging/elfinfo.py {binary} lists which "
            "library needs what)"
        )
    members, warnings = collect_members(
        binary, root=root, allow_missing_installer=allow_missing_installer, docs=docs
    )
    members.append(
        Member(
            "BUILD-INFO",
            build_info(
                version=version,
                revision=revision,
                arch=arch,
                epoch=epoch,
                floor=floor,
                binary=members[0].data,
            ),
            0o644,
        )
    )
    top = bundle_name(version, arch)
    out = out_dir / f"{top}.tar.gz"
    write_tar_gz(out, top, members, epoch)
    return out, warnings


def write_sums(directory: Path, exclude: tuple[str, ...] = ()) -> Path:
    """``directory/SHA256SUMS`` (``sha256sum -c`` reads it) over every file below it but
    itself, dot files and what lies under a top-level entry matching an ``exclude`` glob,
    by sorted path; written atomically."""
    lines = []
    for path in sorted(directory.rglob("*"), key=lambda p: p.relative_to(directory).as_posix()):
        rel = path.relative_to(directory).as_posix()
        if not path.is_file() or path.is_symlink() or rel == SUMS:
            continue
        if any(part.startswith(".") for part in Path(rel).parts):
            continue
        if any(fnmatch.fnmatchcase(Path(rel).parts[0], pattern) for pattern in exclude):
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        lines.append(f"{digest}  {rel}\n")
    out = directory / SUMS
    tmp = directory / f".{SUMS}.tmp"
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, out)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bundle.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build one architecture's agent bundle")
    build.add_argument("--binary", type=Path, required=True, help="the one-file llmgw")
    build.add_argument("--arch", choices=ARCHES, required=True)
    build.add_argument("--version", help="default: llmgw/__init__.py's __version__")
    build.add_argument("--revision", help="default: git's, '-dirty' when the tree is")
    build.add_argument(
        "--glibc-floor",
        dest="glibc_max",
        metavar="VERSION",
        help="fail when the binary or a library in it needs a newer glibc than this",
    )
    build.add_argument("--out", type=Path, default=ROOT / "dist", help="default: dist/")
    build.add_argument(
        "--allow-missing-installer",
        action="store_true",
        help="build even without installer/install-agent.sh or the agent's unit",
    )
    build.add_argument(
        "--docs",
        type=Path,
        help="generated files to carry (LICENSES, man/, completions/), as they lie in DIR",
    )
    sums = sub.add_parser("sums", help="write DIR/SHA256SUMS")
    sums.add_argument("directory", type=Path)
    sums.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="leave out top-level entries matching GLOB (dist/v*/: builds of other versions)",
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "sums":
            print(write_sums(args.directory, tuple(args.exclude)))
            return 0
        out, warnings = build_bundle(
            args.binary,
            arch=args.arch,
            out_dir=args.out,
            version=args.version,
            revision=args.revision,
            glibc_max=args.glibc_max,
            allow_missing_installer=args.allow_missing_installer,
            docs=args.docs,
        )
    except (BundleError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
