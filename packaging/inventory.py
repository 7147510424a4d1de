"""Name where every file of a frozen llmgw comes from: the inventory that the copyright file,
``LICENSES`` and the SBOMs are made of (packaging/licenses.py).

scripts/dist.sh runs this inside the build rootfs, with the build venv's Python, right after
PyInstaller: ``--toc`` is what packaging/llmgw.spec wrote of its analysis (each entry: the name
in the build, the file it was taken from, its kind). Every file is traced to its owner:

- a file of an installed Python distribution (by the distribution's RECORD): that
  distribution, with its version and licence metadata and licence files;
- a file of the build's CPython (``--python-prefix``): CPython;
- a file of the llmgw sources (``--source``): llmgw itself;
- any other file (the shared libraries CPython's and the wheels' extension modules link
  against, taken from the rootfs): the Debian package that holds it (``dpkg -S``), with its
  version and its copyright file;

and the PyInstaller bootloader, which is in every executable without an entry of its own.
A file with no owner fails the build: nothing goes into a binary unaccounted for.

usage: inventory.py --toc TOC.json --python-prefix /opt/python --source /build/src
                    --work /build/work --patch PATCH --out contents.json
"""

from __future__ import annotations

import argparse
import email.message
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

# What PyInstaller makes in its workpath from CPython's own modules (the one-folder build's
# zip of the standard library's core, which the bootloader imports first).
CPYTHON_MADE = frozenset({"base_library.zip"})
# Licence files of a distribution that are not named in its metadata (older wheels).
LICENSE_FILE = re.compile(r"^(LICEN[CS]E|COPYING|NOTICE|AUTHORS|COPYRIGHT)", re.IGNORECASE)


class InventoryError(Exception):
    """A file of the build cannot be traced to its owner; the message says which."""


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")


def _first(meta: email.message.Message, field: str) -> str:
    value = meta.get(field)
    return str(value).strip() if value else ""


def distribution_record(dist: importlib.metadata.Distribution) -> dict[str, Any]:
    """One Python distribution: name, version, licence metadata and licence texts."""
    meta = dist.metadata
    licence_files: dict[str, str] = {}
    for entry in dist.files or []:
        parts = Path(str(entry)).parts
        # dist-info/licenses/** (metadata 2.4) or licence-like files at the dist-info's top.
        in_dist_info = len(parts) >= 2 and parts[0].endswith(".dist-info")
        if not in_dist_info:
            continue
        if parts[1] == "licenses" or (len(parts) == 2 and LICENSE_FILE.match(parts[1])):
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                licence_files["/".join(parts[1:])] = _text(path)
    urls = [str(u) for u in meta.get_all("Project-URL") or []]
    return {
        "kind": "python",
        "name": _first(meta, "Name"),
        "version": _first(meta, "Version"),
        "summary": _first(meta, "Summary"),
        "license_expression": _first(meta, "License-Expression"),
        "license": _first(meta, "License"),
        "classifiers": [
            str(c) for c in meta.get_all("Classifier") or [] if str(c).startswith("License ::")
        ],
        "author": _first(meta, "Author") or _first(meta, "Author-email"),
        "homepage": _first(meta, "Home-page"),
        "project_urls": urls,
        "license_files": licence_files,
        "files": [],
    }


def path_owners(site: Path) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
    """Every file of the distributions installed in ``site``, resolved, -> its distribution's
    name; and each distribution's record."""
    owners: dict[str, str] = {}
    records: dict[str, dict[str, Any]] = {}
    for dist in importlib.metadata.distributions(path=[str(site)]):
        record = distribution_record(dist)
        name = record["name"]
        if not name or name in records:
            continue
        records[name] = record
        for entry in dist.files or []:
            owners[os.path.realpath(str(dist.locate_file(entry)))] = name
    return owners, records


