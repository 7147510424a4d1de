"""What the dry run checks without a container: every shell script of the repository passes
shellcheck, and the shipped units verify and reach their exposure budget under systemd's own
tools (the installed units are checked again inside the containers)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.ci import require_tools
from tests.packaging.pkgcheck import ROOT, run, stand_in_units

AGENT_EXPOSURE = 3.0  # issue 7: the agent's unit at most this


def shell_scripts() -> list[Path]:
    """installer/, scripts/, the packages' maintainer scripts and .ci/run: every file whose
    first line names sh or bash."""
    found = []
    for folder in ("installer", "scripts", "packaging/deb", "packaging/rpm", ".ci"):
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file():
                continue
            with open(path, "rb") as f:
                first = f.readline()
            if re.match(rb"#!\s*/(usr/)?bin/(env\s+)?(ba)?sh\b", first):
                found.append(path)
    return found


def test_every_shell_script_is_shellcheck_clean() -> None:
    require_tools("shellcheck")
    scripts = shell_scripts()
    names = {p.relative_to(ROOT).as_posix() for p in scripts}
    assert {"installer/install-agent.sh", ".ci/run", "scripts/dist.sh"} <= names, names
    result = subprocess.run(
        ["shellcheck", "--format=gcc", *map(str, scripts)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and not result.stdout, result.stdout + result.stderr


def test_units_verify_and_exposure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_tools("systemd-analyze")
    copies = stand_in_units(tmp_path)
    result = run("systemd-analyze", "verify", *copies)
    assert result.stdout + result.stderr == ""
    exposures = {}
    for name in ("llmgw-agent.service", "llmgw-agent-update.service"):
        (copy,) = [c for c in copies if c.name == name]
        report = run("systemd-analyze", "security", "--offline=true", "--no-pager", copy).stdout
        match = re.search(rf"Overall exposure level for {re.escape(name)}: ([0-9.]+)", report)
        assert match, report
        exposures[name] = float(match.group(1))
        with capsys.disabled():
            print(f"\nsystemd-analyze security --offline=true {name}: exposure {exposures[name]}")
    assert exposures["llmgw-agent.service"] <= AGENT_EXPOSURE
