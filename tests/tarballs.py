"""A bundle-shaped tar.gz for tests: one top folder and the files in it, each with its mode
(the layout packaging/bundle.py builds and the root helper checks), and an agent bundle of this
machine's architecture whose installer only leaves a mark."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from llmgw.contracts.update_order import machine_arch


def write_bundle(path: Path, top: str, files: dict[str, tuple[bytes, int]]) -> Path:
    """``path``: a gzipped tar of the folder ``top`` holding ``files`` (name -> data, mode)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        info = tarfile.TarInfo(top)
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    path.write_bytes(raw.getvalue())
    return path


ARCH = machine_arch() or "x64"


def make_bundle(directory: Path, version: str, marker: Path) -> Path:
    """llmgw-agent-<version>-linux-<arch>.tar.gz with the layout of packaging/bundle.py; its
    installer writes ``marker``."""
    top = f"llmgw-agent-{version}-linux-{ARCH}"
    files = {
        "BUILD-INFO": (
            f"name: llmgw-agent\nversion: {version}\narchitecture: linux-{ARCH}\n".encode(),
            0o644,
        ),
        "install-agent.sh": (
            f'#!/bin/sh\nset -eu\necho "$*" > {marker}\necho "upgraded" >&2\n'.encode(),
            0o755,
        ),
        "llmgw": (f"#!/bin/sh\necho 'llmgw {version}'\n".encode(), 0o755),
        "README.md": (b"test bundle\n", 0o644),
    }
    directory.mkdir(parents=True, exist_ok=True)
    return write_bundle(directory / f"{top}.tar.gz", top, files)