def debian_owner(path: str) -> tuple[str, str] | None:
    """(package, version) of the Debian package holding ``path``, or None."""
    candidates = [path, os.path.realpath(path)]
    for candidate in list(candidates):
        # A merged /usr or not: dpkg knows a library under the name its package gave it.
        if candidate.startswith("/usr/lib/"):
            candidates.append(candidate[len("/usr") :])
        elif candidate.startswith("/lib/"):
            candidates.append("/usr" + candidate)
    for candidate in candidates:
        found = subprocess.run(["dpkg", "-S", candidate], capture_output=True, text=True)
        line = next((x for x in found.stdout.splitlines() if ": " in x), "")
        if found.returncode == 0 and line and not line.startswith("diversion "):
            # 'libssl1.1:amd64: /usr/lib/...' (or 'a, b: path' when several hold it)
            package = line.split(": ", 1)[0].split(",")[0].strip().split(":")[0]
            version = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", package],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            return package, version
    return None


def debian_record(package: str, version: str) -> dict[str, Any]:
    name = package.split(":")[0]
    copyright_file = Path("/usr/share/doc") / name / "copyright"
    return {
        "kind": "debian",
        "name": name,
        "version": version,
        "copyright_file": _text(copyright_file) if copyright_file.is_file() else "",
        "files": [],
    }


def cpython_record(prefix: Path) -> dict[str, Any]:
    licence = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    licence = licence / "LICENSE.txt"
    if not licence.is_file():
        raise InventoryError(f"{licence} does not exist: CPython's licence cannot be named")
    return {
        "kind": "cpython",
        "name": "CPython",
        "version": ".".join(str(p) for p in sys.version_info[:3]),
        "license_files": {"LICENSE.txt": _text(licence)},
        "files": [],
    }


def inventory(
    toc: dict[str, list[list[Any]]], *, python_prefix: Path, source: Path, work: Path, patch: Path
) -> dict[str, Any]:
    site = Path(sysconfig.get_paths()["purelib"])
    owners, records = path_owners(site)
    prefix = os.path.realpath(python_prefix)
    source_root = os.path.realpath(source)
    work_root = os.path.realpath(work)
    cpython = cpython_record(python_prefix)
    project: dict[str, Any] = {"kind": "project", "name": "llmgw", "files": []}
    debian: dict[str, dict[str, Any]] = {}
    used: dict[str, dict[str, Any]] = {}
    unowned: list[str] = []
    for kind, entries in toc.items():
        for name, src, typecode in entries:
            if not src or src == "-":
                continue  # a namespace package: no file of its own
            real = os.path.realpath(src)
            label = f"{name} ({typecode}, from {src})"
            if real in owners:
                record = used.setdefault(owners[real], records[owners[real]])
            elif real == prefix or real.startswith(prefix + os.sep):
                record = cpython
            elif real.startswith(source_root + os.sep):
                record = project
            elif real.startswith(work_root + os.sep) and os.path.basename(real) in CPYTHON_MADE:
                record = cpython  # made by PyInstaller of CPython's own modules
            elif (owner := debian_owner(src)) is not None:
                record = debian.setdefault(owner[0], debian_record(*owner))
            else:
                unowned.append(label)
                continue
            record["files"].append({"name": name, "kind": kind, "typecode": typecode})
    if unowned:
        raise InventoryError(
            "no distribution, CPython, Debian package or llmgw source file owns these files of "
            "the build: " + "; ".join(sorted(unowned)[:20])
        )
    pyinstaller = records.get("pyinstaller")
    if pyinstaller is None:
        raise InventoryError("PyInstaller is not installed in the build venv; its bootloader is")
    pyinstaller = used.setdefault("pyinstaller", pyinstaller)
    pyinstaller["files"].append({"name": "bootloader", "kind": "bootloader", "typecode": "EXE"})
    pyinstaller["patch"] = _text(patch)
    components = [cpython, *sorted(used.values(), key=lambda r: r["name"].lower())]
    components += sorted(debian.values(), key=lambda r: r["name"])
    return {"project": project, "components": components}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="inventory.py")
    parser.add_argument("--toc", type=Path, required=True)
    parser.add_argument("--python-prefix", type=Path, required=True)
    parser.add_argument("--source", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="PyInstaller's workpath")
    parser.add_argument("--patch", type=Path, required=True, help="the bootloader's patch")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        toc = json.loads(args.toc.read_text(encoding="utf-8"))
        result = inventory(
            toc,
            python_prefix=args.python_prefix,
            source=args.source,
            work=args.work,
            patch=args.patch,
        )
    except (InventoryError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
