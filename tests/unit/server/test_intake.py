"""What a node may send on its stream: size limits, per-node token buckets, what a pending
node may send, and when a flood closes the stream (llmgw.server.fleet.intake)."""

from __future__ import annotations

import logging

import pytest

from llmgw.contracts.inventory import MAX_GPU_UUID, MAX_HEARTBEAT_GPUS
from llmgw.proto import control_pb2 as pb
from llmgw.server.fleet.intake import (
    ABUSE_DROPS,
    HELLO_RATE,
    KIND_LIMITS,
    KV_EVENTS_RATE,
    MAX_KV_KEYS,
    MAX_PENDING_INVENTORY_BYTES,
    MAX_SHARD_ID,
    MAX_TEXT,
    Intake,
    TokenBucket,
    heartbeat_utilization,
    hello_problem,
    kv_events_problem,
    pending_inventory,
    trim_hello,
)
from tests.unit.clock import Clock


def heartbeat() -> pb.AgentMessage:
    return pb.AgentMessage(heartbeat=pb.Heartbeat(seq=1))


def inventory(warning: str = "") -> pb.AgentMessage:
    return pb.AgentMessage(inventory=pb.Inventory(hostname="gpu-1", warnings=[warning]))


def status(reason: str = "exited") -> pb.AgentMessage:
    return pb.AgentMessage(
        shard_status=pb.ShardStatus(shard_id="s1", state=pb.SHARD_FAILED, reason=reason)
    )


def test_token_bucket_pays_its_burst_then_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(3, 2.0, clock=clock)
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    clock.t += 0.5  # one token
    assert [bucket.take(), bucket.take()] == [True, False]
    clock.t += 100  # never more than the capacity
    assert sum(bucket.take() for _ in range(10)) == 3


def test_a_pending_node_may_send_only_what_approval_needs() -> None:
    intake = Intake("gpu-1", clock=Clock())
    assert intake.admit(heartbeat(), approved=False)
    assert intake.admit(inventory(), approved=False)
    assert intake.admit(pb.AgentMessage(draining=pb.Draining()), approved=False)
    assert intake.admit(
        pb.AgentMessage(cert_request=pb.CertificateRequest(csr_pem="x")), approved=False
    )
    refused = [
        status(),
        pb.AgentMessage(op_result=pb.OperationResult(op_id="x", ok=False, error="e")),
        pb.AgentMessage(update_status=pb.UpdateStatus(op_id="x", state="failed")),
        pb.AgentMessage(),
    ]
    assert [intake.admit(m, approved=False) for m in refused] == [False] * 4
    assert intake.dropped == 4
    # Approved, the same messages pass (but an empty one never does).
    assert [intake.admit(m, approved=True) for m in refused] == [True, True, True, False]


def test_messages_over_their_kinds_limit_are_dropped() -> None:
    intake = Intake("gpu-1", clock=Clock())
    big = inventory("w" * (KIND_LIMITS["inventory"] + 1))
    assert not intake.admit(big, approved=True)
    huge_status = status("r" * (KIND_LIMITS["shard_status"] + 1))
    assert not intake.admit(huge_status, approved=True)
    csr = pb.AgentMessage(cert_request=pb.CertificateRequest(csr_pem="c" * 20_000))
    assert not intake.admit(csr, approved=True)
    assert intake.dropped == 3
    # Just under the limit passes.
    assert intake.admit(inventory("w" * (KIND_LIMITS["inventory"] - 100)), approved=True)


def test_free_text_is_cut_before_it_reaches_the_store() -> None:
    intake = Intake("gpu-1", clock=Clock())
    msg = status("r" * 50_000)
    assert intake.admit(msg, approved=True)
    assert len(msg.shard_status.reason) == MAX_TEXT and msg.shard_status.reason.endswith("…")
    result = pb.AgentMessage(op_result=pb.OperationResult(op_id="x", error="e" * 50_000))
    assert intake.admit(result, approved=True)
    assert len(result.op_result.error) == MAX_TEXT
    hello = pb.Hello(node_id="gpu-1", shards=[pb.ShardStatus(shard_id="s", reason="q" * 9000)])
    trim_hello(hello)
    assert len(hello.shards[0].reason) == MAX_TEXT


def test_inventories_are_rate_limited_per_node_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    intake = Intake("gpu-1", clock=clock)
    other = Intake("gpu-2", clock=clock)
    with caplog.at_level(logging.WARNING, logger="llmgw.server.intake"):
        passed = sum(intake.admit(inventory(), approved=True) for _ in range(30))
    assert passed == 4
    assert other.admit(inventory(), approved=True)  # another node has its own buckets
    lines = [r for r in caplog.records if r.getMessage() == "dropped messages from a node"]
    assert len(lines) == 1
    assert "inventory (rate limit): 1" in str(lines[0].__dict__["fields"]["dropped"])
    clock.t += 5.0  # one more after its refill time
    assert intake.admit(inventory(), approved=True)
    assert not intake.admit(inventory(), approved=True)
    assert intake.abuse is None


