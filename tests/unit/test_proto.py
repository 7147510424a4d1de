"""The checked-in protobuf code is what ``make proto`` generates from control.proto."""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import unavailable

try:
    import grpc_tools  # noqa: F401
except ImportError:
    unavailable("no grpc_tools; it is in the 'test' extra: pip install -e '.[test]'")

REPO = Path(__file__).resolve().parents[2]
PROTO = "llmgw/proto/control.proto"
GENERATED = ("control_pb2.py", "control_pb2_grpc.py", "control_pb2.pyi")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("proto")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            f"--pyi_out={out}",
            PROTO,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"protoc failed:\n{result.stderr}"
    return out / "llmgw" / "proto"


@pytest.mark.parametrize("name", GENERATED)
def test_generated_code_is_up_to_date(regenerated: Path, name: str) -> None:
    committed = REPO / "llmgw" / "proto" / name
    fresh = regenerated / name
    assert fresh.exists(), f"protoc did not generate {name}"
    assert committed.exists(), (
        f"llmgw/proto/{name} is missing; run 'make proto' and commit the result"
    )
    old, new = committed.read_bytes(), fresh.read_bytes()
    if old != new:
        diff = "".join(
            difflib.unified_diff(
                old.decode(errors="replace").splitlines(keepends=True),
                new.decode(errors="replace").splitlines(keepends=True),
                f"committed/{name}",
                f"regenerated/{name}",
                n=1,
            )
        )
        pytest.fail(
            f"llmgw/proto/{name} differs from what {PROTO} generates; "
            f"run 'make proto' and commit the result\n{diff[:4000]}"
        )
