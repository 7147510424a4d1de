"""Fixtures shared by the unit tests of every package."""

from __future__ import annotations

import pytest

from tests.unit.clock import Clock


@pytest.fixture
def clock() -> Clock:
    """A :class:`~tests.unit.clock.Clock` at 1000.0 s, moved only by the test."""
    return Clock()
