"""The console's templates and static files reach every build: pyproject's package-data
(the wheel) and packaging/llmgw.spec's CONSOLE_DATA (the frozen binaries) name the
directories llmgw.server.console.render reads, and match every file there. Read from the
files themselves, no build (test_dist_wheel.py and test_dist_binaries.py check the builds)."""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from pathlib import Path

from llmgw.server.console.render import STATIC_DIR, TEMPLATE_DIR

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "packaging" / "llmgw.spec"
CONSOLE = ROOT / "llmgw" / "server" / "console"


def spec_console_dirs() -> list[str]:
    """The value of CONSOLE_DATA_DIRS in the spec (a literal list)."""
    tree = ast.parse(SPEC.read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "CONSOLE_DATA_DIRS"
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return value
    raise AssertionError("packaging/llmgw.spec has no CONSOLE_DATA_DIRS")


def test_the_spec_carries_the_directories_the_console_reads() -> None:
    dirs = spec_console_dirs()
    assert sorted(ROOT / d for d in dirs) == sorted([TEMPLATE_DIR, STATIC_DIR])
    text = SPEC.read_text()
    assert "datas=CONSOLE_DATA" in text  # handed to the Analysis


def test_package_data_matches_every_console_file() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["llmgw.server.console"]
    files = sorted(
        str(path.relative_to(CONSOLE))
        for sub in (TEMPLATE_DIR, STATIC_DIR)
        for path in sub.iterdir()
    )
    assert files, "the console has no templates or static files"
    unmatched = [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)]
    assert unmatched == [], f"pyproject's package-data misses {unmatched}"
    deps = config["project"]["dependencies"]
    assert any(d.startswith("Jinja2>=") for d in deps)
