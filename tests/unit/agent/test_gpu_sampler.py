"""The GPUs' utilisation sampled for the heartbeat: through the stand-in pynvml and the fake
nvidia-smi programs (tests/fixtures), a value and unknown; nothing run on a node without
GPUs; a failing look is unknown, not the last figure, and said once."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from llmgw.agent.discovery import GpuFacts, discover_gpus
from llmgw.agent.gpu_sampler import GpuSampler, utilization_of
from llmgw.contracts.inventory import MAX_GPU_UUID, MAX_HEARTBEAT_GPUS
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.intake import KIND_LIMITS

from .fake_nvml import FakeNvml, eight_gpus

SMI = Path(__file__).resolve().parents[2] / "fixtures" / "nvidia-smi"
UNABLE = "cannot sample GPU utilisation; it is shown as unknown until it can"


def _percents(sample: list[pb.GpuUtilization]) -> list[tuple[str, int | None]]:
    return [(u.uuid, u.percent if u.HasField("percent") else None) for u in sample]


def test_through_nvidia_smi_a_value() -> None:
    sampler = GpuSampler(SMI / "one-gpu", lambda: True, interval=lambda: 1.0)
    assert _percents(sampler.sample()) == [("GPU-7c0e3f5a-2b1d-4e8f-9a6c-3d5b7e9f1a2c", 37)]


def test_through_nvidia_smi_unknown_is_unset_not_zero() -> None:
    sampler = GpuSampler(SMI / "na-values", lambda: True, interval=lambda: 1.0)
    assert _percents(sampler.sample()) == [
        ("GPU-0a1b2c3d-0000-4000-8000-000000000001", None),
        ("GPU-0a1b2c3d-0000-4000-8000-000000000002", None),
    ]


def test_through_nvml_a_value_an_idle_gpu_and_unknown(
    fake_nvml: FakeNvml, empty_path: Path
) -> None:
    gpus = eight_gpus()[3:6]  # idle (0 %), busy (94 %), and one that cannot tell
    gpus[2]["utilization_gpu"] = None
    fake_nvml(gpus=gpus)
    sampler = GpuSampler(None, lambda: True, interval=lambda: 1.0)
    assert _percents(sampler.sample()) == [
        (gpus[0]["uuid"], 0),
        (gpus[1]["uuid"], 94),
        (gpus[2]["uuid"], None),
    ]


def test_a_node_without_gpus_runs_nothing() -> None:
    looked: list[Path | None] = []

    def discover(nvidia_smi: Path | None) -> GpuFacts:
        looked.append(nvidia_smi)
        return discover_gpus(nvidia_smi)

    sampler = GpuSampler(SMI / "one-gpu", lambda: False, interval=lambda: 1.0, discover=discover)
    assert sampler.sample() == []
    assert looked == []


def test_a_failing_look_is_unknown_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    sampler = GpuSampler(SMI / "one-gpu", lambda: True, interval=lambda: 1.0)
    assert len(sampler.sample()) == 1
    sampler.nvidia_smi = SMI / "driver-failed"
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.gpu_sampler"):
        assert sampler.sample() == []
        assert sampler.sample() == []
    said = [r for r in caplog.records if r.getMessage() == UNABLE]
    assert len(said) == 1
    assert "couldn't communicate with the NVIDIA driver" in str(said[0].__dict__)
    # Back: sampled again, and a later failure is said again.
    sampler.nvidia_smi = SMI / "one-gpu"
    assert len(sampler.sample()) == 1
    sampler.nvidia_smi = SMI / "driver-failed"
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.gpu_sampler"):
        sampler.sample()
    assert len([r for r in caplog.records if r.getMessage() == UNABLE]) == 2


def test_utilization_of_keeps_each_gpus_uuid_and_presence() -> None:
    facts = GpuFacts(
        gpus=[
            pb.Gpu(index=0, uuid="GPU-a", utilization_percent=0),
            pb.Gpu(index=1, uuid="GPU-b"),
        ]
    )
    assert _percents(utilization_of(facts)) == [("GPU-a", 0), ("GPU-b", None)]


def test_run_keeps_the_latest_sample_and_drops_it_when_sampling_breaks() -> None:
    answers: list[GpuFacts | Exception] = [
        GpuFacts(gpus=[pb.Gpu(uuid="GPU-a", utilization_percent=10)]),
        GpuFacts(gpus=[pb.Gpu(uuid="GPU-a", utilization_percent=55)]),
        RuntimeError("a discovery bug"),
        GpuFacts(gpus=[pb.Gpu(uuid="GPU-a", utilization_percent=70)]),
    ]
    # What the heartbeat would have carried just before each look.
    before: list[list[tuple[str, int | None]]] = []
    sampler: GpuSampler

    def discover(nvidia_smi: Path | None) -> GpuFacts:
        before.append(_percents(sampler.latest))
        answer = answers.pop(0) if answers else GpuFacts()
        if isinstance(answer, Exception):
            raise answer
        return answer

    sampler = GpuSampler(None, lambda: True, interval=lambda: 0.01, discover=discover)

    async def scenario() -> None:
        task = asyncio.create_task(sampler.run())
        try:
            for _ in range(1000):
                if len(before) >= 5:
                    break
                await asyncio.sleep(0.01)
            assert not task.done()  # a failing sample is never the sampler's end
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    # The failed look leaves no stale figure: unknown until the next one answers.
    assert before[:5] == [[], [("GPU-a", 10)], [("GPU-a", 55)], [], [("GPU-a", 70)]]


def test_a_heartbeat_carries_no_more_than_the_control_plane_takes() -> None:
    gpus = [pb.Gpu(index=i, uuid=f"GPU-{i}", utilization_percent=1) for i in range(80)]
    gpus.insert(3, pb.Gpu(index=99, uuid="G" * (MAX_GPU_UUID + 1), utilization_percent=1))
    gpus.insert(5, pb.Gpu(index=98, uuid=""))
    carried = utilization_of(GpuFacts(gpus=gpus))
    assert [u.uuid for u in carried] == [f"GPU-{i}" for i in range(MAX_HEARTBEAT_GPUS)]
    heartbeat = pb.AgentMessage(heartbeat=pb.Heartbeat(seq=2**63, gpu_utilization=carried))
    assert heartbeat.ByteSize() <= KIND_LIMITS["heartbeat"]
