"""Fixtures shared by the unit tests of every package: a clock the test moves, and cluster CAs
(``authority``, and ``other_authority`` that signs what must not be trusted)."""

from __future__ import annotations

import pytest

from llmgw import pki
from llmgw.pki import Authority
from tests.unit.clock import Clock


@pytest.fixture
def clock() -> Clock:
    """A :class:`~tests.unit.clock.Clock` at 1000.0 s, moved only by the test."""
    return Clock()


@pytest.fixture(scope="module")
def authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca") / "pki")


@pytest.fixture(scope="module")
def other_authority(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return pki.init_ca(tmp_path_factory.mktemp("other-ca") / "pki")
