"""Fixtures shared by the agent's unit tests."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.unit.agent.fake_nvml import STANDIN, FakeNvml


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


@pytest.fixture
def empty_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH with nothing on it: no nvidia-smi, llama-server or vllm from this machine."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    return empty
