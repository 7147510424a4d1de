"""llmgw.agent.runtimes.process: the shard log an engine process writes to."""

from __future__ import annotations

import asyncio
import sys
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
