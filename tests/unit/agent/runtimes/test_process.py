"""llmgw.agent.runtimes.process: the shard log an engine process writes to."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from llmgw.agent.runtimes.base import Launch
from llmgw.agent.runtimes.process import ProcessRuntime
from llmgw.errors import ShardError


def _launch(log_path: Path) -> Launch:
    return Launch(
        shard_id="s1",
        argv=(sys.executable, "-c", "print('engine up', flush=True)"),
        port=1,
        log_path=log_path,
    )


def test_start_makes_the_log_directory_and_the_engine_writes_there(tmp_path: Path) -> None:
    runtime = ProcessRuntime()
    log_path = tmp_path / "logs" / "s1.log"

    async def main() -> int | None:
        return await runtime.wait(await runtime.start(_launch(log_path)))

    assert asyncio.run(main()) == 0
    assert log_path.read_text() == "engine up\n"


def test_start_says_what_to_check_when_the_log_directory_cannot_be_made(tmp_path: Path) -> None:
    blocker = tmp_path / "logs"
    blocker.write_text("a file where the log directory should be")
    with pytest.raises(ShardError) as info:
        asyncio.run(ProcessRuntime().start(_launch(blocker / "s1.log")))
    message = str(info.value)
    assert f"cannot open the shard log {blocker / 's1.log'}" in message
    assert "check the state directory's owner and free space" in message


def test_what_an_engine_forked_goes_when_the_engine_itself_exits(tmp_path: Path) -> None:
    # The engine forks a worker (as vLLM's API server does its engine core), writes its pid
    # and dies; the worker must not live on holding what it holds.
    pid_file = tmp_path / "worker.pid"
    code = (
        "import os, subprocess, sys\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
        "os._exit(7)\n"
    )
    launch = Launch(
        shard_id="s1", argv=(sys.executable, "-c", code), port=1, log_path=tmp_path / "s1.log"
    )
    runtime = ProcessRuntime()

    async def main() -> int | None:
        return await runtime.wait(await runtime.start(launch))

    assert asyncio.run(main()) == 7
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by init, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
