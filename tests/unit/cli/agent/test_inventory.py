"""``llmgw agent inventory`` and scripts/gpu-check.sh, on a machine that NVML's stand-in and a
stand-in nvidia-smi play (an HGX H100 board: tests/unit/agent/fake_nvml.py and the CSV of
tests/fixtures/nvidia-smi/eight-h100): what the agent would report, each source's view side
by side, and the check's comparison with nvidia-smi, agreeing and not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.unit.agent.fake_nvml import STANDIN, eight_gpus

ROOT = Path(__file__).resolve().parents[4]
FIXTURE = ROOT / "tests" / "fixtures" / "nvidia-smi" / "eight-h100"

# Answers every form the check and discovery ask, from the CSV of the eight-h100 fixture
# (nvidia-smi's own --query-gpu output); the MIG column as nvidia-smi writes it.
NVIDIA_SMI = r"""#!/usr/bin/env python3
import subprocess, sys
rows = [r.split(", ") for r in subprocess.run(
    [sys.argv[0] + ".csv", "--query-gpu=index,uuid,name,memory.total,memory.used,driver_version,utilization.gpu",
     "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout.splitlines() if r]
rows = rows[: int(__import__("os").environ.get("SMI_GPUS", len(rows)))]
args = sys.argv[1:]
if args[:1] and args[0].startswith("--query-gpu="):
    fields = args[0].split("=", 1)[1].split(",")
    names = ["index", "uuid", "name", "memory.total", "memory.used", "driver_version", "utilization.gpu"]
    for row in rows:
        values = dict(zip(names, row))
        values["mig.mode.current"] = "Disabled"
        print(", ".join(values[f] for f in fields))
elif args == ["-L"]:
    for row in rows:
        print(f"GPU {row[0]}: {row[2]} (UUID: {row[1]})")
elif args[:2] == ["mig", "-lgi"]:
    print("No MIG-enabled devices found."); sys.exit(6)
elif args == ["-q"]:
    print("==============NVSMI LOG==============")
    print(f"Driver Version                            : {rows[0][5]}")
    print("CUDA Version                              : 12.4")
    print(f"Attached GPUs                             : {len(rows)}")
else:
    print("| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4 |")
"""


def machine(tmp_path: Path, smi_gpus: int = 8) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(NVIDIA_SMI)
    smi.chmod(0o755)
    (bindir / "nvidia-smi.csv").write_text(FIXTURE.read_text())
    (bindir / "nvidia-smi.csv").chmod(0o755)
    nvml = tmp_path / "nvml.json"
    nvml.write_text(json.dumps({"driver_version": "550.54.15", "gpus": eight_gpus()}))
    llmgw = bindir / "llmgw"
    llmgw.write_text(f'#!/bin/sh\nexec {sys.executable} -m llmgw "$@"\n')
    llmgw.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bindir}:/usr/bin:/bin",
        "PYTHONPATH": f"{STANDIN}:{ROOT}",
        "LLMGW_FAKE_NVML": str(nvml),
        "LLMGW_AGENT_CONFIG": str(tmp_path / "no-agent.yaml"),
        "SMI_GPUS": str(smi_gpus),
    }


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def test_inventory_reports_the_gpus_and_each_sources_view(tmp_path: Path) -> None:
    env = machine(tmp_path)
    out = run([str(tmp_path / "bin" / "llmgw"), "agent", "inventory", "--sources", "--json"], env)
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    inv = report["inventory"]
    assert (inv["gpu_source"], len(inv["gpus"]), inv["driver_version"]) == ("nvml", 8, "550.54.15")
    assert report["config"] is None  # no agent.yaml: the defaults
    nvml, smi = report["sources"]["nvml"], report["sources"]["nvidia-smi"]
    assert [g["uuid"] for g in nvml["gpus"]] == [g["uuid"] for g in smi["gpus"]]
    assert [g["utilization_percent"] for g in smi["gpus"]][4:] == [94, 95, 96, 97]
    assert set(report["second_sample"]) == {"nvml", "nvidia-smi"}
    text = run([str(tmp_path / "bin" / "llmgw"), "agent", "inventory", "--sources"], env)
    assert text.returncode == 0, text.stderr
    assert "GPUs (nvml): 8, driver 550.54.15" in text.stdout
    assert "  nvidia-smi: 8 GPUs, driver 550.54.15" in text.stdout
    assert "utilisation 97%" in text.stdout


def test_the_gpu_check_agrees_with_nvidia_smi_and_says_when_it_does_not(tmp_path: Path) -> None:
    env = machine(tmp_path)
    script = ROOT / "scripts" / "gpu-check.sh"
    ok = run([str(script), str(tmp_path / "bin" / "llmgw")], env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for part in ("llmgw agent inventory --sources", "nvidia-smi -q", "CUDA Version", "MIG"):
        assert part in ok.stdout, part
    assert "llmgw and nvidia-smi agree: driver and 8 GPU(s)" in ok.stdout
    # nvidia-smi sees one GPU fewer than NVML (one fell off the bus between the two looks).
    differs = run([str(script), str(tmp_path / "bin" / "llmgw")], machine(tmp_path, smi_gpus=7))
    assert differs.returncode == 1, differs.stdout + differs.stderr
    assert "llmgw and nvidia-smi differ" in differs.stdout


def test_the_gpu_check_needs_nvidia_smi(tmp_path: Path) -> None:
    env = {**machine(tmp_path), "PATH": "/usr/bin:/bin"}
    out = run([str(ROOT / "scripts" / "gpu-check.sh"), str(tmp_path / "bin" / "llmgw")], env)
    assert out.returncode == 2
    assert "no nvidia-smi on PATH: this check is for a machine with NVIDIA GPUs" in out.stderr
