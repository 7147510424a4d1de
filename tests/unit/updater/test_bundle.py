"""What the root helper does with a bundle: its checks and unpack (through llmgw.fsutil, in
the helper's words), and ``llmgw --version`` of the installed agent with an environment of
the helper's own. (Hostile bundles are refused through the whole helper, in test_apply.py.)"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from llmgw.errors import UpdateError
from llmgw.updater.bundle import check_bundle, installed_version, unpack
from tests.tarballs import write_bundle

TOP = "llmgw-agent-0.2.0-linux-x64"


def _tar_gz(path: Path, files: dict[str, tuple[bytes, int]], top: str = TOP) -> Path:
    return write_bundle(path, top, files)


def _good(**extra: tuple[bytes, int]) -> dict[str, tuple[bytes, int]]:
    return {
        "BUILD-INFO": (b"name: llmgw-agent\nversion: 0.2.0\narchitecture: linux-x64\n", 0o644),
        "install-agent.sh": (b"#!/bin/sh\n", 0o4777),
        "llmgw": (b"#!/bin/sh\necho llmgw 0.2.0\n", 0o755),
        **extra,
    }


def test_a_bundle_is_checked_then_unpacked_without_dangerous_modes(tmp_path: Path) -> None:
    bundle = _tar_gz(tmp_path / "b.tar.gz", _good())
    top, info = check_bundle(bundle)
    assert top == TOP
    assert (info["version"], info["architecture"]) == ("0.2.0", "linux-x64")
    dest = tmp_path / "unpacked"
    dest.mkdir(mode=0o700)
    unpack(bundle, dest)
    installer = dest / TOP / "install-agent.sh"
    assert installer.read_bytes() == b"#!/bin/sh\n"
    mode = stat.S_IMODE(installer.stat().st_mode)
    assert mode == 0o755, oct(mode)  # no set-id, no group or world write


def test_a_bundle_with_another_top_folder_is_refused(tmp_path: Path) -> None:
    bundle = _tar_gz(tmp_path / "b.tar.gz", _good(), top="evil-0.2.0")
    with pytest.raises(UpdateError, match=r"top folder is 'evil-0\.2\.0', not llmgw-agent-"):
        check_bundle(bundle)


def test_a_bundle_naming_a_file_twice_is_refused(tmp_path: Path) -> None:
    # The check would read the first BUILD-INFO while the unpack kept the second: the old
    # helper's unpack refused a second member at the same place, and so does the check now.
    second = (b"version: 9.9.9\narchitecture: linux-x64\n", 0o644)
    bundle = _tar_gz(tmp_path / "b.tar.gz", _good(**{"./BUILD-INFO": second}))
    with pytest.raises(UpdateError, match=r"member '.*/\./BUILD-INFO' is in the archive twice"):
        check_bundle(bundle)


def test_too_many_members_are_refused(tmp_path: Path) -> None:
    files = _good(**{f"f{i}": (b"", 0o644) for i in range(10_000)})
    bundle = _tar_gz(tmp_path / "b.tar.gz", files)
    with pytest.raises(UpdateError, match="the bundle has more than 10000 members") as err:
        check_bundle(bundle)
    assert err.value.state == "refused"


def test_installed_version_runs_the_binary_without_the_callers_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever the helper's caller had (a TMPDIR into the agent's folders, a runtime dir,
    # a terminal), the installed binary, run as root, gets none of it.
    monkeypatch.setenv("TMPDIR", "/var/lib/llmgw-agent-tmp")
    monkeypatch.setenv("LLMGW_RUNTIME_DIR", "/var/lib/llmgw-agent")
    binary = tmp_path / "llmgw"
    binary.write_text(
        "#!/bin/sh\n"
        '[ -z "${TMPDIR:-}${LLMGW_RUNTIME_DIR:-}${HOME:-}" ] || { echo "env: $(env)"; exit 3; }\n'
        "[ -t 0 ] && exit 4\n"
        "echo 'llmgw 0.1.7'\n"
    )
    binary.chmod(0o755)
    assert installed_version(binary) == "0.1.7"
