"""The NVML stand-in of tests/fixtures/nvml (it answers like nvidia-ml-py) and the machines
it plays; the ``fake_nvml`` fixture (conftest.py) makes ``import pynvml`` find it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

STANDIN = Path(__file__).resolve().parents[2] / "fixtures" / "nvml"

FakeNvml = Callable[..., None]


def eight_gpus() -> list[dict[str, Any]]:
    """An HGX H100 board (that of tests/fixtures/nvidia-smi/eight-h100): eight 80 GB GPUs,
    the last four with a model loaded and busy (94-97 %), the first four idle (0 %)."""
    return [
        {
            "name": "NVIDIA H100 80GB HBM3",
            "uuid": f"GPU-5f3c2b1a-8d4e-4f6a-9b2c-1d3e5f7a9b0{i + 1}",
            "memory_total_mib": 81559,
            "memory_used_mib": 74213 if i >= 4 else 0,
            "utilization_gpu": 90 + i if i >= 4 else 0,
        }
        for i in range(8)
    ]
