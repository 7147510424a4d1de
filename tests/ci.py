"""The one way a test says it cannot run here: :func:`unavailable`.

Locally it skips, saying why and what to do. Under ``CI=true`` it fails instead: ``.ci/run``
installs every tool and builds every image and binary the suite needs on a fresh Debian 12
machine, so there a test that cannot run is a broken CI step, never a pass. ``tests/conftest.py``
holds any other skip (a ``skipif`` marker, ``pytest.importorskip``, a bare ``pytest.skip``) to
the same rule: under ``CI=true`` nothing skips.
"""

from __future__ import annotations

import os
import shutil
from typing import NoReturn

import pytest

__all__ = ["CI", "CI_NOTE", "require_tools", "unavailable"]

CI = os.environ.get("CI", "").lower() == "true"
CI_NOTE = "CI=true: .ci/run provides what every test needs, so none may skip"

# Debian packages of the tools tests look for, for the message of require_tools.
TOOL_PACKAGES = {
    "apt-ftparchive": "apt-utils",
    "bwrap": "bubblewrap",
    "cloud-init": "cloud-init",
    "createrepo_c": "createrepo-c",
    "curl": "curl",
    "docker": "docker.io",
    "dpkg-deb": "dpkg",
    "gcc": "gcc",
    "gpg": "gnupg",
    "gpgv": "gpgv",
    "ip": "iproute2",
    "readelf": "binutils",
    "rpm": "rpm",
    "rpmsign": "rpm",
    "sha256sum": "coreutils",
    "shellcheck": "shellcheck",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "systemd-analyze": "systemd",
}


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason`` (what is missing and how to get it); under ``CI=true`` fail."""
    if CI:
        pytest.fail(f"{reason} ({CI_NOTE})")
    pytest.skip(reason)


def require_tools(*tools: str) -> None:
    """Every tool on PATH, else :func:`unavailable`, naming the Debian packages to install."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        names = " ".join(sorted({TOOL_PACKAGES.get(tool, tool) for tool in missing}))
        unavailable(f"missing {', '.join(missing)}; apt-get install -y {names}")