def test_renewal_requests_are_rate_limited_by_the_certificate_lifetime() -> None:
    clock = Clock()
    intake = Intake("gpu-1", renewal_interval=3.0, clock=clock)
    request = pb.AgentMessage(cert_request=pb.CertificateRequest(csr_pem="x"))
    assert [intake.admit(request, approved=True) for _ in range(4)] == [True] * 3 + [False]
    clock.t += 3.0
    assert intake.admit(request, approved=True)


def test_a_gross_flood_sets_the_abuse_reason() -> None:
    clock = Clock()
    intake = Intake("gpu-1", clock=clock)
    for _ in range(ABUSE_DROPS):
        intake.admit(status(), approved=False)
    assert intake.abuse is None
    intake.admit(status(), approved=False)
    assert intake.abuse is not None
    assert "node gpu-1" in intake.abuse and "stream is closed" in intake.abuse


def test_drops_spread_over_time_are_no_abuse() -> None:
    clock = Clock()
    intake = Intake("gpu-1", clock=clock)
    for _ in range(5):
        for _ in range(ABUSE_DROPS // 2):
            intake.admit(status(), approved=False)
        clock.t += 11.0
    assert intake.abuse is None


def test_hello_fields_that_would_be_stored_are_bounded() -> None:
    assert hello_problem(pb.Hello(node_id="gpu-1", dataplane_addr="10.0.0.1:9443")) is None
    problem = hello_problem(pb.Hello(node_id="gpu-1", dataplane_addr="a" * 400))
    assert problem is not None and "set 'advertise' in agent.yaml" in problem
    problem = hello_problem(pb.Hello(node_id="gpu-1", agent_version="1" * 100))
    assert problem is not None and "upgrade the agent" in problem
    many = pb.Hello(node_id="gpu-1", shards=[pb.ShardStatus(shard_id=str(i)) for i in range(2000)])
    problem = hello_problem(many)
    assert problem is not None and "2000 shards" in problem


def test_a_pending_nodes_stored_inventory_is_a_bounded_summary() -> None:
    inv = pb.Inventory(
        hostname="gpu-1",
        arch="x86_64",
        cpus=64,
        memory_total_bytes=1 << 40,
        engines=["sim", "vllm"],
        warnings=["w" * 3_000_000] * 3,
        gpus=[pb.Gpu(index=i, name="H100", uuid=f"GPU-{i}") for i in range(8)],
        ib_adapters=[
            pb.IbAdapter(name="mlx5_0", ports=[pb.IbPort(port=1, gids=["fe80::1"] * 10_000)])
        ],
        engine_details=[pb.EngineInfo(name="vllm", problem="p" * 1_000_000)],
    )
    summary = pending_inventory(inv)
    assert summary.ByteSize() <= MAX_PENDING_INVENTORY_BYTES
    assert summary.hostname == "gpu-1" and summary.cpus == 64 and len(summary.gpus) == 8
    assert list(summary.engines) == ["sim", "vllm"]
    assert [len(w) for w in summary.warnings] == [256] * 3
    assert not summary.ib_adapters and not summary.engine_details


def test_streams_opened_too_often_are_refused_and_the_buckets_outlive_a_stream(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    intake = Intake("gpu-1", clock=clock)
    burst, rate = int(HELLO_RATE[0]), HELLO_RATE[1]
    with caplog.at_level(logging.WARNING, logger="llmgw.server.intake"):
        answers = [intake.admit_stream() for _ in range(burst + 2)]
    assert answers[:burst] == [None] * burst
    refusal = answers[burst]
    assert refusal is not None and f"node gpu-1 opened over {burst} streams in a row" in refusal
    assert f"one per {1 / rate:g} s" in refusal
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    clock.t += 1 / rate
    assert intake.admit_stream() is None
    # A flood's abuse verdict ends with the stream; the spent buckets do not.
    for _ in range(ABUSE_DROPS + 1):
        intake.admit(status(), approved=False)
    assert intake.abuse is not None
    spent = sum(intake.admit(inventory(), approved=True) for _ in range(10))
    clock.t += 5.0
    assert intake.admit_stream() is None and intake.abuse is None
    assert spent == 4 and sum(intake.admit(inventory(), approved=True) for _ in range(10)) == 1


def test_refused_streams_are_recorded_at_a_bounded_rate() -> None:
    clock = Clock()
    intake = Intake("gpu-1", clock=clock)
    assert [intake.record_refusal() for _ in range(8)] == [True] * 5 + [False] * 3
    clock.t += 30.0
    assert [intake.record_refusal(), intake.record_refusal()] == [True, False]


def test_a_heartbeats_gpu_utilisation_is_bounded() -> None:
    heartbeat = pb.Heartbeat(
        gpu_utilization=[
            pb.GpuUtilization(uuid="GPU-a", percent=37),
            pb.GpuUtilization(uuid="GPU-b", percent=0),  # idle: known
            pb.GpuUtilization(uuid="GPU-c"),  # cannot tell
            pb.GpuUtilization(uuid="GPU-d", percent=250),  # no percent: unknown
            pb.GpuUtilization(uuid="", percent=5),  # no GPU of the inventory's
            pb.GpuUtilization(uuid="G" * (MAX_GPU_UUID + 1), percent=5),
        ]
    )
    assert heartbeat_utilization(heartbeat) == {
        "GPU-a": 37,
        "GPU-b": 0,
        "GPU-c": None,
        "GPU-d": None,
    }
    many = pb.Heartbeat(
        gpu_utilization=[
            pb.GpuUtilization(uuid=f"GPU-{i}", percent=1) for i in range(MAX_HEARTBEAT_GPUS + 9)
        ]
    )
    assert len(heartbeat_utilization(many)) == MAX_HEARTBEAT_GPUS


def test_a_heartbeat_of_the_most_gpus_kept_is_admitted_one_over_its_limit_is_not() -> None:
    intake = Intake("gpu-1")
    # The worst an agent sends: every uuid as long as kept (NVIDIA's are 40), every figure.
    full = pb.Heartbeat(
        seq=2**63,
        inflight=2**32 - 1,
        gpu_utilization=[
            pb.GpuUtilization(uuid="G" * MAX_GPU_UUID, percent=100)
            for _ in range(MAX_HEARTBEAT_GPUS)
        ],
    )
    assert intake.admit(pb.AgentMessage(heartbeat=full), approved=True)
    full.gpu_utilization.extend(
        pb.GpuUtilization(uuid="x" * MAX_GPU_UUID, percent=100) for _ in range(64)
    )
    assert pb.AgentMessage(heartbeat=full).ByteSize() > KIND_LIMITS["heartbeat"]
    assert not intake.admit(pb.AgentMessage(heartbeat=full), approved=True)


def kv_events(**fields: object) -> pb.AgentMessage:
    values: dict[str, object] = {"shard_id": "r1-s0", "block_size": 16, **fields}
    return pb.AgentMessage(kv_events=pb.KvEvents(**values))  # type: ignore[arg-type]


def test_kv_events_of_an_approved_node_within_their_bounds_are_admitted() -> None:
    intake = Intake("gpu-1", clock=Clock())
    half = MAX_KV_KEYS // 2
    widest = kv_events(
        shard_id="s" * MAX_SHARD_ID,
        block_size=1024,
        cleared=True,
        stored=[2**64 - 1 - i for i in range(half)],
        removed=list(range(1, half + 1)),
        lost=3,
    )
    assert widest.ByteSize() <= KIND_LIMITS["kv_events"]
    assert intake.admit(widest, approved=True)
    assert intake.admit(kv_events(block_size=1, cleared=True), approved=True)
    assert intake.dropped == 0


def test_a_pending_node_may_not_send_kv_events() -> None:
    intake = Intake("gpu-1", clock=Clock())
    assert not intake.admit(kv_events(stored=[1, 2]), approved=False)
    assert intake.dropped == 1


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"shard_id": ""}, "no shard id"),
        ({"shard_id": "s" * (MAX_SHARD_ID + 1)}, f"shard id over {MAX_SHARD_ID} characters"),
        ({"block_size": 0}, "block size 0 not in 1..1024"),
        ({"block_size": 1025}, "block size 1025 not in 1..1024"),
        (
            {"stored": list(range(MAX_KV_KEYS // 2 + 1)), "removed": list(range(MAX_KV_KEYS // 2))},
            f"{MAX_KV_KEYS + 1} keys, over {MAX_KV_KEYS}",
        ),
    ],
)
def test_kv_events_out_of_bounds_are_refused(
    fields: dict[str, object], problem: str, caplog: pytest.LogCaptureFixture
) -> None:
    msg = kv_events(**fields)
    assert kv_events_problem(msg.kv_events) == problem
    intake = Intake("gpu-1", clock=Clock())
    with caplog.at_level(logging.WARNING, logger="llmgw.server.intake"):
        assert not intake.admit(msg, approved=True)
    assert intake.dropped == 1
    (line,) = [r for r in caplog.records if r.getMessage() == "dropped messages from a node"]
    assert f"kv_events ({problem}): 1" in str(line.__dict__["fields"]["dropped"])


def test_kv_events_have_a_bucket_of_their_own() -> None:
    clock = Clock()
    intake = Intake("gpu-1", clock=clock)
    burst, rate = KV_EVENTS_RATE
    assert all(intake.admit(kv_events(stored=[1]), approved=True) for _ in range(int(burst)))
    assert not intake.admit(kv_events(stored=[1]), approved=True)
    # The other messages' bucket is untouched by them.
    assert intake.admit(status(), approved=True)
    clock.t += 1 / rate
    assert intake.admit(kv_events(stored=[1]), approved=True)
