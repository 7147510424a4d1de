"""Fixtures shared by the server's unit tests: a store on a fresh database."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.server.store import Store
from tests.unit.clock import Clock


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture
def store(db_path: Path, clock: Clock) -> Iterator[Store]:
    """A store on a fresh database at ``db_path``, its time the ``clock`` fixture's."""
    s = Store.open(db_path, clock=clock)
    yield s
    s.close()
