"""A cluster CA collected for export, and the file checks, for the tests of the sealed CA export
and of its import."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from llmgw import caexport, pki
from llmgw.caexport import CAExport

TOKEN = "llmgw-admin-t0ken"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns, mode(p))
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def exported(tmp: Path, *, rotate: bool = False, cluster: str = "c-1") -> tuple[Path, CAExport]:
    d = tmp / "source" / "pki"
    pki.ensure_server_identity(d, hosts=["cp-1.example"])
    if rotate:
        pki.rotate_ca(d, overlap=3600)
    ca = pki.load_ca(d)
    return d, caexport.collect(d, ca, cluster_id=cluster, admin_token=TOKEN)
