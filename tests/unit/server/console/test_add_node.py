"""The console's Add node page (llmgw.server.console.joining): the form mints a join token
through the admin API's own function, the answer to the POST shows the command (and, with
bundles, the one-liner) once and is never cached; the node's enrolment is followed live
(waiting, pending with its fingerprint, approved and online). Refusals (a bad TTL, a fact
that does not parse, an installer fact without bundles, a viewer, no CSRF token) mint
nothing and keep what was typed."""

from __future__ import annotations

import html
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from llmgw import pki
from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.fleet_rig import FINGERPRINT, FleetRig
from tests.unit.server.console.rig import HOSTILE, VIEWER_PW, Browser, box


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> pki.Authority:
    return pki.init_ca(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path, ca: pki.Authority) -> FleetRig:
    return FleetRig(store, clock, tmp_path, ca)


def problem(page: str) -> str:
    found = re.search(r'<p class="flash flash-error" role="alert" id="problem">([^<]*)</p>', page)
    return "" if found is None else html.unescape(found.group(1))


def field(page: str, name: str) -> str:
    found = re.search(rf'<input id="[^"]*" name="{name}"[^>]*value="([^"]*)"', page)
    assert found is not None, f"no field {name}"
    return html.unescape(found.group(1))


async def add(b: Browser, **fields: str) -> tuple[int, str, Any]:
    return await b.post("/ui/add-node", {"csrf": b.csrf, **fields})


def test_the_join_command_is_shown_once_in_the_posts_own_answer(
    rig: FleetRig, store: Store
) -> None:
    async def scenario(b: Browser) -> tuple[Any, ...]:
        await b.login()
        status, page, resp = await add(b, node="gpu-7", ttl="30m")
        _, again, _ = await b.get("/ui/add-node?node=gpu-7")
        _, part, _ = await b.get("/ui/add-node?node=gpu-7&fragment=enrol")
        return status, page, resp.headers, again, part

    status, page, headers, again, part = rig.run(scenario)
    assert status == 201 and headers["Cache-Control"] == "no-store"
    command = box(page, "join-command")
    assert command is not None
    words = shlex.split(command)
    secret = words[0].removeprefix("LLMGW_JOIN_TOKEN=")
    assert words[1:5] == ["llmgw", "agent", "join", "--node-id"] and words[5] == "gpu-7"
    assert words[words.index("--ca-hash") + 1] == rig.ca.ca_hash()
    assert words[words.index("--enroll-url") + 1] == "https://cp.example.net:8443"
    assert box(page, "one-liner") is None and 'id="no-bundles"' in page
    assert 'id="shown-once"' in page and 'data-copy="join-command-text"' in page
    # The token is the store's, spent by nobody yet, valid for 30 minutes, made by admin.
    [token] = store.list_join_tokens()
    assert token.node_id == "gpu-7" and token.expires_at - token.created_at == 1800
    assert secret.startswith(token.prefix)
    [event] = [e for e in store.list_events() if e.kind == "join_token_created"]
    assert (event.subject, event.actor) == ("gpu-7", "admin")
    # Following the enrolment shows no secret again, on the page or in its live part.
    for later in (again, part):
        assert secret not in later and "LLMGW_JOIN_TOKEN" not in later
        assert 'data-stage="waiting"' in later
    assert 'data-live-url="/ui/add-node?node=gpu-7&amp;fragment=enrol"' in page


def test_with_bundles_the_one_liner_is_shown_too(rig: FleetRig) -> None:
    bundle = rig.bundle("0.9.1")

    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await add(b, node="gpu-8", ttl="1h")
        return page

    page = rig.run(scenario)
    liner = box(page, "one-liner")
    command = box(page, "join-command")
    assert liner is not None and command is not None
    import hashlib

    assert hashlib.sha256(bundle.read_bytes()).hexdigest() in liner
    assert "sha256sum -c" in liner and "http://cp.example.net:8080/agent/bundles/" in liner
    secret = shlex.split(command)[0].removeprefix("LLMGW_JOIN_TOKEN=")
    assert f"LLMGW_JOIN_TOKEN={secret}" in liner  # one token, in both
    assert 'id="no-bundles"' not in page


