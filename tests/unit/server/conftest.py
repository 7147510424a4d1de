"""Fixtures shared by the server's unit tests: a store on a fresh database, and the scheduler's
rig on one (``cp``), a tokenizer.json (``tokenizer_json``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.scheduler_rig import SchedulerRig
from tests.unit.server.tokenizer_rig import word_level_tokenizer


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture
def store(db_path: Path, clock: Clock) -> Iterator[Store]:
    """A store on a fresh database at ``db_path``, its time the ``clock`` fixture's."""
    s = Store.open(db_path, clock=clock)
    yield s
    s.close()


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[SchedulerRig]:
    """The scheduler's rig on a fresh store (its own clock: the real time)."""
    store = Store.open(tmp_path / "state.db")
    yield SchedulerRig(store)
    store.close()


@pytest.fixture(scope="module")
def tokenizer_json() -> bytes:
    """The JSON of tokenizer_rig's word-level tokenizer, as a tokenizer.json file holds it."""
    return word_level_tokenizer().to_str().encode()
