"""Fixtures shared by the unit tests of every package: a clock the test moves, cluster CAs
(``authority``, and ``other_authority`` that signs what must not be trusted), umask 000
for tests of the modes files are written with, ``each_loop`` for tests of what must work
on both event loops, and ``resolve_to_loopback`` (cp.example is 127.0.0.1)."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from llmgw import pki
from llmgw.pki import Authority
from tests.ci import unavailable
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


@pytest.fixture(params=["asyncio", "uvloop"])
def each_loop(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test once on asyncio's loop and once on uvloop's, which every daemon runs
    (llmgw/loop.py): ``asyncio.run`` in the test makes a loop of that kind. For the code on
    the request path (listener, bodies, http, the data plane), where the loops differ most
    (uvloop's transports are not asyncio's classes, nor weakly referenceable, and it reads a
    new connection at once)."""
    if request.param == "asyncio":
        yield "asyncio"
        return
    try:
        import uvloop
    except ImportError:
        unavailable("uvloop is not installed; pip install uvloop (a dependency on Linux)")
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        yield "uvloop"
    finally:
        asyncio.set_event_loop_policy(None)


@pytest.fixture
def resolve_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """cp.example resolves to 127.0.0.1 (where a stand-in listens); nothing else changes."""
    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: Any, **kwargs: Any) -> Any:
        return real("127.0.0.1" if host == "cp.example" else host, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