def test_node_facts_go_on_the_command(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> str:
        await b.login()
        _, page, _ = await add(
            b,
            node="gpu-9",
            ttl="2h",
            fabrics="ib-a:mlx5_0,mlx5_1\n ib-b:mlx5_2 ",
            nvidia_smi="/opt/fake/nvidia-smi",
            engines="vllm=/opt/vllm/bin/vllm",
        )
        return page

    command = box(rig.run(scenario), "join-command")
    assert command is not None
    words = shlex.split(command)
    tail = words[words.index("--ca-hash") + 2 :]
    assert tail == [
        "--fabric",
        "ib-a:mlx5_0,mlx5_1",
        "--fabric",
        "ib-b:mlx5_2",
        "--nvidia-smi",
        "/opt/fake/nvidia-smi",
        "--engine",
        "vllm=/opt/vllm/bin/vllm",
    ]


@pytest.mark.parametrize(
    ("fields", "status", "says"),
    [
        ({"node": "", "ttl": "1h"}, 400, "give the node's id"),
        ({"node": "gpu-1", "ttl": "soon"}, 400, "TTL must be seconds, or a duration"),
        ({"node": "gpu-1", "ttl": "10"}, 400, "ttl must be between 60 seconds and 7 days"),
        ({"node": "gpu-1", "ttl": "8d"}, 400, "ttl must be between 60 seconds and 7 days"),
        ({"node": "gpu-1", "ttl": "1h", "fabrics": "ib-a\nib-b"}, 400, "both name no adapters"),
        ({"node": "gpu-1", "ttl": "1h", "nvidia_smi": "smi"}, 400, "is not an absolute path"),
        (
            {"node": "gpu-1", "ttl": "1h", "models_root": "/data/models"},
            400,
            "are options of the installer, and this control plane serves no agent bundles",
        ),
        ({"node": "gpu-1", "ttl": "1h", "address": "a b"}, 400, "address"),
        ({"node": "cp.example.net", "ttl": "1h"}, 400, "cp.example.net"),
    ],
)
def test_refusals_mint_nothing_and_keep_the_form(
    rig: FleetRig, store: Store, fields: dict[str, str], status: int, says: str
) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        got, page, _ = await add(b, **fields)
        return got, page

    got, page = rig.run(scenario)
    assert got == status, page
    assert says in problem(page), problem(page)
    assert store.list_join_tokens(include_inactive=True) == []
    assert box(page, "join-command") is None
    assert field(page, "node") == fields["node"] and field(page, "ttl") == fields["ttl"]
    for name in ("nvidia_smi", "models_root", "address"):
        if name in fields:
            assert field(page, name) == fields[name]
    if "fabrics" in fields:
        assert f">{fields['fabrics']}</textarea>" in page


def test_a_viewer_sees_no_form_and_its_post_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[str, int, str]:
        await b.login("vera", VIEWER_PW)
        _, page, _ = await b.get("/ui/add-node")
        status, refused, _ = await add(b, node="gpu-1", ttl="1h")
        return page, status, refused

    page, status, refused = rig.run(scenario)
    assert 'id="join-form"' not in page and 'id="viewer-note"' in page
    assert status == 403 and "is a viewer and may only read" in refused
    assert store.list_join_tokens(include_inactive=True) == []


def test_a_post_without_the_csrf_token_is_refused(rig: FleetRig, store: Store) -> None:
    async def scenario(b: Browser) -> tuple[int, str]:
        await b.login()
        status, page, _ = await b.post("/ui/add-node", {"node": "gpu-1", "ttl": "1h"})
        return status, page

    status, page = rig.run(scenario)
    assert status == 403 and "security token is missing" in page
    assert store.list_join_tokens(include_inactive=True) == []


def test_the_enrolment_is_followed_from_waiting_to_online(rig: FleetRig, store: Store) -> None:
    async def part(b: Browser) -> str:
        status, body, _ = await b.get("/ui/add-node?node=gpu-5&fragment=enrol")
        assert status == 200, body
        assert "<html" not in body  # a fragment, no layout
        return body

    async def scenario(b: Browser) -> list[str]:
        await b.login()
        seen = [await part(b)]  # no token at all yet
        await add(b, node="gpu-5", ttl="1h")
        seen.append(await part(b))
        rig.enrol("gpu-5")
        seen.append(await part(b))
        rig.ctx.membership.approve("gpu-5", FINGERPRINT, actor="admin")
        seen.append(await part(b))
        return seen

    none, waiting, pending, approved = rig.run(scenario)
    assert 'data-stage="waiting"' in none and "no join token that can still be used" in none
    assert 'data-stage="waiting"' in waiting and "valid until" in waiting
    assert 'data-stage="pending"' in pending
    assert f'<code id="enrol-fingerprint">{FINGERPRINT}</code>' in pending
    assert 'href="/ui/approve?node=gpu-5#pending-gpu-5"' in pending
    assert 'data-stage="approved"' in approved and "online with 1 GPU:" in approved


def test_a_live_part_it_does_not_have_is_a_404(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> list[int]:
        await b.login()
        out = []
        for query in ("?fragment=enrol", "?node=gpu-1&fragment=table"):
            status, _body, _ = await b.get("/ui/add-node" + query)
            out.append(status)
        return out

    assert rig.run(scenario) == [404, 404]


def test_a_hostile_node_id_is_escaped(rig: FleetRig) -> None:
    async def scenario(b: Browser) -> list[str]:
        await b.login()
        _, refused, _ = await add(b, node=HOSTILE, ttl="1h")
        _, watched, _ = await b.get("/ui/add-node?node=" + quote(HOSTILE, safe=""))
        return [refused, watched]

    refused, watched = rig.run(scenario)
    assert "invalid node id" in problem(refused)
    for page in (refused, watched):
        assert HOSTILE not in page and "&lt;script&gt;" in page
