"""shards.json: records survive a save and a load unchanged; a corrupt file is moved aside."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from llmgw.agent.records import RECORDS_FILE, ShardRecords, parse_record, record_json
from llmgw.agent.runtimes.base import ShardRecord, SidecarRecord
from llmgw.contracts.sandbox import SandboxPolicy

FULL = ShardRecord(
    shard_id="s1",
    replica_id="r1",
    model="m",
    engine="vllm",
    rank=1,
    params={"tp": "2"},
    extra_args=("--a", "b"),
    pid=1234,
    start_time=99,
    port=8001,
    container_id="c0ffee",
    state="ready",
    nodes=2,
    dist_init_addr="10.0.0.1:29500",
    gpus=("GPU-1", "GPU-2"),
    source="/models/m",
    gpu_memory_mib=4096,
    profile="p",
    sidecars=(
        SidecarRecord(
            name="cache",
            argv=("cache", "--port", "1"),
            health_url="http://127.0.0.1:1/health",
            timeout_s=30.0,
            ready_after_s=0.0,
            pid=77,
            start_time=5,
            sandboxed=True,
        ),
    ),
    worker_addrs=("10.0.0.2:50052",),
    listen_addr="0.0.0.0:50052",
    log_offset=42,
    sandbox=SandboxPolicy(extra_ro=("/opt/data",), extra_rw=("/scratch",)),
    sandboxed=True,
    disagg_role="prefill",
    transfer_addr="10.0.0.1:29600",
    bootstrap_port=41001,
)
MINIMAL = ShardRecord(shard_id="s2", replica_id="r2", model="m", engine="sim")


def test_save_then_load_gives_the_same_records(tmp_path: Path) -> None:
    records = ShardRecords(tmp_path / "state")
    records.save([FULL, MINIMAL])
    assert records.load() == [FULL, MINIMAL]
    path = tmp_path / "state" / RECORDS_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "state").stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == [RECORDS_FILE]  # no temporary left
    # No container, no key: what an older agent wrote reads the same.
    assert "container_id" not in json.loads(path.read_text())["s2"]


def test_a_record_of_an_agent_before_sandboxes_is_an_unconfined_engine() -> None:
    entry = record_json(MINIMAL)
    del entry["sandbox"], entry["sandboxed"]
    record = parse_record("s2", entry)
    assert not record.sandboxed  # stopped with its whole group, as that agent did
    assert record.sandbox == SandboxPolicy()  # a restart is sandboxed


def test_save_replaces_the_whole_file(tmp_path: Path) -> None:
    records = ShardRecords(tmp_path)
    records.save([FULL, MINIMAL])
    records.save([MINIMAL])
    assert records.load() == [MINIMAL]
    records.save([])
    assert records.load() == []


def test_no_file_is_no_records(tmp_path: Path) -> None:
    assert ShardRecords(tmp_path / "nowhere").load() == []


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"pid": "1"}, "shard 's1': 'pid' is a str"),
        ({"params": {"a": 1}}, "shard 's1': 'params' is not a map of strings"),
        ({"gpus": [0]}, "shard 's1': 'gpus' is not a list of strings"),
        ({"rank": True}, "shard 's1': 'rank' is a bool"),
        ({"sidecars": [{"name": "bad name", "argv": ["x"]}]}, "shard 's1': sidecar 0: "),
        ({"sandboxed": 1}, "shard 's1': 'sandboxed' is a int"),
        ({"sandbox": {"extra_ro": "/opt"}}, "shard 's1': 'sandbox.extra_ro' is not a list"),
        ({"sandbox": {"enabled": "no"}}, "shard 's1': 'sandbox.enabled' is not a boolean"),
        ({"bootstrap_port": "41001"}, "shard 's1': 'bootstrap_port' is a str"),
        ({"bootstrap_port": 70000}, "shard 's1': 'bootstrap_port' 70000 is not a port"),
    ],
)
def test_an_entry_that_is_not_what_was_written_is_refused(
    change: dict[str, object], problem: str
) -> None:
    entry = {**record_json(FULL), **change}
    with pytest.raises(ValueError, match="^" + problem.replace("(", r"\(")):
        parse_record("s1", entry)


def test_a_corrupt_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / RECORDS_FILE
    content = json.dumps({"s1": {**record_json(FULL), "port": None}})
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.records"):
        assert ShardRecords(tmp_path).load() == []
    (aside,) = tmp_path.glob(RECORDS_FILE + ".corrupt-*")
    assert aside.read_text() == content
    assert not path.exists()
    message = caplog.records[-1]
    assert message.getMessage() == (
        "shard records are corrupt; moved them aside and adopting nothing"
    )
    assert "'port' is a NoneType" in str(message.__dict__["fields"]["error"])


def test_an_unwritable_state_directory_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a-file").write_text("")  # even root cannot make a directory under a file
    with caplog.at_level(logging.WARNING, logger="llmgw.agent.records"):
        ShardRecords(tmp_path / "a-file" / "state").save([MINIMAL])
    assert caplog.records[-1].getMessage() == "cannot record shards in the state directory"
