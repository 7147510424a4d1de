"""What the root helper runs of a bundle and of the installed agent: ``llmgw --version`` with
an environment of the helper's own. (Checking and unpacking bundles is tested through the
whole helper, in test_apply.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.updater.bundle import installed_version


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
