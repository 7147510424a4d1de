"""A bundle-shaped tar.gz for tests: one top folder and the files in it, each with its mode
(the layout packaging/bundle.py builds and the root helper checks)."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


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
