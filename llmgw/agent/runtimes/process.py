"""The process runtime: each shard is a process in its own session on a loopback port.

Engines outlive the agent: each leads its own session, reads /dev/null, writes to its log
file and holds nothing else of the agent's, so a restarted agent adopts it by pid and start
time. The agent waits for a process through a pidfd (polling /proc where there is none)
rather than as its parent, since an adopted engine is no longer its child.

A sandboxed engine (:mod:`llmgw.agent.sandbox`) is bubblewrap's child: the pid the agent
records, adopts and waits for is bwrap's, which leads the session and ends with the engine
(its exit code the engine's, 128 + N for a signal N). bwrap dies of a SIGTERM at once while
its sandbox runs on, so a stop sends SIGTERM to every other process of the group (the
sandbox's pid 1 ignores it; the engine gets its grace) and SIGKILL to the whole group after
it: killing the sandbox's pid 1 ends everything in the sandbox's pid namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from llmgw.agent.runtimes.base import Handle, Launch, Runtime, ShardRecord, open_shard_log
from llmgw.errors import ShardError
from llmgw.procutil import process_running, process_start_time

__all__ = ["EngineProcess", "ProcessRuntime"]

_POLL_S = 0.5

# Variables meant for the agent alone: an engine that saw them could notify systemd on the
# agent's behalf or take itself for a child of 'llmgw up'.
_AGENT_ONLY_ENV = (
    "NOTIFY_SOCKET",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
    "LLMGW_PARENT_PID",
)


@dataclass
class EngineProcess:
    """A ``Handle.ref``: an engine process, started by this agent or adopted from a previous one."""

    pid: int
    start_time: int | None
    popen: subprocess.Popen[bytes] | None = None
    """The child this agent started; None when adopted (its exit code is unknowable)."""
    sandboxed: bool = False
    """``pid`` is bubblewrap's; the engine runs under it."""

    def running(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return process_running(self.pid, self.start_time)

    async def gone(self) -> None:
        """Return once the process has ended, without having to be its parent."""
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return
        except OSError:
            # No pidfd (Linux < 5.3, a seccomp filter): look at /proc now and then.
            while self.running():  # noqa: ASYNC110 - polling is the point
                await asyncio.sleep(_POLL_S)
            return
        try:
            # The pid may have been reused before the pidfd was opened: check it is still ours.
            if not self.running():
                return
            loop = asyncio.get_running_loop()
            ended: asyncio.Future[None] = loop.create_future()

            def readable() -> None:
                if not ended.done():
                    ended.set_result(None)

            loop.add_reader(pidfd, readable)
            try:
                await ended
            finally:
                loop.remove_reader(pidfd)
        finally:
            os.close(pidfd)


def _signal_group(pgid: int, sig: int, *, spare: int) -> None:
    """``sig`` to every process of group ``pgid`` but ``spare`` (read from /proc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == spare:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # Fields after the command's closing parenthesis: state, ppid, pgrp, ...
            if int(stat[stat.rindex(b")") + 2 :].split()[2]) == pgid:
                os.kill(int(entry), sig)
        except (OSError, ValueError, IndexError):
            continue


def _engine(handle: Handle) -> EngineProcess:
    ref = handle.ref
    assert isinstance(ref, EngineProcess)
    return ref


class ProcessRuntime(Runtime):
    """Engines as processes, each the leader of its own session and process group."""

    name = "process"

    async def start(self, launch: Launch) -> Handle:
        env = {k: v for k, v in os.environ.items() if k not in _AGENT_ONLY_ENV}
        if getattr(sys, "frozen", False):
            # A frozen llmgw started from a frozen llmgw reuses its parent's unpacked files,
            # which go away when the agent exits; engines outlive the agent: unpack anew.
            env["PYINSTALLER_RESET_ENVIRONMENT"] = "1"
        env.update(launch.env)
        log = open_shard_log(launch.log_path)
        # Not asyncio's subprocess: its transport kills a still-running child when it is
        # closed or collected, which (from Python 3.12, whose child watcher lives in the
        # event loop) happens as the agent's loop ends, taking the engines down with it.
        # Popen only forks and execs here (it does not wait), so it does not block the loop.
        try:
            popen = subprocess.Popen(  # noqa: ASYNC220
                launch.argv,
                stdin=subprocess.DEVNULL,
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
        start_time = process_start_time(popen.pid)
        return Handle(
            shard_id=launch.shard_id,
            pid=popen.pid,
            port=launch.port,
            ref=EngineProcess(popen.pid, start_time, popen, sandboxed=launch.sandboxed),
            start_time=start_time,
            sandboxed=launch.sandboxed,
        )

    async def adopt(self, record: ShardRecord) -> Handle | None:
        if record.pid <= 0 or record.start_time is None:
            return None
        if not process_running(record.pid, record.start_time):
            return None
        # Every engine this runtime starts leads its own session; a process that does not is
        # not one of ours, whatever its start time.
        try:
            if os.getsid(record.pid) != record.pid:
                return None
        except OSError:
            return None
        return Handle(
            shard_id=record.shard_id,
            pid=record.pid,
            port=record.port,
            ref=EngineProcess(record.pid, record.start_time, sandboxed=record.sandboxed),
            start_time=record.start_time,
            sandboxed=record.sandboxed,
        )

    async def wait(self, handle: Handle) -> int | None:
        engine = _engine(handle)
        await engine.gone()
        # What it forked does not outlive it, as after a stop: an engine's worker processes
        # (vLLM's engine core holds the GPU memory) or, under bwrap, the sandbox's own init
        # and the engine inside it when bwrap's outer process was the one killed.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine.pid, signal.SIGKILL)
        if engine.popen is None:
            return None
        # Ended already: this only collects the exit status.
        code = engine.popen.wait()
        if engine.sandboxed and 128 < code <= 128 + 64:
            return -(code - 128)  # bwrap's words for an engine killed by a signal
        return code

    def alive(self, handle: Handle) -> bool:
        return _engine(handle).running()

    async def stop(self, handle: Handle, grace: float) -> None:
        engine = _engine(handle)
        if not engine.running():
            return
        # The engine leads its own process group: signal the whole group so that helpers
        # it forked (tokenizer workers, sidecars) go with it. Under bwrap, all but bwrap.
        if engine.sandboxed:
            _signal_group(engine.pid, signal.SIGTERM, spare=engine.pid)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(engine.gone(), timeout=grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.pid, signal.SIGKILL)
            await engine.gone()
        if engine.popen is not None:
            engine.popen.wait()
        # Anything left in the group after the leader is gone is killed too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(engine.pid, signal.SIGKILL)
