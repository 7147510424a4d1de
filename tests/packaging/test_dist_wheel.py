"""The wheel `make dist` builds (dist/llmgw-V-py3-none-any.whl): the operator CLI where there
is no binary (macOS and other platforms; the node agent is Linux only), installed with
`pipx install dist/llmgw-V-py3-none-any.whl`.

It must be built from these very sources (every module byte for byte), carry the generated
protobuf code and the `llmgw` console script, and nothing of the tests. Then real pipx
installs it into a throwaway PIPX_HOME and the installed `llmgw` answers `--version` and
`ctl --help`. Its dependencies come from a wheelhouse that pip downloads once into the test
cache (LLMGW_TEST_CACHE, default /var/cache/llmgw-test; as `make venv` does, from the package
index), so pipx itself installs with --no-index.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.ci import unavailable

from .distcheck import DIST, ROOT, missing, version

pytestmark = pytest.mark.timeout(900)

CACHE = Path(os.environ.get("LLMGW_TEST_CACHE", "/var/cache/llmgw-test"))


def wheel_path() -> Path:
    wheel = DIST / f"llmgw-{version()}-py3-none-any.whl"
    if not wheel.is_file():
        missing(f"no {wheel.relative_to(ROOT)}; run 'make dist' (it builds the wheel)")
    return wheel


def source_files() -> dict[str, bytes]:
    return {
        str(path.relative_to(ROOT)): path.read_bytes()
        for path in sorted((ROOT / "llmgw").rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


@pytest.fixture(scope="module")
def wheel() -> Path:
    path = wheel_path()
    with zipfile.ZipFile(path) as zf:
        packed = {name: zf.read(name) for name in zf.namelist() if name.startswith("llmgw/")}
    sources = source_files()
    # Every module is in the wheel as it is here, and everything in it is from here (the
    # .proto, which nothing loads at run time, need not be).
    stale = sorted(
        name for name, data in sources.items() if name.endswith(".py") and packed.get(name) != data
    ) + sorted(name for name, data in packed.items() if sources.get(name) != data)
    if stale:
        missing(
            f"{path.relative_to(ROOT)} was built from other sources ({len(stale)} files differ, "
            f"e.g. {stale[0]}); run 'make dist' again"
        )
    return path


def test_the_wheel_holds_the_package_and_its_console_script(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = zf.read(info).decode()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "llmgw/proto/control_pb2.py" in names
    assert "llmgw/cli/ctl/__init__.py" in names
    # The console's data files (pyproject's package-data), every one of the source tree's.
    console = ROOT / "llmgw" / "server" / "console"
    for sub in ("templates", "static"):
        for path in (console / sub).iterdir():
            assert f"llmgw/server/console/{sub}/{path.name}" in names, path
    assert "Requires-Dist: Jinja2>=3.1" in metadata
    assert not [n for n in names if n.startswith(("tests/", "bench/", "packaging/"))]
    assert "llmgw = llmgw.cli:main" in entry_points
    assert f"Version: {version()}" in metadata
    assert "Requires-Python: >=3.11" in metadata


def wheelhouse(wheel: Path) -> Path:
    """The wheel's dependencies as wheels, downloaded once per set of requirements."""
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))
    requires = b"\n".join(
        line for line in metadata.splitlines() if line.startswith(b"Requires-Dist:")
    )
    key = hashlib.sha256(requires + sys.version.encode()).hexdigest()[:16]
    house = CACHE / "wheelhouse" / key
    if (house / ".complete").is_file():
        return house
    if not os.access(CACHE, os.W_OK) and not os.access(CACHE.parent, os.W_OK):
        unavailable(f"{CACHE} is not writable: the wheelhouse for the pipx test goes there")
    partial = house.with_name(key + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "-d", str(partial), str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if got.returncode != 0:
        unavailable(f"pip could not download the wheel's dependencies:\n{got.stderr[-2000:]}")
    (partial / ".complete").write_text("ok\n")
    shutil.rmtree(house, ignore_errors=True)
    partial.rename(house)
    return house


def test_pipx_installs_the_operator_cli(wheel: Path, tmp_path: Path) -> None:
    pipx = shutil.which("pipx")
    if pipx is None:
        unavailable("no pipx; install it (apt-get install -y pipx)")
    house = wheelhouse(wheel)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PIPX_HOME": str(tmp_path / "pipx"),
        "PIPX_BIN_DIR": str(tmp_path / "bin"),
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(house),
    }
    installed = subprocess.run(
        [pipx, "install", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    llmgw = tmp_path / "bin" / "llmgw"
    said = subprocess.run(
        [str(llmgw), "--version"], capture_output=True, text=True, timeout=60, check=True, env=env
    )
    assert said.stdout.strip() == f"llmgw {version()}"
    helped = subprocess.run(
        [str(llmgw), "ctl", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
        cwd=tmp_path,
    )
    assert "join-command" in helped.stdout
    # The installed package is the wheel's, not this checkout's.
    where = subprocess.run(
        [
            str(tmp_path / "pipx" / "venvs" / "llmgw" / "bin" / "python"),
            "-c",
            "import llmgw; print(llmgw.__file__)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
        cwd=tmp_path,
    )
    assert str(tmp_path / "pipx") in where.stdout


def test_make_wheel_from_a_fresh_venv_carries_the_licence(tmp_path: Path) -> None:
    """`make dist`'s wheel step on a fresh clone: its venv is a bare `python3 -m venv`, whose
    setuptools predates license-files (Debian 12's is 66); the step brings its own, and the
    wheel is built from a copy that holds LICENSE, as pyproject's license-files says."""
    venv = tmp_path / "venv"
    out = tmp_path / "out"
    made = subprocess.run(
        ["make", "--no-print-directory", "wheel", f"VENV={venv}", f"WHEEL_OUT={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    assert "license-files" not in made.stderr  # setuptools' "matched nothing" warning
    (wheel,) = out.glob("llmgw-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
        assert zf.read(licence) == (ROOT / "LICENSE").read_bytes()
        metadata = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-File: LICENSE" in metadata
    assert "License-Expression: Apache-2.0" in metadata
