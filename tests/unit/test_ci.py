"""tests/ci.py and tests/conftest.py: a test that cannot run skips locally and fails under
CI=true, whichever way it skips. Each case runs pytest on a small module of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODULE = textwrap.dedent(
    """
    import pytest

    from tests.ci import require_tools, unavailable


    def test_through_the_helper():
        unavailable("no frobnicator; apt-get install -y frobnicator")


    def test_missing_tool():
        require_tools("sh", "llmgw-no-such-tool", "readelf-llmgw-missing")


    @pytest.mark.skipif(True, reason="a skipif marker")
    def test_marker():
        pass


    def test_bare_skip():
        pytest.skip("a bare skip")


    @pytest.fixture
    def skipping_fixture():
        pytest.skip("a fixture skips")


    def test_fixture(skipping_fixture):
        pass


    def test_runs():
        assert True


    @pytest.mark.xfail(reason="known", strict=True)
    def test_xfail():
        assert False
    """
)

COLLECTION = textwrap.dedent(
    """
    import pytest

    pytest.importorskip("llmgw_no_such_module", reason="an optional module")


    def test_never_collected():
        pass
    """
)


def run_pytest(tmp_path: Path, source: str, ci: bool) -> subprocess.CompletedProcess[str]:
    module = tmp_path / "test_sample.py"
    module.write_text(source)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.conftest",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-q",
            "--rootdir",
            str(tmp_path),
            str(module),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )


def test_locally_every_kind_of_skip_skips(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, MODULE, ci=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed, 5 skipped, 1 xfailed" in result.stdout
    assert "no frobnicator; apt-get install -y frobnicator" in result.stdout
    # The tool that exists is not named; the two missing ones and their package are.
    assert (
        "missing llmgw-no-such-tool, readelf-llmgw-missing; apt-get install -y "
        "llmgw-no-such-tool readelf-llmgw-missing" in result.stdout
    )


def test_under_ci_every_kind_of_skip_fails(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, MODULE, ci=True)
    assert result.returncode == 1, result.stdout + result.stderr
    # A skip while setting up (a marker, a fixture) is an error; an expected failure is not
    # a skip and stays what it is.
    assert "3 failed, 1 passed, 1 xfailed, 2 errors" in result.stdout
    for name in ("through_the_helper", "missing_tool", "bare_skip"):
        assert f"FAILED test_sample.py::test_{name}" in result.stdout
    for name in ("marker", "fixture"):
        assert f"ERROR test_sample.py::test_{name}" in result.stdout
    assert "no frobnicator; apt-get install -y frobnicator (CI=true:" in result.stdout
    assert "skipped under CI=true: a skipif marker" in result.stdout
    assert "skipped under CI=true: a bare skip" in result.stdout
    assert "skipped under CI=true: a fixture skips" in result.stdout


@pytest.mark.parametrize("ci", [False, True])
def test_a_module_skipped_at_collection_fails_under_ci(tmp_path: Path, ci: bool) -> None:
    result = run_pytest(tmp_path, COLLECTION, ci=ci)
    if not ci:
        assert result.returncode == 5 or "1 skipped" in result.stdout, result.stdout
        return
    assert result.returncode != 0
    assert "skipped under CI=true: an optional module" in result.stdout + result.stderr


# The ways past tests.ci.unavailable: a test reaching for one is found here, locally too,
# before CI=true fails it (tests/unit/test_ci.py itself uses them on purpose).
BYPASSES = ("pytest.skip(", "pytest.importorskip(", "pytest.mark.skipif(", "pytest.mark.skip(")


def bypasses_in(tree: Path) -> list[str]:
    """``path:line: text`` of every line under ``tree`` that skips past the helper."""
    found = []
    for path in sorted(tree.rglob("*.py")):
        if path.name in ("ci.py", "test_ci.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(way in line for way in BYPASSES) and not line.lstrip().startswith("#"):
                found.append(f"{path.relative_to(tree)}:{number}: {line.strip()}")
    return found


def test_every_skip_goes_through_the_helper() -> None:
    found = bypasses_in(ROOT / "tests")
    assert not found, (
        "these skip past tests.ci.unavailable (which fails under CI=true instead of skipping); "
        "call unavailable(reason) or require_tools(...):\n" + "\n".join(found)
    )


def test_a_bypass_is_found(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_x.py").write_text(
        "import pytest\n\n\n@pytest.mark.skipif(True, reason='x')\ndef test_a():\n"
        "    pytest.skip('no')\n"
    )
    (tmp_path / "test_ok.py").write_text("# pytest.skip( in a comment is fine\n")
    assert bypasses_in(tmp_path) == [
        "sub/test_x.py:4: @pytest.mark.skipif(True, reason='x')",
        "sub/test_x.py:6: pytest.skip('no')",
    ]
