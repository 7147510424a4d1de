"""``llmgw ctl instances`` and ``instances retire ID``: the table (the leader, how long ago
each was seen, retired ones), a hint for a silent one, the retirement's words, --json, and a
refusal of the admin API as the user sees it. The admin API is a stand-in."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from llmgw.errors import APIError
from tests.unit.cli.ctl.fakeapi import FakeAPI


def _instance(instance_id: str, role: str, seen: float, **extra: Any) -> dict[str, Any]:
    return {
        "id": instance_id,
        "role": role,
        "stream": f"10.0.0.{instance_id[-1]}:7443",
        "http": f"http://10.0.0.{instance_id[-1]}:8080",
        "enroll": "",
        "version": "0.4.0",
        "started_at": 1.0,
        "seen_at": 2.0,  # the server's clock: not what ctl goes by
        "seen_s_ago": seen,
        "retired_at": None,
        "server_serial": "5e" + instance_id[-1],
        "client_serial": "c1" + instance_id[-1],
        **extra,
    }


def _list() -> list[dict[str, Any]]:
    """What GET /api/instances answers, cp4 retired an hour before the test."""
    return [
        _instance("cp1", "leader", 0.4),
        _instance("cp2", "standby", 1.2),
        _instance("cp3", "silent", 600),
        _instance("cp4", "retired", 7300, retired_at=time.time() - 3600, stream=""),
    ]


RETIRED = {**_instance("cp3", "retired", 650), "retired_serials": ["5e3", "c13"]}


class API(FakeAPI):
    """The stand-in admin API: what it was asked, and the list it answers."""

    def __init__(self) -> None:
        super().__init__(self.answer)
        self.listed: list[dict[str, Any]] = _list()

    def answer(self, method: str, path: str, body: Any) -> Any:
        if path == "/api/instances/cp1/retire":
            raise APIError(
                "instance cp1 is the leader; stop it first: systemctl stop llmgw-server on "
                "that machine (a standby takes the lease), then retire it through any other "
                "instance",
                status=409,
                code="conflict",
            )
        return RETIRED if method == "POST" else self.listed


@pytest.fixture
def api() -> API:
    return API()


def test_the_list_shows_each_instance_and_how_to_retire_a_silent_one(api: API) -> None:
    out = api.ctl("instances")
    assert out.exit_code == 0, out.output
    assert api.requests == ["GET /api/instances"]
    assert out.output == (
        "ID   ROLE     STREAM         HTTP                  VERSION  LAST SEEN  RETIRED\n"
        "cp1  leader   10.0.0.1:7443  http://10.0.0.1:8080  0.4.0    0s ago     -\n"
        "cp2  standby  10.0.0.2:7443  http://10.0.0.2:8080  0.4.0    1s ago     -\n"
        "cp3  silent   10.0.0.3:7443  http://10.0.0.3:8080  0.4.0    10m ago    -\n"
        "cp4  retired  -              http://10.0.0.4:8080  0.4.0    2h ago     60m ago\n"
        "cp3 was last seen 10m ago; once it is stopped for good: llmgw ctl instances retire cp3\n"
    )


def test_retire_says_what_the_agents_do_and_that_the_id_is_gone(api: API) -> None:
    out = api.ctl("instances", "retire", "cp3")
    assert out.exit_code == 0, out.output
    assert api.requests == ["POST /api/instances/cp3/retire"]
    assert out.output == (
        "retired instance cp3; the leader tells the agents, whose data planes refuse its "
        "certificates from now on (serials 5e3, c13)\n"
        "its id cannot be used again: a machine in its place needs another instance_id and new "
        "certificates\n"
    )


@pytest.mark.parametrize(
    "args",
    [
        ("instances", "retire", "cp3", "--json"),
        ("instances", "--json", "retire", "cp3"),
        ("--json", "instances", "retire", "cp3"),
    ],
)
def test_retire_json(api: API, args: tuple[str, ...]) -> None:
    out = api.ctl(*args)
    assert out.exit_code == 0, out.output
    assert json.loads(out.output) == RETIRED


def test_the_list_as_json(api: API) -> None:
    for args in (("instances", "--json"), ("--json", "instances")):
        out = api.ctl(*args)
        assert out.exit_code == 0, out.output
        assert json.loads(out.output) == api.listed


def test_a_refusal_is_reported_with_its_fix(api: API) -> None:
    out = api.ctl("instances", "retire", "cp1")
    assert out.exit_code == 1
    assert "instance cp1 is the leader; stop it first: systemctl stop llmgw-server" in out.output
    assert "retired instance" not in out.output
