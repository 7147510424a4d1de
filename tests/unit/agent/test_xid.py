"""The XID watch against the NVML stand-in (it answers as nvidia-ml-py's event API does): an
XID reported after registration marks its GPU unhealthy for good, an application's XID does
not, a GPU that cannot report XIDs is said, and the inventory carries each GPU's health."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.discovery.xid import XidWatch, xid_text
from llmgw.agent.inventory import collect_inventory

from .fake_nvml import FakeNvml, eight_gpus


def _report(*xids: tuple[int, int]) -> None:
    """GPU ``index`` reports ``xid``, for each pair: appended to the machine file."""
    path = Path(os.environ["LLMGW_FAKE_NVML"])
    machine: dict[str, Any] = json.loads(path.read_text())
    for index, xid in xids:
        machine["gpus"][index].setdefault("xid_events", []).append(xid)
    path.write_text(json.dumps(machine))


def test_an_xid_after_registration_marks_its_gpu(fake_nvml: FakeNvml) -> None:
    gpus = eight_gpus()
    gpus[1]["xid_events"] = [79]  # before the agent looked: not an event it gets
    fake_nvml(gpus=gpus)
    watch = XidWatch()
    assert watch.start()
    assert watch.problem == ""
    assert watch.poll(0) == []
    _report((3, 48), (5, 13))
    assert watch.poll(0) == [gpus[3]["uuid"]]
    assert watch.health() == {gpus[3]["uuid"]: "XID 48: double-bit ECC error"}
    _report((3, 79))
    assert watch.poll(0) == []  # unhealthy already: the first reason stays
    watch.close()


def test_a_wait_without_events_times_out(fake_nvml: FakeNvml) -> None:
    fake_nvml(gpus=eight_gpus()[:1])
    watch = XidWatch()
    assert watch.start()
    assert watch.poll(50) == []
    watch.close()


def test_gpus_that_cannot_report_xids_are_said(fake_nvml: FakeNvml) -> None:
    gpus = eight_gpus()[:2]
    gpus[1]["xid_events_supported"] = False
    fake_nvml(gpus=gpus)
    watch = XidWatch()
    assert watch.start()
    assert watch.problem == "XIDs not watched on GPU 1: cannot report XIDs"
    gpus[0]["xid_events_supported"] = False
    fake_nvml(gpus=gpus)
    none = XidWatch()
    assert not none.start()
    assert none.problem.startswith("XIDs not watched on GPU 0: cannot report XIDs")


def test_without_nvml_nothing_is_watched(fake_nvml: FakeNvml) -> None:
    fake_nvml(init_error="DRIVER_NOT_LOADED")
    watch = XidWatch()
    assert not watch.start()
    assert watch.problem == "XIDs not watched: NVML: Driver Not Loaded"
    assert watch.poll(0) == []


def test_run_calls_back_once_a_gpu_turned(fake_nvml: FakeNvml) -> None:
    gpus = eight_gpus()[:2]
    fake_nvml(gpus=gpus)
    watch = XidWatch(wait_ms=20)
    assert watch.start()
    told: list[int] = []

    async def scenario() -> None:
        done = asyncio.Event()

        async def changed() -> None:
            told.append(1)
            done.set()

        task = asyncio.create_task(watch.run(changed))
        await asyncio.sleep(0.05)
        _report((0, 79))
        await asyncio.wait_for(done.wait(), timeout=10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert told == [1]
    watch.close()


def test_the_inventory_carries_health(fake_nvml: FakeNvml, empty_path: Path) -> None:
    gpus = eight_gpus()[:2]
    fake_nvml(gpus=gpus)
    inv = collect_inventory(gpu_health={gpus[1]["uuid"]: xid_text(79)})
    assert [g.health for g in inv.gpus] == ["", "XID 79: GPU has fallen off the bus"]


def test_xid_text() -> None:
    assert xid_text(79) == "XID 79: GPU has fallen off the bus"
    assert xid_text(1234) == "XID 1234"


def test_an_xid_nvml_cannot_place_marks_every_gpu(fake_nvml: FakeNvml) -> None:
    gpus = eight_gpus()[:2]
    fake_nvml(gpus=gpus)
    watch = XidWatch()
    assert watch.start()
    path = Path(os.environ["LLMGW_FAKE_NVML"])
    machine = json.loads(path.read_text())
    # It fell off the bus: the event comes, and NVML answers 'GPU is lost' for its uuid.
    machine["gpus"][0].update(xid=79, lost_at="query", xid_events=[79])
    path.write_text(json.dumps(machine))
    assert watch.poll(0) == [gpus[0]["uuid"], gpus[1]["uuid"]]
    watch.close()
