"""Fixtures of the root helper's tests: a cluster CA the trust is pinned to, and another."""

from __future__ import annotations

import pytest

from llmgw import pki
from llmgw.pki import Authority


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca") / "pki")


@pytest.fixture(scope="module")
def other_authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return pki.init_ca(tmp_path_factory.mktemp("other-ca") / "pki")
