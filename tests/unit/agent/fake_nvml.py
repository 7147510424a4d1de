"""A fixture that makes ``import pynvml`` find the stand-in of tests/fixtures/nvml (which
answers like nvidia-ml-py) on a machine described here, whatever NVML this machine has."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

STANDIN = Path(__file__).resolve().parents[2] / "fixtures" / "nvml"

__all__ = ["FakeNvml", "eight_gpus", "fake_nvml"]

FakeNvml = Callable[..., None]


def eight_gpus() -> list[dict[str, Any]]:
    """An HGX H100 board (that of tests/fixtures/nvidia-smi/eight-h100): eight 80 GB GPUs,
    the last four with a model loaded."""
    return [
        {
            "name": "NVIDIA H100 80GB HBM3",
            "uuid": f"GPU-5f3c2b1a-8d4e-4f6a-9b2c-1d3e5f7a9b0{i + 1}",
            "memory_total_mib": 81559,
            "memory_used_mib": 74213 if i >= 4 else 0,
        }
        for i in range(8)
    ]


@pytest.fixture
def fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Call it with the machine (``gpus=[...]``, ``init_error=...``, ``driver_version=...``);
    the stand-in is then what discovery imports as ``pynvml``, until the test ends."""

    def install(**machine: Any) -> None:
        machine.setdefault("driver_version", "550.54.15")
        machine.setdefault("gpus", [])
        path = tmp_path / "nvml-machine.json"
        path.write_text(json.dumps(machine))
        monkeypatch.setenv("LLMGW_FAKE_NVML", str(path))
        monkeypatch.syspath_prepend(str(STANDIN))
        monkeypatch.delitem(sys.modules, "pynvml", raising=False)

    return install
