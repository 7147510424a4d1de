"""The node page's GPUs: each GPU's state in the table, a cordon/uncordon form per GPU behind
the action guard (CSRF, admin), answered 303 back with a flash; refusals said the same way."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from llmgw.server.store import Store
from tests.unit.clock import Clock
from tests.unit.server.console.rig import VIEWER_PW, Browser, ConsoleRig


@pytest.fixture
def rig(store: Store, clock: Clock, tmp_path: Path) -> ConsoleRig:
    rig = ConsoleRig(store, clock, tmp_path)
    rig.add_node("gpu-1")
    return rig


def _flash(page: str) -> str:
    found = re.search(r'<p class="flash flash-(\w+)" role="status" id="flash">([^<]*)</p>', page)
    return f"{found.group(1)}: {html.unescape(found.group(2))}" if found else ""


def _state(page: str, index: int) -> str:
    found = re.search(rf'<td class="gpu-state" id="gpu-state-{index}">([^<]*)</td>', page)
    return found.group(1) if found else ""


async def act(b: Browser, action: str, form: dict[str, str]) -> tuple[int, str, str]:
    status, body, resp = await b.post(f"/ui/nodes/gpu-1/gpus/{action}", {"csrf": b.csrf, **form})
    if status != 303:
        return status, body, ""
    assert resp.headers["Location"] == "/ui/nodes/gpu-1"
    _, page, _ = await b.get("/ui/nodes/gpu-1")
    return status, _flash(page), page


def test_cordon_then_uncordon_a_gpu(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str, str]]:
        await b.login()
        _, page, _ = await b.get("/ui/nodes/gpu-1")
        assert _state(page, 0) == "healthy"
        assert 'id="gpu-cordon-0"' in page and 'id="gpu-cordon-1"' in page
        out = [await act(b, "cordon", {"gpu": "GPU-gpu-1-0", "reason": "fan noise"})]
        out.append(await act(b, "cordon", {"gpu": "GPU-gpu-1-0"}))
        out.append(await act(b, "uncordon", {"gpu": "GPU-gpu-1-0"}))
        return out

    cordoned, again, uncordoned = rig.run(scenario)
    assert cordoned[:2] == (
        303,
        "info: GPU GPU-gpu-1-0 of gpu-1 cordoned: what runs on it moves elsewhere",
    )
    assert _state(cordoned[2], 0) == "cordoned by admin: fan noise"
    assert 'id="gpu-uncordon-0"' in cordoned[2] and 'id="gpu-cordon-1"' in cordoned[2]
    assert again[:2] == (
        303,
        "error: GPU GPU-gpu-1-0 of gpu-1 already cordoned; "
        "'llmgw ctl gpus uncordon gpu-1 GPU-gpu-1-0' lifts it",
    )
    assert uncordoned[:2] == (303, "info: GPU GPU-gpu-1-0 of gpu-1 takes replicas again")
    assert _state(uncordoned[2], 0) == "healthy"
    kinds = [(e.kind, e.actor) for e in reversed(store.list_events()) if e.subject == "gpu-1"]
    assert kinds == [("gpu_cordon", "admin"), ("gpu_uncordon", "admin")]


def test_refusals(rig: ConsoleRig, store: Store) -> None:
    async def scenario(b: Browser) -> list[tuple[int, str, str]]:
        await b.login()
        await b.get("/ui/nodes/gpu-1")
        return [
            await act(b, "cordon", {"gpu": "7"}),
            await act(b, "cordon", {}),
        ]

    unknown, unnamed = rig.run(scenario)
    assert unknown[1].startswith("error: node gpu-1 has no GPU '7'; its GPUs: 0 (GPU-gpu-1-0)")
    assert unnamed[1] == "error: nothing done: name the GPU to cordon"
    assert store.list_gpu_cordons() == []


def test_without_the_csrf_token_or_as_a_viewer_nothing_is_done(
    rig: ConsoleRig, store: Store
) -> None:
    async def scenario(b: Browser) -> tuple[int, int]:
        await b.login()
        await b.get("/ui/nodes/gpu-1")
        forged, _, _ = await b.post("/ui/nodes/gpu-1/gpus/cordon", {"gpu": "0", "csrf": "x"})
        await b.post("/ui/logout", {"csrf": b.csrf})
        await b.login("vera", VIEWER_PW)
        await b.get("/ui/nodes/gpu-1")
        viewer, _, _ = await b.post("/ui/nodes/gpu-1/gpus/cordon", {"gpu": "0", "csrf": b.csrf})
        return forged, viewer

    forged, viewer = rig.run(scenario)
    assert forged == 403
    assert viewer == 403
    assert store.list_gpu_cordons() == []
