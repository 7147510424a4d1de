"""Fixtures shared by the unit tests of every package: a clock the test moves, cluster CAs
(``authority``, and ``other_authority`` that signs what must not be trusted), and umask 000
for tests of the modes files are written with."""

from __future__ import annotations

import os
from collections.abc import Iterator

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


@pytest.fixture
def open_umask() -> Iterator[None]:
    """Umask 000 for the test, so the modes it checks are the ones the code sets itself."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)
