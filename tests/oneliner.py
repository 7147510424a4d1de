"""Agent bundles and the join one-liner as the bundle tests run them (the server's unit tests
and the TLS integration test): a bundle whose installer records how it was called, and the
one-liner run by sh with uname, id and sudo answering as another machine would."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

# What the bundle's installer does in these tests: record its argv and the token it was given.
INSTALLER = """#!/bin/sh
set -eu
out=$LLMGW_TEST_RECORD
printf '%s\\n' "$@" >"$out.argv"
printf '%s' "${LLMGW_JOIN_TOKEN:-<unset>}" >"$out.token"
printf '%s' "$0" >"$out.path"
"""


def make_bundle(directory: Path, version: str, rid: str, installer: str = INSTALLER) -> Path:
    top = f"llmgw-agent-{version}-{rid}"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data, mode in (
            ("install-agent.sh", installer.encode(), 0o755),
            ("llmgw", f"binary {version} {rid}".encode(), 0o755),
        ):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    path = directory / f"{top}.tar.gz"
    path.write_bytes(raw.getvalue())
    return path


def fake_tools(bindir: Path, *, machine: str, uid: int) -> None:
    """uname and id answer as another machine would; sudo checks how it is called."""
    bindir.mkdir()
    (bindir / "uname").write_text(f"#!/bin/sh\necho {machine}\n")
    real_id = shutil.which("id")
    (bindir / "id").write_text(
        f'#!/bin/sh\nif [ "$1" = -u ]; then echo {uid}; else exec {real_id} "$@"; fi\n'
    )
    (bindir / "sudo").write_text(
        "#!/bin/sh\n"
        '[ "$1" = --preserve-env=LLMGW_JOIN_TOKEN ] || { echo "sudo called with $1" >&2; exit 9; }\n'
        'shift\nprintf "%s\\n" "$@" >"$LLMGW_TEST_RECORD.sudo"\nexec "$@"\n'
    )
    for tool in bindir.iterdir():
        tool.chmod(0o755)


def run_one_liner(
    tmp_path: Path, command: str, *, machine: str = "x86_64", uid: int = 0
) -> subprocess.CompletedProcess[str]:
    bindir = tmp_path / "bin"
    fake_tools(bindir, machine=machine, uid=uid)
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    env = {
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "TMPDIR": str(tmpdir),
        "LLMGW_TEST_RECORD": str(tmp_path / "record"),
        "HOME": str(tmp_path),
    }
    result = subprocess.run(
        ["sh", "-c", command], env=env, capture_output=True, text=True, timeout=60
    )
    assert list(tmpdir.iterdir()) == [], "the download directory was left behind"
    return result
