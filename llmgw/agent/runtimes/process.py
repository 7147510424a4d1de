"""The process runtime: each shard is a child process in its own session on a loopback port."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

from llmgw.agent.runtimes.base import Handle, Launch, Runtime
from llmgw.errors import ShardError

__all__ = ["ProcessRuntime", "process_start_time"]


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks since boot), so a reused pid is never mistaken."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    rest = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


class ProcessRuntime(Runtime):
    """Engines as child processes, each the leader of its own session and process group."""

    name = "process"

    async def start(self, launch: Launch) -> Handle:
        launch.log_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        env = dict(os.environ)
        env.update(launch.env)
        try:
            log = open(launch.log_path, "ab", buffering=0)
        except OSError as exc:
            raise ShardError(
                f"cannot open the shard log {launch.log_path}: {exc.strerror}; "
                "check the state directory's owner and free space"
            ) from exc
        try:
            proc = await asyncio.create_subprocess_exec(
                *launch.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            raise ShardError(
                f"cannot start {launch.argv[0]}: {exc.strerror}; check that the engine is "
                "installed and executable by the agent's user"
            ) from exc
        finally:
            log.close()
        return Handle(shard_id=launch.shard_id, pid=proc.pid, port=launch.port, ref=proc)

    async def wait(self, handle: Handle) -> int:
        proc = handle.ref
        assert isinstance(proc, asyncio.subprocess.Process)
        return await proc.wait()

    def alive(self, handle: Handle) -> bool:
        proc = handle.ref
        assert isinstance(proc, asyncio.subprocess.Process)
        return proc.returncode is None

    async def stop(self, handle: Handle, grace: float) -> None:
        proc = handle.ref
        assert isinstance(proc, asyncio.subprocess.Process)
        if proc.returncode is not None:
            return
        # The engine leads its own process group: signal the whole group so that helpers
        # it forked (tokenizer workers, sidecars) go with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        # Anything left in the group after the leader is gone is killed too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
